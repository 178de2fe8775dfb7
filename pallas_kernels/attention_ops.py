"""`AttentionOps`: the KV writes and attention a model's layers call, on one resolved backend
(the functions it dispatches to: `pallas_kernels.ops`), per attention rank under data-parallel
attention (`pallas_kernels.rank_split`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import kv_rotation
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.ops import (
    causal_conv1d,
    gated_delta_rule,
    mla_attention,
    mla_attention_expanded,
    ragged_paged_attention,
    ssd,
    write_kv,
    write_latent,
)
from pallas_kernels.rank_split import AttentionRanks, per_rank


@dataclasses.dataclass(frozen=True)
class AttentionOps:
    """The KV write and attention a model's layers call, for one resolved backend (hashable:
    a static part of the model).

    Attributes:
        backend: A concrete backend ("xla", "cpu" or "pallas"; `resolve_backend`).
        batch_invariant: Every token's attention computed alone (see
            `ragged_paged_attention`).
        ranks: Data-parallel attention's ranks (`pallas_kernels.rank_split`): every KV
            write and attention runs per rank on its share of the pool; None: one step.
    """

    backend: str = "xla"
    batch_invariant: bool = False
    ranks: AttentionRanks | None = None

    @staticmethod
    def _rotation(kv_pages: jax.Array, head_dim: int, dtype) -> jax.Array | None:
        rot = kv_rotation(kv_pages.dtype, head_dim)  # f32[D, D] or None
        return None if rot is None else jnp.asarray(rot, dtype)

    def write_kv(self, kv_pages: jax.Array, slot, k: jax.Array, v: jax.Array,
                 slot_mapping: jax.Array) -> jax.Array:
        """The pool with this step's K and V ([T, Hkv, D] each) written into slot `slot`
        (8-bit pages that quantize better rotated get K and V rotated first)."""
        rot = self._rotation(kv_pages, k.shape[-1], k.dtype)
        if rot is not None:
            k, v = k @ rot, v @ rot
        if self.ranks is not None:
            return per_rank(self.ranks, lambda k, v, sm, pool, _, slot: write_kv(
                pool, slot, k, v, sm, backend=self.backend), (k, v, slot_mapping), kv_pages,
                replicated=(slot,), slots_arg=2)
        return write_kv(kv_pages, slot, k, v, slot_mapping, backend=self.backend)

    def attend(self, q: jax.Array, kv_pages: jax.Array, slot, md: AttentionMetadata, *,
               sm_scale: float, sliding_window=0, soft_cap: float | None = None,
               sinks: jax.Array | None = None, chunk_size=0) -> jax.Array:
        """[T, Hq, D] attention output of queries q [T, Hq, D] over slot `slot` of the
        pool (`ragged_paged_attention`; rotated pages: q rotated in, the output back).
        `chunk_size`: Llama 4's attention chunk (may be traced; 0: none).

        `sinks`: f32[Hq] learned sink logits (gpt-oss; may be traced, a layer's parameter
        in the layer scan), or None. Under data-parallel attention every rank takes them
        whole.
        """
        rot = self._rotation(kv_pages, q.shape[-1], q.dtype)
        if rot is not None:
            q = q @ rot

        chunked = not (isinstance(chunk_size, int) and chunk_size == 0)
        has_sinks = sinks is not None

        def attend(q, pool, md, slot, window, *extra):
            sinks = extra[0] if has_sinks else None  # a placeholder when only chunked
            chunk = extra[1] if chunked else 0
            return ragged_paged_attention(q, pool, slot, md, sm_scale=sm_scale,
                                          sliding_window=window, soft_cap=soft_cap,
                                          sinks=sinks, backend=self.backend,
                                          batch_invariant=self.batch_invariant,
                                          chunk_size=chunk)

        if self.ranks is not None:
            rep = (slot, jnp.asarray(sliding_window, jnp.int32))
            if sinks is not None or chunked:
                rep = (*rep, jnp.zeros((q.shape[1],), jnp.float32) if sinks is None else sinks)
            if chunked:
                rep = (*rep, jnp.asarray(chunk_size, jnp.int32))
            out = per_rank(self.ranks, attend, (q,), kv_pages, md, returns="tokens",
                           replicated=rep)
        else:
            out = attend(q, kv_pages, md, slot, sliding_window, sinks, chunk_size)
        return out if rot is None else out @ rot.T

    def write_latent(self, pool: jax.Array, slot, latent: jax.Array,
                     slot_mapping: jax.Array) -> jax.Array:
        """The latent pool with this step's MLA latents [T, R + Dr] written into slot `slot`
        (`pallas_kernels.ops.write_latent`).

        NOTE: 8-bit latent pages are not rotated (`kv_rotation`): the rotation would mix
        c_kv with k_pe, so the output (the c_kv part alone) could not be rotated back
        without the kernels returning whole rows."""
        if self.ranks is not None:
            return per_rank(self.ranks, lambda lat, sm, pool, _, slot: write_latent(
                pool, slot, lat, sm, backend=self.backend), (latent, slot_mapping), pool,
                replicated=(slot,), slots_arg=1)
        return write_latent(pool, slot, latent, slot_mapping, backend=self.backend)

    def mla_attend(self, q_latent: jax.Array, q_pe: jax.Array, pool: jax.Array, slot,
                   md: AttentionMetadata, *, sm_scale: float) -> jax.Array:
        """[T, H, R] absorbed-form MLA output of q_latent [T, H, R] and q_pe [T, H, Dr] over
        slot `slot` of a latent pool (`pallas_kernels.ops.mla_attention`).

        Raises:
            ValueError: In batch-invariant mode (not built for MLA: the XLA path merges a
                token's key blocks in an order that follows the step's other requests).
        """
        if self.batch_invariant:
            raise ValueError("batch_invariant is not built for MLA attention (mla_attend)")
        attend = lambda q, pe, pool, md, slot: mla_attention(  # noqa: E731
            q, pe, pool, slot, md, sm_scale=sm_scale, backend=self.backend)
        if self.ranks is not None:
            return per_rank(self.ranks, attend, (q_latent, q_pe), pool, md, returns="tokens",
                            replicated=(slot,))
        return attend(q_latent, q_pe, pool, md, slot)

    def mla_attend_expanded(self, q_nope: jax.Array, q_pe: jax.Array, pool: jax.Array, slot,
                            md: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array, *,
                            sm_scale: float, absorbed_decode: bool = False) -> jax.Array:
        """[T, H, Dv] expanded-form MLA output of q_nope [T, H, Dn] and q_pe [T, H, Dr] over
        slot `slot` of a latent pool, with w_uk [R, H, Dn] and w_uv [R, H, Dv]
        (`pallas_kernels.ops.mla_attention_expanded`).

        Raises:
            ValueError: In batch-invariant mode (as `mla_attend`).
        """
        if self.batch_invariant:
            raise ValueError("batch_invariant is not built for MLA attention "
                             "(mla_attend_expanded)")
        def attend(q, pe, pool, md, slot, w_uk, w_uv):
            return mla_attention_expanded(q, pe, pool, slot, md, w_uk, w_uv, sm_scale=sm_scale,
                                          absorbed_decode=absorbed_decode,
                                          backend=self.backend)

        if self.ranks is not None:
            return per_rank(self.ranks, attend, (q_nope, q_pe), pool, md, returns="tokens",
                            replicated=(slot, w_uk, w_uv))
        return attend(q_nope, q_pe, pool, md, slot, w_uk, w_uv)

    def gated_delta_rule(self, q, k, v, g, beta, state, slots, cu_q_lens, kv_lens):
        """(out f32[T, Hv, dv], state) of a Gated DeltaNet layer's recurrence over the step
        (`pallas_kernels.ops.gated_delta_rule`, on this backend)."""
        return gated_delta_rule(q, k, v, g, beta, state, slots, cu_q_lens, kv_lens,
                                backend=self.backend)

    def ssd(self, x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens):
        """(y f32[T, H, P], state) of a Mamba-2 layer's selective scan over the step
        (`pallas_kernels.ops.ssd`, on this backend)."""
        return ssd(x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens, backend=self.backend)

    def causal_conv1d(self, x, weight, bias, conv_state, slots, cu_q_lens, kv_lens,
                      activation: str | None = "silu"):
        """(y f32[T, C], conv_state) of a linear layer's short convolution over the step
        (`pallas_kernels.ops.causal_conv1d`)."""
        return causal_conv1d(x, weight, bias, conv_state, slots, cu_q_lens, kv_lens,
                             activation, backend=self.backend)
