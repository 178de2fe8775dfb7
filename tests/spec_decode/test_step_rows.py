"""Sampling rows of a step that verifies proposals: one per proposal position plus one."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.runner.step_input import build_step_arrays


def test_verifying_request_gets_a_row_per_position():
    """A decode (1 row), a request verifying 2 proposals (3 rows on its last 3 tokens),
    a prompt chunk (no row), a fan-out prompt end (2 rows on its last token)."""
    out = SchedulerOutput(scheduled=[
        ScheduledRequest("d", [9], 5, [1], 1),
        ScheduledRequest("v", [5, 6, 7], 4, [2], 1, num_spec_tokens=2),
        ScheduledRequest("c", [1, 2, 3, 4], 0, [3], 0),
        ScheduledRequest("f", [8, 8], 0, [4], 2)])
    assert out.num_rows == 1 + 3 + 1 + 2
    arrays = build_step_arrays(out, 16, 4, 16, 2, num_sample_rows=8)
    # tokens: d@0, v@1..3, c@4..7, f@8..9
    assert arrays.logits_indices.tolist() == [0, 1, 2, 3, 9, 9, 0, 0]
    assert arrays.row_request_ids == ["d", "v", "v", "v", "f", "f"]
    assert arrays.block_tables.shape == (4, 2)
    assert arrays.kv_lens.tolist() == [6, 7, 4, 2]
    np.testing.assert_array_equal(arrays.positions[1:4], [4, 5, 6])


def test_sampling_rows_beyond_the_row_bucket_are_refused():
    out = SchedulerOutput(scheduled=[ScheduledRequest("v", [5, 6, 7, 8], 4, [2], 1,
                                                      num_spec_tokens=3)])
    with pytest.raises(ValueError, match="sampling rows"):
        build_step_arrays(out, 16, 2, 16, 2, num_sample_rows=2)
