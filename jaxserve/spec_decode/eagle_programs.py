"""A draft head's two jitted programs: `observe` after a target step, `propose_loop` before.

The head is EAGLE-3's (`models.eagle3`) or an MTP layer (`models.mtp`): `HeadProgramSpec`
carries its forward, its hidden input from the target's aux states and its greedy pick.

`observe` runs the head over the positions a target step made valid (its packed tokens, their
auxiliary hidden states gathered from the step's output), writing the head's K/V, and keeps
each request's last row: its greedy draft token (proposal 1) and `prenorm` hidden state.
`propose_loop` then runs k - 1 single-token steps from those rows, each feeding the head its
own proposal and hidden state (one `fori_loop`). Both have fixed shapes per target token
bucket (rows: the engine's `max_num_seqs`), so warm-up compiles them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxserve.sample.rowwise import argmax_rows
from models.eagle3 import head_logits, to_target_ids
from pallas_kernels import AttentionMetadata


@dataclass(frozen=True)
class HeadProgramSpec:
    """What the programs close over (static).

    Attributes:
        forward: `(params, target_params, embeds [T, H], g [T, H], i32[T] positions,
            kv_pages, md) -> (kv_pages, normed [T, H], prenorm [T, H])`: one step of the head.
        combine: `(params, target_params, aux [T, n, Ht]) -> g [T, H]`: the head's hidden
            input from the target's aux states.
        pick: `(params, target_params, normed [R, H]) -> i32[R]`: greedy proposals, target ids.
        embed: `(params, target_params, i32[T]) -> [T, H]` token embeddings (the head's own
            table or the target's).
        dtype: The head's compute dtype.
        page_size: Slots per page of its pool.
        num_steps: Single-token steps of `propose_loop` (k - 1).
        max_rows: Rows of `observe`'s outputs (the engine's `max_num_seqs`), whatever rows
            it ran: the loop reads them in one shape.
    """

    forward: object
    combine: object
    pick: object
    embed: object
    dtype: object
    page_size: int
    num_steps: int
    max_rows: int


def greedy(params, normed: jax.Array) -> jax.Array:
    """i32[R] each row's most likely draft token as a target id (`argmax_rows`: XLA:CPU's
    own argmax over a vocabulary is slow)."""
    return to_target_ids(params, argmax_rows(head_logits(params, normed)))


def observe(spec: HeadProgramSpec, params, target_params, kv_pages, aux, gather, ids,
            positions, slot_mapping, tables, kv_lens, cu_q_lens, last):
    """The head over one target step's valid positions.

    Args:
        aux: [Tb, n, Ht] the target step's auxiliary hidden states (its token bucket).
        gather: i32[Tb] the step's token row of each head token (padding: any).
        ids: i32[Tb] each head token's input: the target's token after its position.
        positions: i32[Tb] its position (rotary).
        slot_mapping: i32[Tb] its slot in the head's pool (padding: 0, the null page).
        tables: i32[R, W] the rows' head block tables.
        kv_lens: i32[R] each row's head context after this step (from its first page).
        cu_q_lens: i32[R + 1] the rows' token extents.
        last: i32[R] each row's last token (its proposal-1 row).

    Returns:
        (kv_pages, i32[max_rows] proposal 1 in target ids, [max_rows, H] the head's prenorm
        there; rows past R are zeros).
    """
    dt = spec.dtype
    g = spec.combine(params, target_params, aux[gather]).astype(dt)  # [Tb, H]
    embeds = spec.embed(params, target_params, ids).astype(dt)  # [Tb, H]
    md = AttentionMetadata(slot_mapping, tables, kv_lens, cu_q_lens)
    kv_pages, normed, prenorm = spec.forward(params, target_params, embeds, g, positions,
                                             kv_pages, md)
    pad = spec.max_rows - last.shape[0]
    return (kv_pages, jnp.pad(spec.pick(params, target_params, normed[last]), (0, pad)),
            jnp.pad(prenorm[last], ((0, pad), (0, 0))))


def propose_loop(spec: HeadProgramSpec, params, target_params, kv_pages, first, hidden, rows,
                 positions, local, tables, num_real):
    """k - 1 greedy single-token steps of the head from `observe`'s rows.

    Args:
        first: i32[max_rows] `observe`'s proposal 1 per row; hidden: [max_rows, H] its
            prenorm.
        rows: i32[R] the `observe` row of each proposing request (padding: any).
        positions: i32[R] position of each request's proposal 1 (its first loop token).
        local: i32[R] that position's index in the request's head pages.
        tables: i32[R, W] the requests' head block tables.
        num_real: i32[] real requests (the first rows).

    Returns:
        (kv_pages, i32[R, 1 + num_steps] every request's proposals, target ids).
    """
    num_rows = rows.shape[0]
    idx = jnp.arange(num_rows, dtype=jnp.int32)  # i32[R]
    real = idx < num_real  # bool[R]
    cu_q_lens = jnp.minimum(jnp.arange(num_rows + 1, dtype=jnp.int32), num_real)  # i32[R+1]
    ps = spec.page_size

    def step(j, carry):
        kv_pages, ids, h, out = carry
        li = jnp.where(real, local + j, 0)  # i32[R] the token's index in the head's pages
        slot = tables[idx, li // ps] * ps + li % ps  # i32[R]
        md = AttentionMetadata(jnp.where(real, slot, 0), tables, jnp.where(real, li + 1, 0),
                               cu_q_lens)
        embeds = spec.embed(params, target_params, ids).astype(spec.dtype)  # [R, H]
        kv_pages, normed, prenorm = spec.forward(params, target_params, embeds, h,
                                                 positions + j, kv_pages, md)
        nxt = spec.pick(params, target_params, normed)  # i32[R]
        return kv_pages, nxt, prenorm, out.at[:, j + 1].set(nxt)

    ids = first[rows]  # i32[R]
    out = jnp.zeros((num_rows, 1 + spec.num_steps), jnp.int32).at[:, 0].set(ids)
    kv_pages, _, _, out = jax.lax.fori_loop(
        0, spec.num_steps, step, (kv_pages, ids, hidden[rows].astype(spec.dtype), out))
    return kv_pages, out
