"""The production XLA attention path against the jnp reference: every geometry and batch
shape, windows, soft caps, small blocks and tiles (many loop iterations), any packing, NaN in
free pages; and its cost follows the live context, not the block-table width."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla
from tests.kernels.cases import Geometry, make_metadata, make_pool, slow_except, tolerance
from tests.kernels.test_ragged_paged_attention import BATCHES, GEOMETRIES, SM_SCALE

# More packings than the kernel tests: decode rows first (what the runner sends), decode
# rows after a prefill chunk (not aligned to their row), chunks of one long prompt.
LAYOUTS = {
    **BATCHES,
    "decodes_first_then_chunk": ([1, 1, 1, 20], [9, 30, 2, 26]),
    "chunk_then_decodes": ([20, 1, 1, 1], [26, 9, 30, 2]),
    "second_chunk_of_a_long_prompt": ([16, 1, 0, 0], [48, 11, 0, 0]),
    "decode_rows_beside_a_fresh_prompt": ([1, 1, 17, 0], [40, 7, 17, 0]),
    # Requests verifying proposals (a few tokens after a context: the context part's short
    # pass) beside a chunk with a prefix (its long pass).
    "verifying_rows_beside_a_chunk": ([4, 1, 6, 20], [40, 9, 23, 46]),
}

reference = jax.jit(ragged_paged_attention_reference, static_argnames=("sm_scale", "soft_cap"))


@functools.cache
def xla_path(block_kv: int, block_q: int, decode_rows: int = 32):
    # NOTE: small `block_q` runs several context tiles per request, and tiles that reach
    # into the next request; the decode part's key blocks are `block_kv` too, its rows in
    # groups of `decode_rows`.
    return jax.jit(functools.partial(ragged_paged_attention_xla, block_kv=block_kv,
                                     block_q=block_q,
                                     block_q_short=min(block_q, 8),
                                     decode_block_kv=block_kv, decode_rows=decode_rows),
                   static_argnames=("sm_scale", "soft_cap"))


def inputs(g: Geometry, q_lens, kv_lens, seed=0, poison=np.nan):
    rng = np.random.default_rng(seed)
    kv_lens = [min(k, g.width * g.page_size) for k in kv_lens]
    kv_pages, tables = make_pool(g, kv_lens, rng, poison)  # `poison` in every unowned page
    md = make_metadata(g, q_lens, kv_lens, tables)
    q = rng.standard_normal((g.num_tokens, g.num_q_heads, g.head_dim)).astype(g.dtype)
    return q, kv_pages, md


def check(g, layout, window=0, soft_cap=None, block_kv=128, block_q=64, seed=0, scale=1.0,
          decode_rows=32, short_tiles=False):
    q_lens, kv_lens = LAYOUTS[layout] if isinstance(layout, str) else layout  # or a pair
    q, kv_pages, md = inputs(g, q_lens, kv_lens, seed=seed)
    md = dataclasses.replace(md, short_tiles=short_tiles)
    q = (q * scale).astype(q.dtype)
    want = np.asarray(reference(q, kv_pages, 1, md, sm_scale=SM_SCALE, sliding_window=window,
                                soft_cap=soft_cap), np.float32)
    got = np.asarray(xla_path(block_kv, block_q, decode_rows)(
        q, kv_pages, 1, md, sm_scale=SM_SCALE, sliding_window=window, soft_cap=soft_cap),
        np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=tolerance(g.dtype), rtol=0)
    padded = int(np.asarray(md.cu_q_lens)[-1])
    assert not got[padded:].any(), "padded tokens must produce zeros"


# NOTE: one compile per geometry (layouts and windows are data; the XLA path's code does not
# depend on the group or head size). The default tier keeps float32 (page size 16, GQA 3)
# and bfloat16 (page size 8, GQA 8); GQA 1 runs in test_blocks_tiles_and_soft_cap.
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("g", slow_except(GEOMETRIES, 3, 4), ids=str)
def test_matches_reference(g, layout, window):
    check(g, layout, window)


# NOTE: a compile per geometry, all in the slow tier: the default tier runs the short pass
# in test_blocks_tiles_and_soft_cap's capped case (short tiles of 4), on these layouts.
@pytest.mark.parametrize("layout", ["verifying_rows_beside_a_chunk", "mixed_mid_page_chunks",
                                    "decodes_first_then_chunk"])
@pytest.mark.parametrize("g", slow_except(GEOMETRIES), ids=str)
def test_short_tile_pass_matches_reference(g, layout):
    # Engines that verify proposals: requests of <= 8 new tokens get their own pass.
    check(g, layout, 5, short_tiles=True)


# NOTE: each (blocks, cap) is a compile: the default tier runs the smallest blocks and tiles
# (one-page key blocks, tiles of 4: the most iterations, tiles reaching into the next
# request) with the cap and the short pass; without them, the passes run in
# test_matches_reference and test_random_packings (blocks of 8 and 16 pages and of 2).
@pytest.mark.parametrize("block_kv,block_q,soft_cap", slow_except(
    [(8, 4, None), (8, 4, 2.0), (16, 7, None), (16, 7, 2.0), (64, 32, None), (64, 32, 2.0)],
    1))
@pytest.mark.parametrize("layout", ["mixed_mid_page_chunks", "second_chunk_of_a_long_prompt",
                                    "decodes_first_then_chunk", "verifying_rows_beside_a_chunk"])
def test_blocks_tiles_and_soft_cap(layout, block_kv, block_q, soft_cap):
    # Decode rows in groups of 2: several groups, the last one part padding; the short
    # pass on with a soft cap only.
    check(GEOMETRIES[0], layout, 3, soft_cap, block_kv, block_q, seed=2, scale=4.0,
          decode_rows=2, short_tiles=soft_cap is not None)


# NOTE: the packings alternate between the passes (a program each): without short tiles
# (every request in the long pass) in the default tier, with them (every request has at
# most 8 new tokens: the short pass) in the slow tier; fixed layouts run the short pass in
# test_short_tile_pass_matches_reference and test_blocks_tiles_and_soft_cap.
@pytest.mark.parametrize("short_tiles", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_random_packings(short_tiles):
    g = Geometry(16, 2, 2, 64, num_seqs=6, num_tokens=48, num_pages=64, width=8)
    rng = np.random.default_rng(5)
    for seed in range(12):
        q_lens = rng.integers(0, 9, g.num_seqs)
        q_lens[rng.random(g.num_seqs) < 0.5] = 1  # many decode rows, in any order
        kv_lens = [int(qn + rng.integers(0 if qn else 0, 60)) if qn else 0 for qn in q_lens]
        window = int(rng.choice([0, 7]))
        if bool(seed % 2) == short_tiles:
            check(g, ([int(x) for x in q_lens], kv_lens), window=window, block_kv=32,
                  block_q=16, seed=seed, decode_rows=4, short_tiles=short_tiles)


def test_cost_follows_the_live_context():
    # The same short contexts with block tables 16x wider: the reference's memory grows with
    # the width, this path's does not (it loops over live blocks only).
    # NOTE: the pool stays 48 pages (its size is an argument, not a temporary): at width 8
    # this is GEOMETRIES[3], whose programs test_matches_reference compiled already (with
    # the window passed, as here: an omitted one would be a constant, another program).
    def temp_bytes(fn, width):
        g = Geometry(16, 3, 3, 64, width=width)
        q, kv_pages, md = inputs(g, [1, 1, 1, 20], [9, 30, 2, 26])
        compiled = fn.lower(q, kv_pages, 1, md, sm_scale=SM_SCALE, sliding_window=0).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    fast = xla_path(128, 64)
    assert temp_bytes(fast, 128) <= 2 * temp_bytes(fast, 8)
    assert temp_bytes(reference, 128) >= 8 * temp_bytes(reference, 8)
