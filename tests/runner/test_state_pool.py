"""`state_pool`: the state plans' row copies and host swaps against NumPy, the step's
`state_slots` row, and the page pool sized after the state slots."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.plans import CopyPlan, KVPlans, StatePlans, SwapPlan
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.core.state_slots import StateGroupSpec
from jaxserve.runner.kv_ops import HostSwapSpace, run_plans
from jaxserve.runner.sizing import page_bytes, pool_pages, state_group
from jaxserve.runner.state_pool import (
    STATE_PAIRS,
    HostStateSpace,
    cache_pages,
    copy_rows,
    pad_slots,
    run_state_plans,
    with_pages,
)
from jaxserve.runner.step_input import build_step_arrays
from models.gated_deltanet import HybridCache
from models.model import Model, random_params
from models.registry import arch_config_from_hf

NUM_SLOTS = 20  # more than two pieces of STATE_PAIRS rows
# Two pools of different row shapes, slot on axis 1 (as conv and recurrent).
SHAPES = ((2, NUM_SLOTS, 3, 4), (2, NUM_SLOTS, 2, 2, 3))
HF = dict(architectures=["Qwen3_5ForCausalLM"], vocab_size=64, hidden_size=32,
          intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
          num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
          linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
          linear_conv_kernel_dim=4, max_position_embeddings=512)


def pools(seed: int = 0) -> tuple[np.ndarray, ...]:
    """Pools whose every row holds distinct values (the null row too)."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(np.float32) for s in SHAPES)


def on_device(states):
    return tuple(jnp.array(s) for s in states)  # fresh copies: the scatter donates


def test_pad_slots_pads_with_the_null_slot_and_refuses_more_than_a_piece():
    np.testing.assert_array_equal(pad_slots(np.array([3, 5])), [3, 5] + [0] * (STATE_PAIRS - 2))
    with pytest.raises(ValueError, match=f"{STATE_PAIRS + 1} state slots in one piece"):
        pad_slots(np.ones(STATE_PAIRS + 1, np.int32))


def test_copies_read_every_source_before_any_write_across_pieces():
    """A chain where each dst is the next pair's src (a slot given back and handed out
    again), longer than a piece: every copy reads what the previous step left."""
    ref = pools()
    pairs = np.array([(i, i + 1) for i in range(1, 2 * STATE_PAIRS + 2)], np.int32)
    got = copy_rows(on_device(ref), pairs)
    for want, out in zip(ref, got, strict=True):
        expect = want.copy()
        expect[:, pairs[:, 1]] = want[:, pairs[:, 0]]
        expect[:, 0] = want[:, 0]  # padding copies the null row onto itself
        np.testing.assert_array_equal(np.asarray(out), expect)


def test_swap_out_then_in_moves_rows_and_one_host_slot_feeds_two():
    ref = pools(1)
    host = HostStateSpace()
    out_pairs = np.array([(s, 100 + s) for s in range(3, 3 + STATE_PAIRS + 1)], np.int32)
    host.swap_out(on_device(ref), out_pairs)
    assert len(host) == STATE_PAIRS + 1
    # Row 3's state into slots 15 and 16 (a request swapped in, then forked), row 4's into 2.
    states = host.swap_in(on_device(pools(2)), np.array([(103, 15), (103, 16), (104, 2)]))
    assert len(host) == STATE_PAIRS + 1 - 2  # the host slots read are let go
    for want, other, got in zip(ref, pools(2), states, strict=True):
        expect = other.copy()
        expect[:, [15, 16, 2]] = want[:, [3, 3, 4]]
        expect[:, 0] = 0  # padding rows write zeros into the null slot, never read
        np.testing.assert_array_equal(np.asarray(got), expect)


def test_state_plans_run_swap_out_then_copy_then_swap_in():
    """Slot 5's state swaps out while slot 5 takes a fork copy of slot 7 and slot 7 takes
    a swapped-in state: each move reads what the previous step left."""
    ref, pages = pools(3), jnp.zeros(3)
    host = HostStateSpace()
    host.swap_out(on_device(ref), np.array([[9, 40]], np.int32))  # an earlier swap-out
    cache = HybridCache(pages, *on_device(ref))
    plans = StatePlans(swap_out=SwapPlan([(5, 41)], to_host=True), copy=CopyPlan([(7, 5)]),
                       swap_in=SwapPlan([(40, 7)], to_host=False))
    cache = run_state_plans(cache, host, plans)
    assert cache.pages is pages
    for want, got in zip(ref, (cache.conv, cache.recurrent), strict=True):
        got = np.asarray(got)
        np.testing.assert_array_equal(got[:, 5], want[:, 7])
        np.testing.assert_array_equal(got[:, 7], want[:, 9])
    back = host.swap_in(on_device(ref), np.array([[41, 1]], np.int32))
    np.testing.assert_array_equal(np.asarray(back[0])[:, 1], ref[0][:, 5])


def test_state_plans_for_a_plain_page_pool_are_refused():
    plans = KVPlans(state=StatePlans(copy=CopyPlan([(1, 2)])))
    pages = jnp.zeros((1, 2, 1, 2, 2, 2))
    with pytest.raises(ValueError, match="state plans for a cache without state pools"):
        run_plans(pages, HostSwapSpace(0, (1, 2, 1, 2, 2), np.float32), plans)
    assert cache_pages(pages) is pages and with_pages(pages, 1) == 1


def test_step_carries_each_rows_state_slot_and_the_null_slot_for_padding():
    out = SchedulerOutput(scheduled=[
        ScheduledRequest("a", [1, 2, 3], 0, [1], 1, state_slot=4),
        ScheduledRequest("b", [5], 6, [2, 3], 1, state_slot=2)])
    arrays = build_step_arrays(out, num_tokens=8, num_rows=4, page_size=4,
                               max_pages_per_seq=2, state_slots=True)
    tree = arrays.device_tree()
    assert tree["state_slots"].dtype == np.int32
    np.testing.assert_array_equal(tree["state_slots"], [4, 2, 0, 0])
    plain = build_step_arrays(out, num_tokens=8, num_rows=4, page_size=4, max_pages_per_seq=2)
    assert "state_slots" not in plain.device_tree()


def test_page_pool_is_sized_after_the_state_slots():
    cfg = arch_config_from_hf(HF)
    model = Model(cfg, random_params(cfg, seed=0))
    per_page = page_bytes(model, 16)
    budget_pages, max_num_seqs = 100, 6
    config = EngineConfig.from_kwargs(kv_cache_memory_gib=budget_pages * per_page / 2**30,
                                      max_num_seqs=max_num_seqs, attention_backend="xla")
    group = state_group(config, model)
    # With prefix caching (the default) max_num_seqs more rows hold its state snapshots.
    assert group == StateGroupSpec(max_num_seqs + 1, model.state_bytes_per_slot,
                                   num_snapshot_slots=max_num_seqs)
    state_bytes = group.num_rows * group.bytes_per_slot
    assert pool_pages(config, model) == (budget_pages * per_page - state_bytes) // per_page
    assert pool_pages(config, model) < budget_pages
    # An explicit num_kv_blocks is kept as given.
    given = EngineConfig.from_kwargs(num_kv_blocks=7, max_num_seqs=max_num_seqs)
    assert pool_pages(given, model) == 7
    # State slots that outgrow the budget are an error naming what to change.
    short = EngineConfig.from_kwargs(kv_cache_memory_gib=state_bytes / 2 / 2**30,
                                     max_num_seqs=max_num_seqs)
    with pytest.raises(ValueError, match="13 linear-attention state slots .* outgrow the KV "
                                         "memory budget .* lower max_num_seqs .* or "
                                         "num_state_snapshots .* raise kv_cache_memory_gib"):
        pool_pages(short, model)
    # The snapshot rows follow num_state_snapshots, and none without prefix caching.
    some = EngineConfig.from_kwargs(max_num_seqs=max_num_seqs, num_state_snapshots=2)
    assert state_group(some, model).num_rows == max_num_seqs + 1 + 2
    off = EngineConfig.from_kwargs(max_num_seqs=max_num_seqs, enable_prefix_caching=False,
                                   num_state_snapshots=2)
    assert state_group(off, model).num_snapshot_slots == 0
    with pytest.raises(ValueError, match="num_state_snapshots must be None or >= 0"):
        EngineConfig.from_kwargs(num_state_snapshots=-1)
    # Speculative decoding adds a backup slot per sequence, which the pages make room for.
    spec = EngineConfig.from_kwargs(kv_cache_memory_gib=budget_pages * per_page / 2**30,
                                    max_num_seqs=max_num_seqs, attention_backend="xla",
                                    speculative_config={"method": "ngram",
                                                        "num_speculative_tokens": 2})
    backed = state_group(spec, model)
    assert backed == StateGroupSpec(2 * max_num_seqs + 1, model.state_bytes_per_slot,
                                    num_backup_slots=max_num_seqs,
                                    num_snapshot_slots=max_num_seqs)
    assert backed.num_request_slots == group.num_slots
    assert pool_pages(spec, model) == (budget_pages * per_page
                                       - backed.num_rows * group.bytes_per_slot) // per_page
