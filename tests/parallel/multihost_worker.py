"""One process of the two-process multi-host test (run by test_multihost.py, not pytest)."""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    address, process_id = sys.argv[1], int(sys.argv[2])
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    from jaxserve.parallel.multihost import initialize

    initialize(address, 2, process_id)
    from tests.parallel.test_multihost import run_tiny

    print("RESULT " + json.dumps({"devices": jax.device_count(),
                                  "tokens": run_tiny(tensor_parallel_size=4)}), flush=True)
