"""Builds ragged linear-attention test batches: rows of the step, their slots (shuffled), a
state pool poisoned with NaN wherever no row may read it."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Batch:
    """One step's rows: tokens packed by row, then padding; padding rows at the end."""

    q_lens: tuple[int, ...]  # per real row
    kv_lens: tuple[int, ...]  # per real row (== q_len: the row starts fresh)
    num_tokens: int  # T, >= sum(q_lens)
    num_rows: int  # R, >= len(q_lens); the rest are padding rows
    num_slots: int  # S

    def metadata(self, seed: int = 0):
        """(slots, cu_q_lens, kv_lens) as i32 arrays: real rows get distinct slots >= 1 in
        shuffled order, padding rows slot 0."""
        n = len(self.q_lens)
        rng = np.random.default_rng(seed)
        slots = np.zeros(self.num_rows, np.int32)
        slots[:n] = rng.permutation(np.arange(1, self.num_slots))[:n]
        q = np.zeros(self.num_rows, np.int32)
        q[:n] = self.q_lens
        kv = np.zeros(self.num_rows, np.int32)
        kv[:n] = self.kv_lens
        cu = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
        assert cu[-1] <= self.num_tokens
        return jnp.asarray(slots), jnp.asarray(cu), jnp.asarray(kv)

    def poisoned_pool(self, shape_tail, slots, rng) -> jnp.ndarray:
        """f32[S, *shape_tail]: random state in the slots of rows that carry one, NaN in
        slot 0, in fresh rows' slots and in unused slots."""
        pool = np.full((self.num_slots, *shape_tail), np.nan, np.float32)
        for i, (q, kv) in enumerate(zip(self.q_lens, self.kv_lens, strict=True)):
            if kv > q:
                pool[int(slots[i])] = rng.normal(0, 0.5, shape_tail)
        return jnp.asarray(pool)


def unit(x: np.ndarray) -> np.ndarray:
    """L2-normalized along the last axis (what the caller hands the kernel)."""
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def gdn_inputs(batch: Batch, hk: int, hv: int, dk: int, dv: int, seed: int = 0):
    """(q, k, v, g, beta, state, slots, cu_q_lens, kv_lens) for `batch`: q and k unit
    vectors (q scaled by dk ** -0.5), decays as a Gated DeltaNet layer makes them."""
    rng = np.random.default_rng(seed)
    t = batch.num_tokens
    q = unit(rng.normal(size=(t, hk, dk))) * dk ** -0.5
    k = unit(rng.normal(size=(t, hk, dk)))
    v = rng.normal(size=(t, hv, dv))
    # g = -exp(A_log) * softplus(a + dt_bias), as Qwen3NextGatedDeltaNet computes it.
    g = -rng.uniform(0.01, 2.0, hv) * np.log1p(np.exp(rng.normal(size=(t, hv))))
    beta = 1 / (1 + np.exp(-rng.normal(size=(t, hv))))
    slots, cu, kv = batch.metadata(seed)
    state = batch.poisoned_pool((hv, dk, dv), np.asarray(slots), rng)
    f = lambda x: jnp.asarray(x, jnp.float32)
    return f(q), f(k), f(v), f(g), f(beta), state, slots, cu, kv
