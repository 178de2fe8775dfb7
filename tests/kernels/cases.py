"""Builds paged-attention test inputs: a NaN-poisoned page pool, shuffled block tables."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.utils import cdiv
from pallas_kernels import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static shapes of one kernel compile."""

    page_size: int
    num_kv_heads: int
    group: int  # query heads per KV head (GQA ratio)
    head_dim: int
    dtype: str = "float32"
    num_layers: int = 2
    num_pages: int = 48
    num_seqs: int = 4
    num_tokens: int = 32
    width: int = 8  # max pages per request

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group

    def __str__(self) -> str:
        return (f"ps{self.page_size}-kv{self.num_kv_heads}-g{self.group}-d{self.head_dim}-"
                f"{self.dtype}")


def make_pool(g: Geometry, kv_lens, rng, poison=np.nan):
    """Pool with random K/V in every page a request owns and `poison` everywhere else.

    Returns:
        (kv_pages, block_tables): pages are handed out in shuffled order, so requests'
        pages are neither contiguous nor ascending; page 0 (null) is never handed out.
    """
    shape = (g.num_layers, 2, g.num_kv_heads, g.num_pages, g.page_size, g.head_dim)
    pool = np.full(shape, poison, np.float32)
    tables = np.zeros((len(kv_lens), g.width), np.int32)
    free = list(rng.permutation(np.arange(1, g.num_pages)))
    for i, n in enumerate(kv_lens):
        pages = [free.pop() for _ in range(cdiv(n, g.page_size))]
        tables[i, :len(pages)] = pages
        for p in pages:
            pool[:, :, :, p] = rng.standard_normal(pool[:, :, :, p].shape)
    return jnp.asarray(pool, g.dtype), jnp.asarray(tables)


def make_metadata(g: Geometry, q_lens, kv_lens, tables, decode_only=False):
    """Attention metadata for requests with the given query and context lengths."""
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    assert cu[-1] <= g.num_tokens and all(q <= k for q, k in zip(q_lens, kv_lens, strict=True))
    tables = np.asarray(tables)
    slots = np.zeros(g.num_tokens if not decode_only else len(q_lens), np.int32)
    for i, (q, k) in enumerate(zip(q_lens, kv_lens, strict=True)):
        pos = np.arange(k - q, k)
        slots[cu[i]:cu[i + 1]] = tables[i, pos // g.page_size] * g.page_size + pos % g.page_size
    return AttentionMetadata(slot_mapping=jnp.asarray(slots), block_tables=jnp.asarray(tables),
                             kv_lens=jnp.asarray(kv_lens, jnp.int32), cu_q_lens=jnp.asarray(cu),
                             decode_only=decode_only)


def tolerance(dtype: str) -> float:
    """Absolute tolerance of a kernel output against the reference, by dtype."""
    return {"float32": 2e-5, "bfloat16": 2e-2}[dtype]


def slow_except(values, *keep):
    """A parametrize list of `values` in which all but those at the indices `keep` are marked
    `slow`: the default tier runs the kept ones, `pytest -m ''` every one. A tuple value
    fills several arguments (`"a,b"` parametrize names). Test ids are unchanged.
    """
    unknown = set(keep) - set(range(len(values)))
    assert not unknown, f"no values at indices {sorted(unknown)}"
    return [v if i in keep
            else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            for i, v in enumerate(values)]
