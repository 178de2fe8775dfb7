"""`python -m jaxserve.entrypoints.cli ...`: the same as the `jaxserve` command."""

import sys

from jaxserve.entrypoints.cli import main

sys.exit(main())
