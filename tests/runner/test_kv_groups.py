"""The runner with a hybrid KV cache: kept block tables and step arrays per KV cache group,
the pool and page size by slots, the worker's layout, and steps equal to the plain pool's.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.plans import CopyPlan, KVPlans, SwapPlan
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.runner.block_table_rows import BlockTableRows, group_delta
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.serving import serving_kv_layout
from jaxserve.runner.sizing import page_bytes, pages_per_sequence
from jaxserve.runner.step_input import build_step_arrays
from jaxserve.runner.warmup import dummy_steps
from jaxserve.runner.worker import Worker
from jaxserve.sample.metadata import RowSpec, build_sampling_metadata
from jaxserve.sampling_params import SamplingParams
from jaxserve.utils import cdiv
from models.kv_groups import KVGroupLayout, single_group
from models.linear import ServingChoice
from models.model import Model, random_params
from tests.models.test_kv_groups_decoder import CFG, LAYOUT


def entry(rid, tokens, start, pages, samples=1, pages_from=None, groups=()):
    return ScheduledRequest(rid, tokens, start, pages, samples, pages_from=pages_from,
                            group_pages=tuple(groups))


def test_group_delta_reads_group_pages():
    s = entry("a", [1], 9, [4], pages_from=2, groups=[(1, [7, 8]), (0, [0, 5, 6])])
    assert group_delta(s, 0) == (2, [4])
    assert group_delta(s, 1) == (1, [7, 8])
    assert group_delta(s, 2) == (0, [0, 5, 6])
    whole = dataclasses.replace(s, pages_from=None)  # hand-built: whole tables, kept nowhere
    assert group_delta(whole, 2) == (None, [0, 5, 6])
    with pytest.raises(ValueError, match="request 'a': no block table of KV cache group 3"):
        group_delta(s, 3)


def test_kept_rows_per_group_apply_their_own_deltas():
    # Group 1 is a sliding one: a later delta gives its first pages back (null, 0).
    rows = [BlockTableRows(5, num_rows=1), BlockTableRows(5, num_rows=1)]
    steps = [[entry("a", [1] * 9, 0, [3, 4, 9], pages_from=0, groups=[(0, [5, 6, 7])])],
             [entry("a", [1], 9, [], pages_from=3, groups=[(3, [])])],
             [entry("a", [1], 12, [2], pages_from=3, groups=[(0, [0, 0, 7, 8])])]]
    want = [([3, 4, 9, 0, 0], [5, 6, 7, 0, 0]), ([3, 4, 9, 0, 0], [5, 6, 7, 0, 0]),
            ([3, 4, 9, 2, 0], [0, 0, 7, 8, 0])]
    for sched, tables in zip(steps, want, strict=True):
        for g in (0, 1):
            table, lengths = rows[g].gather(sched, 2, g)
            np.testing.assert_array_equal(table[0], tables[g])
            assert not table[1].any() and lengths[0] == len(np.trim_zeros(tables[g], "b"))


def test_step_arrays_per_group_hand_checked():
    # Three groups (a full one, two sliding ones); page size 4; "a" decodes at position 13
    # with its sliding groups' first two pages given back, "b" runs a 3-token chunk.
    out = SchedulerOutput(scheduled=[
        entry("a", [50], 13, [7, 3, 9, 2], groups=[(0, [0, 0, 5, 6]), (0, [0, 0, 11, 12])]),
        entry("b", [60, 61, 62], 1, [8], samples=0, groups=[(0, [10]), (0, [4])])])
    got = build_step_arrays(out, num_tokens=8, num_rows=3, page_size=4, max_pages_per_seq=4,
                            num_groups=3)
    pad = [0] * 4
    np.testing.assert_array_equal(got.slot_mapping, [[9, 33, 34, 35] + pad,
                                                     [25, 41, 42, 43] + pad,
                                                     [49, 17, 18, 19] + pad])
    np.testing.assert_array_equal(got.block_tables, [
        [[7, 3, 9, 2], [8, 0, 0, 0], [0] * 4],
        [[0, 0, 5, 6], [10, 0, 0, 0], [0] * 4],
        [[0, 0, 11, 12], [4, 0, 0, 0], [0] * 4]])
    # Everything else is the one-group step's (group 0's tables alone).
    plain = build_step_arrays(SchedulerOutput(scheduled=[
        dataclasses.replace(s, group_pages=()) for s in out.scheduled]), 8, 3, 4, 4)
    np.testing.assert_array_equal(plain.slot_mapping, got.slot_mapping[0])
    np.testing.assert_array_equal(plain.block_tables, got.block_tables[0])
    for name in ("input_ids", "prev_rows", "positions", "kv_lens", "cu_q_lens",
                 "logits_indices"):
        np.testing.assert_array_equal(getattr(plain, name), getattr(got, name), err_msg=name)


def test_step_arrays_from_kept_rows_per_group_equal_those_from_whole_tables():
    rows = [BlockTableRows(4, num_rows=1) for _ in range(2)]
    whole = [entry("a", [5], 12, [3, 4, 6, 1], groups=[(0, [0, 0, 7, 8])]),
             entry("b", [6, 7], 0, [9], groups=[(0, [2])])]
    first = [dataclasses.replace(whole[0], pages_from=0, page_ids=[3, 4, 6],
                                 group_pages=((0, [5, 11, 7]),)),
             dataclasses.replace(whole[1], pages_from=0)]
    later = [dataclasses.replace(whole[0], pages_from=3, page_ids=[1],
                                 group_pages=((0, [0, 0, 7, 8]),)),
             dataclasses.replace(whole[1], pages_from=1, page_ids=[], group_pages=((1, []),))]
    build_step_arrays(SchedulerOutput(scheduled=[
        dataclasses.replace(first[0], token_ids=[5] * 3, start_pos=9), first[1]]),
        8, 4, 4, 4, tables=rows)
    ref = build_step_arrays(SchedulerOutput(scheduled=whole), 8, 4, 4, 4, num_groups=2)
    got = build_step_arrays(SchedulerOutput(scheduled=later), 8, 4, 4, 4, tables=rows)
    for name, value in ref.device_tree().items():
        np.testing.assert_array_equal(got.device_tree()[name], value, err_msg=name)
    for kept in rows:
        kept.release(["a", "b"])
        assert kept.num_kept == 0


@pytest.mark.parametrize("groups,kw,match", [
    ([], dict(num_groups=2), r"request 'a': group_pages holds 0 block tables; a KV cache "
                             r"of 2 group\(s\) needs 1"),
    ([(0, [5]), (0, [6])], dict(num_groups=2), "group_pages holds 2 block tables"),
    ([(0, [5])], {}, r"group_pages holds 1 block tables; a KV cache of 1 group\(s\) needs 0"),
    ([(0, [5]), (0, [])], dict(num_groups=3),
     "position lies past its request's block table of KV cache group 2"),
    ([(0, [5, 6, 7])], dict(num_groups=2), "a block table of 3 pages exceeds "
                                           "max_pages_per_seq=2"),
])
def test_step_arrays_with_bad_group_tables_are_errors(groups, kw, match):
    out = SchedulerOutput(scheduled=[entry("a", [1, 2], 2, [3], groups=groups)])
    with pytest.raises(ValueError, match=match):
        build_step_arrays(out, 4, 2, 4, 2, **kw)


def test_pages_per_sequence_counts_each_groups_pages():
    assert pages_per_sequence(single_group(6), 64, 4) == 16
    # a full group's 16 pages, and per sliding group its window's 2 pages and one more
    assert pages_per_sequence(LAYOUT, 64, 4) == 16 + 3 + 3
    assert pages_per_sequence(KVGroupLayout((0, 100), (0, 1), (0, 0), 1), 64, 4) == 32


# ------------------------------------------------------------------ the device side
PAGE, NUM_PAGES, MAX_LEN = 4, 40, 32
PROMPTS = {"a": [5, 17, 3, 88, 41, 2, 9, 60, 33, 71, 12, 4, 50], "b": [8, 21, 64, 7, 30, 1]}
# Prompt tokens per step (chunked), then decodes of both: buckets of 8 and 4 tokens.
CHUNKS = [{"a": 5, "b": 3}, {"a": 5, "b": 3}, {"a": 3, "b": 1}]


@pytest.fixture(scope="module")
def params():
    return jax.tree_util.tree_map(lambda x: x * 3.0, random_params(CFG, seed=3))


class Pages:
    """A stand-in for the host KV manager: one free list for every group, per request and
    group a table; a sliding group gives back its pages wholly before the window (they go
    to the head of the free list and are poisoned with NaN on the device)."""

    def __init__(self, runner: ModelRunner, windows):
        self.runner, self.windows = runner, windows
        self.free = list(range(NUM_PAGES - 1, 0, -1))
        self.tables = {}  # (request, group) -> page ids
        self.sent = {}  # (request, group) -> the table the runner holds

    def entry(self, rid: str, tokens: list[int], start: int, samples: int) -> ScheduledRequest:
        end = start + len(tokens)
        deltas = []
        for g, window in enumerate(self.windows):
            table = self.tables.setdefault((rid, g), [])
            while len(table) < cdiv(end, PAGE):
                table.append(self.free.pop())
            for p in range(max(0, start - window + 1) // PAGE if window else 0):
                if table[p]:
                    self.runner.kv_pages = self.runner.kv_pages.at[:, :, :, table[p]].set(
                        jnp.nan)
                    self.free.append(table[p])
                    table[p] = 0
            old = self.sent.get((rid, g), [])
            common = min(len(old), len(table))
            same = next((i for i in range(common) if old[i] != table[i]), common)
            deltas.append((same, table[same:]))
            self.sent[(rid, g)] = list(table)
        (pages_from, page_ids), *groups = deltas
        return ScheduledRequest(rid, tokens, start, page_ids, samples, pages_from=pages_from,
                                group_pages=tuple(groups))


def _generate(model: Model, kv_layout, num_decodes: int = 4):
    """Greedy tokens and top logprobs of PROMPTS, stepped by hand through a runner."""
    runner = ModelRunner(model, NUM_PAGES, PAGE, MAX_LEN, max_num_seqs=2,
                         max_num_batched_tokens=8, kv_layout=kv_layout)
    pages = Pages(runner, runner.model.kv_groups.windows)
    done = {rid: 0 for rid in PROMPTS}
    seqs = {rid: list(p) for rid, p in PROMPTS.items()}
    rows = [RowSpec(SamplingParams(temperature=0.0, logprobs=3))] * 2
    tokens, logprobs = [], []
    for chunk in CHUNKS + [{"a": 1, "b": 1}] * num_decodes:
        sched = []
        for rid, n in chunk.items():
            start = done[rid]
            done[rid] += n
            sched.append(pages.entry(rid, seqs[rid][start:start + n], start,
                                     int(done[rid] == len(seqs[rid]))))
        out = SchedulerOutput(scheduled=sched).decodes_first()
        num_rows = runner.step_shape(out)[1]
        sampling = build_sampling_metadata(rows[:out.num_rows], num_rows, CFG.vocab_size)
        res = runner.execute(out, sampling)
        for rid, token in zip(res.row_request_ids, res.token_ids, strict=True):
            seqs[rid].append(int(token))
        tokens.append(dict(zip(res.row_request_ids, res.token_ids.tolist(), strict=True)))
        logprobs.append(res.topk_logprobs)
    return runner, tokens, np.concatenate(logprobs)


def test_runner_steps_over_groups_equal_the_plain_pools(params):
    model = Model(CFG, params, serving=ServingChoice("xla"))
    plain, want_tokens, want_lp = _generate(model, None)
    hybrid, tokens, lp = _generate(model, LAYOUT)
    assert hybrid.kv_pages.shape[0] == 2 and plain.kv_pages.shape[0] == 6  # slots, layers
    assert (hybrid.num_kv_groups, plain.num_kv_groups) == (3, 1)
    assert hybrid.kv_layout == LAYOUT and plain.kv_layout == single_group(6)
    assert tokens == want_tokens
    assert len({t for step in tokens for t in step.values()}) > 3  # not a degenerate run
    np.testing.assert_allclose(lp, want_lp, atol=1e-5, rtol=0)
    # The sliding groups gave pages back (null entries in their kept rows) ...
    for kept in hybrid.group_tables[1:]:
        assert not kept.table[kept.slot_of["a"], :2].any()
    # ... and releasing a request forgets its rows in every group.
    hybrid.apply_kv_changes(SchedulerOutput(released_request_ids=["a", "b"]))
    assert all(t.num_kept == 0 for t in hybrid.group_tables)


def test_warmup_steps_carry_every_groups_tables(params):
    runner = ModelRunner(Model(CFG, params, serving=ServingChoice("xla")), NUM_PAGES, PAGE, MAX_LEN,
                         max_num_seqs=2, max_num_batched_tokens=8, kv_layout=LAYOUT)
    for bucket in runner.buckets:
        for out, _ in dummy_steps(runner, bucket):
            arrays = runner.prepare_model_step(out).arrays
            assert arrays.block_tables.shape == (3, runner.sample_rows(bucket), 8)
            assert arrays.slot_mapping.shape == (3, bucket)
            assert not arrays.block_tables.any() and not (arrays.slot_mapping // PAGE).any()


def test_worker_sizes_the_pool_by_slots(params):
    config = EngineConfig.from_kwargs(max_model_len=MAX_LEN, block_size=8,
                                      kv_cache_memory_gib=0.001, attention_backend="xla")
    tokenizer = SimpleNamespace(eos_token_id=None)
    model = Model(CFG, params, serving=ServingChoice("xla"))
    plain = Worker(config, model, tokenizer)
    hybrid = Worker(config, model, tokenizer, kv_layout=True)
    assert not plain.model.is_hybrid and plain.kv_layout == single_group(6)
    assert hybrid.kv_layout == LAYOUT and hybrid.model.is_hybrid
    # A page holds 2 of 6 layers: a third of the bytes, three times the pages.
    assert hybrid.limits.bytes_per_page * 3 == plain.limits.bytes_per_page
    assert hybrid.limits.bytes_per_page == page_bytes(hybrid.model, 8)
    assert abs(hybrid.limits.num_pages - 3 * plain.limits.num_pages) < 3
    runner = hybrid.init_device(max_num_seqs=2, num_swap_slots=0)
    assert runner.num_kv_groups == 3
    assert runner.kv_pages.shape == (2, 2, 2, hybrid.limits.num_pages, 8, 8)
    # The engine argument block_size is the page size inside (`CacheConfig.page_size`).
    assert config.cache.page_size == runner.page_size == 8
    assert hybrid.kv_capacity_tokens == (hybrid.limits.num_pages - 1) * 8 // 3
    # False keeps one group; windows of max_model_len or more give back nothing.
    assert serving_kv_layout(hybrid.model, MAX_LEN, False) is None
    assert serving_kv_layout(model, 8, True) == single_group(6)  # no window gives back
    uniform = Model(dataclasses.replace(CFG, layer_windows=(8,) * 6), params,
                    serving=ServingChoice("xla"))
    assert serving_kv_layout(uniform, MAX_LEN, True) == single_group(6, 8)
    assert serving_kv_layout(model, MAX_LEN, None) is None
    assert serving_kv_layout(hybrid.model, MAX_LEN, None) == LAYOUT


def test_copy_and_swap_move_every_slot_of_a_page(params):
    # A page of a hybrid pool holds its group's layers in all its slots; page plans (still
    # on axis 3) move them all.
    runner = ModelRunner(Model(CFG, params, serving=ServingChoice("xla")), 8, PAGE, MAX_LEN,
                         max_num_seqs=2,
                         max_num_batched_tokens=8, num_swap_slots=2, kv_layout=LAYOUT)
    pool = np.random.default_rng(0).standard_normal(runner.kv_pages.shape).astype(np.float32)
    runner.kv_pages = jnp.asarray(pool)
    runner.execute_plans(KVPlans(swap_out=SwapPlan([(3, 1)], to_host=True),
                                 swap_in=SwapPlan([(1, 5)], to_host=False),
                                 copy=CopyPlan([(2, 6)])))
    got = np.asarray(runner.kv_pages)
    assert got.shape[0] == LAYOUT.num_slots
    np.testing.assert_array_equal(got[:, :, :, 5], pool[:, :, :, 3])
    np.testing.assert_array_equal(got[:, :, :, 6], pool[:, :, :, 2])
    np.testing.assert_array_equal(got[:, :, :, 1:5], pool[:, :, :, 1:5])  # 0: padding
