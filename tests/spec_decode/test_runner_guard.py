"""Until the runner verifies proposals, a step carrying them is refused, not run as a chunk."""

from __future__ import annotations

import pytest

from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.runner.step_input import build_step_arrays


def test_a_step_with_proposals_is_refused():
    out = SchedulerOutput(scheduled=[ScheduledRequest("a", [5, 6, 7], 4, [1], 1,
                                                      num_spec_tokens=2)])
    with pytest.raises(NotImplementedError, match="speculative"):
        build_step_arrays(out, 8, 4, 16, 2)
