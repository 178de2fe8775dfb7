"""`kv_ops`: page copies, gathers, scatters and host swaps on a tiny pool against NumPy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.runner.kv_ops import (
    PLAN_PAIRS,
    HostSwapSpace,
    copy_page_pairs,
    copy_pages,
    gather_pages,
    pad_pairs,
    plan_pieces,
    scatter_pages,
)

L, HKV, NUM_PAGES, PAGE_SIZE, D = 2, 1, 12, 2, 3
POOL_SHAPE = (L, 2, HKV, NUM_PAGES, PAGE_SIZE, D)  # [L, 2, Hkv, num_pages, page_size, D]
PAGE_SHAPE = (L, 2, HKV, PAGE_SIZE, D)  # one page across layers


def pool(seed: int = 0) -> np.ndarray:
    """f32 pool where every page of every layer holds distinct values (page 0 too)."""
    return np.random.default_rng(seed).standard_normal(POOL_SHAPE).astype(np.float32)


def on_device(x: np.ndarray) -> jax.Array:
    # A fresh device copy each time: the jitted ops donate the pool.
    return jnp.array(x)


@pytest.mark.parametrize("n", [0, 1, PLAN_PAIRS - 1, PLAN_PAIRS])
def test_pad_pairs_pads_to_the_one_compiled_size_with_null_pairs(n):
    pairs = np.arange(1, 2 * n + 1, dtype=np.int32).reshape(n, 2)
    out = pad_pairs(pairs)
    assert out.shape == (PLAN_PAIRS, 2) and out.dtype == np.int32
    np.testing.assert_array_equal(out[:n], pairs)
    assert (out[n:] == 0).all()


def test_pad_pairs_refuses_more_than_one_piece():
    with pytest.raises(ValueError, match=f"{PLAN_PAIRS + 1} page pairs in one piece"):
        pad_pairs(np.ones((PLAN_PAIRS + 1, 2), np.int32))


@pytest.mark.parametrize("n", [0, 1, PLAN_PAIRS, PLAN_PAIRS + 1, 3 * PLAN_PAIRS + 2])
def test_plan_pieces_keep_order_and_fit_one_piece(n):
    pairs = np.arange(2 * n, dtype=np.int32).reshape(n, 2)
    pieces = plan_pieces(pairs)
    assert all(1 <= len(p) <= PLAN_PAIRS for p in pieces)
    assert len(pieces) == -(-n // PLAN_PAIRS)
    np.testing.assert_array_equal(np.concatenate(pieces) if pieces else pairs, pairs)


def test_copy_pages_matches_numpy_and_padding_is_a_no_op():
    ref = pool()
    pairs = np.array([[3, 7], [5, 1], [3, 9]], np.int32)  # one src copied twice
    got = np.asarray(copy_pages(on_device(ref), jax.device_put(pad_pairs(pairs))))
    expected = ref.copy()
    expected[:, :, :, pairs[:, 1]] = ref[:, :, :, pairs[:, 0]]
    np.testing.assert_array_equal(got, expected)
    # Every other page (the null page included) is untouched.
    untouched = [p for p in range(NUM_PAGES) if p not in (7, 1, 9)]
    np.testing.assert_array_equal(got[:, :, :, untouched], ref[:, :, :, untouched])


def test_copy_page_pairs_runs_a_plan_of_several_pieces():
    ref = pool(5)
    dst = np.arange(3, NUM_PAGES, dtype=np.int32)  # 9 distinct pages: two pieces
    src = np.where(dst % 2 == 1, 1, 2).astype(np.int32)
    assert len(dst) > PLAN_PAIRS
    got = np.asarray(copy_page_pairs(on_device(ref), np.stack([src, dst], 1)))
    expected = ref.copy()
    expected[:, :, :, dst] = ref[:, :, :, src]
    np.testing.assert_array_equal(got, expected)


def test_gather_and_scatter_pages_match_numpy():
    ref = pool(1)
    ids = np.array([4, 0, 11, 4, 2, 6, 8, 10], np.int32)
    got = np.asarray(gather_pages(on_device(ref), jax.device_put(ids)))
    assert got.shape == (L, 2, HKV, len(ids), PAGE_SIZE, D)
    np.testing.assert_array_equal(got, ref[:, :, :, ids])
    values = pool(2)[:, :, :, :3]  # [L, 2, Hkv, 3, page_size, D]
    out = np.asarray(scatter_pages(on_device(ref), jax.device_put(np.array([9, 3, 5], np.int32)),
                                   on_device(values)))
    expected = ref.copy()
    expected[:, :, :, [9, 3, 5]] = values
    np.testing.assert_array_equal(out, expected)


def test_swap_out_then_in_moves_pages_through_host_slots():
    ref = pool(3)
    swap = HostSwapSpace(num_slots=16, page_shape=PAGE_SHAPE, dtype=np.float32)
    out_pairs = np.array([[2, 0], [5, 1], [11, 7]], np.int32)  # (device page, host slot)
    swap.swap_out(on_device(ref), out_pairs)
    # The pages are overwritten on device after swap-out; the slots keep their own copies.
    clobbered = ref.copy()
    clobbered[:, :, :, [2, 5, 11]] = -1.0
    in_pairs = np.array([[1, 4], [0, 9], [7, 2]], np.int32)  # (host slot, device page)
    got = np.asarray(swap.swap_in(on_device(clobbered), in_pairs))
    expected = clobbered.copy()
    expected[:, :, :, [4, 9, 2]] = ref[:, :, :, [5, 2, 11]]
    expected[:, :, :, 0] = 0.0  # padding pairs write zeros into the null page
    np.testing.assert_array_equal(got, expected)
    # Swap-in frees the slots: reading one again is an error.
    with pytest.raises(KeyError):
        swap.swap_in(on_device(got), np.array([[0, 3]], np.int32))


def test_swap_of_more_pairs_than_one_piece():
    ref = pool(4)
    swap = HostSwapSpace(num_slots=16, page_shape=PAGE_SHAPE, dtype=np.float32)
    pages = np.arange(1, 11, dtype=np.int32)  # 10 pairs: two pieces of PLAN_PAIRS
    swap.swap_out(on_device(ref), np.stack([pages, 100 + pages], 1))
    back = np.asarray(swap.swap_in(on_device(np.zeros(POOL_SHAPE, np.float32)),
                                   np.stack([100 + pages, pages[::-1]], 1)))
    np.testing.assert_array_equal(back[:, :, :, pages[::-1]], ref[:, :, :, pages])
    assert (back[:, :, :, [0, 11]] == 0).all()
