"""`build_step_arrays`: hand-checked steps and a randomized per-request reference."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.core.scheduler_output import PLACEHOLDER, ScheduledRequest, SchedulerOutput
from jaxserve.runner.step_input import build_step_arrays

KEYS = ("input_ids", "prev_rows", "positions", "slot_mapping", "block_tables", "kv_lens",
        "cu_q_lens", "logits_indices", "sample_rows")


def req(rid: str, token_ids: list[int], start_pos: int, pages: list[int],
        num_samples: int) -> ScheduledRequest:
    # Positional, so the tests do not depend on the page-table field's name.
    return ScheduledRequest(rid, token_ids, start_pos, pages, num_samples)


def check(arrays, expected: dict) -> None:
    tree = arrays.device_tree()
    assert set(tree) == set(KEYS)
    expected = {"prev_rows": [-1] * len(expected["input_ids"]),
                "sample_rows": [len(expected["row_request_ids"])], **expected}
    for key in KEYS:
        assert tree[key].dtype == np.int32, key
        np.testing.assert_array_equal(tree[key], np.asarray(expected[key]), err_msg=key)
    assert arrays.row_request_ids == expected["row_request_ids"]


def test_prefill_chunk_decode_and_fan_out_padded_to_the_bucket():
    out = SchedulerOutput(scheduled=[
        req("chunk", [10, 11, 12, 13, 14], 2, [7, 3], 0),  # positions 2..6, starts mid-page
        req("dec", [50], 9, [5, 2, 8], 1),  # position 9: page 8, offset 1
        req("fan", [60, 61, 62], 0, [9], 3)])  # prompt ends here, n=3 samples
    pad = [0] * 7
    check(build_step_arrays(out, num_tokens=16, num_rows=6, page_size=4, max_pages_per_seq=4), {
        "input_ids": [10, 11, 12, 13, 14, 50, 60, 61, 62] + pad,
        "positions": [2, 3, 4, 5, 6, 9, 0, 1, 2] + pad,
        # page * 4 + offset; padding tokens write slot 0 of the null page
        "slot_mapping": [30, 31, 12, 13, 14, 33, 36, 37, 38] + pad,
        "block_tables": [[7, 3, 0, 0], [5, 2, 8, 0], [9, 0, 0, 0]] + [[0] * 4] * 3,
        "kv_lens": [7, 10, 3, 0, 0, 0],
        "cu_q_lens": [0, 5, 6, 9, 9, 9, 9],
        # no row for the mid-prompt chunk; three rows on the fan-out's last token
        "logits_indices": [5, 8, 8, 8, 0, 0],
        "row_request_ids": ["dec", "fan", "fan", "fan"]})


def test_decode_batch_that_fills_the_bucket_exactly():
    out = SchedulerOutput(scheduled=[req("a", [4], 0, [6], 1), req("b", [5], 15, [2, 1], 1),
                                     req("c", [6], 16, [3, 4, 9], 1)])
    check(build_step_arrays(out, 3, 3, 8, 3), {
        "input_ids": [4, 5, 6], "positions": [0, 15, 16], "slot_mapping": [48, 15, 72],
        "block_tables": [[6, 0, 0], [2, 1, 0], [3, 4, 9]], "kv_lens": [1, 16, 17],
        "cu_q_lens": [0, 1, 2, 3], "logits_indices": [0, 1, 2],
        "row_request_ids": ["a", "b", "c"]})


def test_placeholders_take_the_previous_steps_sampling_rows():
    # "b" and "c" decode the token their previous step samples (rows 2 and 0 there).
    out = SchedulerOutput(scheduled=[req("a", [4], 0, [6], 1),
                                     req("b", [PLACEHOLDER], 15, [2, 1], 1),
                                     req("c", [PLACEHOLDER], 16, [3, 4, 9], 1)])
    check(build_step_arrays(out, 4, 4, 8, 3, prev_rows={"c": 0, "x": 1, "b": 2}), {
        "input_ids": [4, 0, 0, 0], "prev_rows": [-1, 2, 0, -1],
        "positions": [0, 15, 16, 0], "slot_mapping": [48, 15, 72, 0],
        "block_tables": [[6, 0, 0], [2, 1, 0], [3, 4, 9], [0, 0, 0]],
        "kv_lens": [1, 16, 17, 0], "cu_q_lens": [0, 1, 2, 3, 3],
        "logits_indices": [0, 1, 2, 0], "row_request_ids": ["a", "b", "c"]})


@pytest.mark.parametrize("prev_rows", [None, {"a": 0}])
def test_placeholder_without_a_previous_row_is_refused(prev_rows):
    out = SchedulerOutput(scheduled=[req("b", [PLACEHOLDER], 3, [2], 1)])
    with pytest.raises(ValueError, match="placeholder"):
        build_step_arrays(out, 4, 4, 8, 3, prev_rows=prev_rows)


def test_empty_step_is_all_padding():
    arrays = build_step_arrays(SchedulerOutput(), 8, 4, 16, 2)
    check(arrays, {"input_ids": [0] * 8, "positions": [0] * 8, "slot_mapping": [0] * 8,
                   "block_tables": np.zeros((4, 2)), "kv_lens": [0] * 4, "cu_q_lens": [0] * 5,
                   "logits_indices": [0] * 4, "row_request_ids": []})


@pytest.mark.parametrize("step,bucket,match", [
    ([req("a", [1] * 9, 0, [1, 2], 1)], (8, 4), "does not fit"),  # tokens
    ([req(f"r{i}", [1], 0, [1], 0) for i in range(5)], (8, 4), "does not fit"),  # requests
    ([req("a", [1], 0, [1], 3), req("b", [1], 0, [2], 2)], (8, 4), "does not fit"),  # rows
    ([req("a", [1], 0, [1, 2, 3], 1)], (8, 4), "max_pages_per_seq"),
    ([req("a", [1, 2], 3, [1], 1)], (8, 4), "past its request's block table"),
])
def test_refuses_steps_that_do_not_fit(step, bucket, match):
    with pytest.raises(ValueError, match=match):
        build_step_arrays(SchedulerOutput(scheduled=step), *bucket, page_size=4,
                          max_pages_per_seq=2)


def reference(steps: list[tuple], num_tokens: int, num_rows: int, page_size: int,
              max_pages: int) -> dict:
    """The step arrays from a plain loop over requests and tokens."""
    exp = {"input_ids": [0] * num_tokens, "positions": [0] * num_tokens,
           "slot_mapping": [0] * num_tokens, "block_tables": [[0] * max_pages] * num_rows,
           "kv_lens": [0] * num_rows, "cu_q_lens": [0] * (num_rows + 1),
           "logits_indices": [0] * num_rows, "row_request_ids": []}
    exp["block_tables"] = [list(row) for row in exp["block_tables"]]
    t = 0
    for i, (rid, tokens, start, pages, samples) in enumerate(steps):
        for j, token in enumerate(tokens):
            pos = start + j
            exp["input_ids"][t] = token
            exp["positions"][t] = pos
            exp["slot_mapping"][t] = pages[pos // page_size] * page_size + pos % page_size
            t += 1
        exp["block_tables"][i][:len(pages)] = pages
        exp["kv_lens"][i] = start + len(tokens)
        for _ in range(samples):
            exp["logits_indices"][len(exp["row_request_ids"])] = t - 1
            exp["row_request_ids"].append(rid)
    for i in range(num_rows):
        exp["cu_q_lens"][i + 1] = exp["cu_q_lens"][i] + (len(steps[i][1]) if i < len(steps)
                                                         else 0)
    return exp


def test_matches_a_per_request_reference_on_random_steps():
    rng = np.random.default_rng(0)
    for _ in range(300):
        page_size = int(rng.choice([1, 2, 4, 16]))
        max_pages = int(rng.integers(1, 6))
        steps = []
        for i in range(int(rng.integers(0, 7))):
            num_pages = int(rng.integers(1, max_pages + 1))
            start = int(rng.integers(0, num_pages * page_size))
            n = int(rng.integers(1, num_pages * page_size - start + 1))
            pages = rng.choice(np.arange(1, 64), num_pages, replace=False).tolist()
            steps.append((f"r{i}", rng.integers(0, 1000, n).tolist(), start, pages,
                          int(rng.choice([0, 1, 1, 2, 4]))))
        out = SchedulerOutput(scheduled=[req(*s) for s in steps])
        num_tokens = out.total_num_scheduled_tokens + int(rng.integers(0, 6))
        num_rows = max(out.num_rows, 1) + int(rng.integers(0, 3))
        arrays = build_step_arrays(out, num_tokens, num_rows, page_size, max_pages)
        check(arrays, reference(steps, num_tokens, num_rows, page_size, max_pages))


@pytest.mark.parametrize("bucket", [(32, 8), (25, 5)])
def test_matches_the_reference_on_the_former_bench_case(bucket):
    # The step that tests/bench used to compare the bench copy of this builder on.
    steps = [("decode", [5], 20, [3, 9, 4], 1),
             ("chunk", list(range(10, 27)), 8, [7, 2, 11, 12], 0),  # mid-prompt
             ("fanout", list(range(30, 36)), 0, [6], 2),  # n=2 at prompt end
             ("decode2", [8], 7, [1], 1)]
    out = SchedulerOutput(scheduled=[req(*s) for s in steps])
    check(build_step_arrays(out, *bucket, 8, 6), reference(steps, *bucket, 8, 6))
