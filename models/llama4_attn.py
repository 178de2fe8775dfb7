"""Llama 4's per-layer query/key pieces: the rotary on interleaved pairs of the rotary layers
only, their weightless q/k norm after it, and the NoPE layers' attention temperature."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.layers import apply_rope
from models.llama4_config import has_chunked_attention, rotary_layers
from models.mla import deinterleave
from pallas_kernels.ragged_paged_attention.reference import token_positions


def per_layer_rope(cfg) -> bool:
    """Whether `cfg` rotates interleaved pairs or only some layers, or norms/scales q and k
    by layer (Llama 4): `rope_qk` then replaces the plain rotary."""
    return (bool(cfg.nope_layers) or cfg.qk_l2_norm or cfg.attn_temperature_tuning
            or cfg.rope_interleave)


def weightless_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """x * rsqrt(mean(x^2) + eps) over the last axis, in float32 and cast back
    (transformers' `Llama4TextL2Norm`, despite its name an RMS norm without weight)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x32.astype(x.dtype)


def temperature(positions: jax.Array, floor_scale: float, attn_scale: float) -> jax.Array:
    """f32[T] query scale of a NoPE layer at each position:
    log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1 (transformers' order)."""
    pos = positions.astype(jnp.float32)
    return jnp.log1p(jnp.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0


def rope_qk(cfg, q: jax.Array, k: jax.Array, cos, sin, layer, md):
    """q [T, Hq, D] and k [T, Hkv, D] after Llama 4's per-layer position handling.

    Rotary layers (`models.llama4_config.rotary_layers`, picked by the traced `layer`)
    rotate (interleaved pairs when `cfg.rope_interleave`: both reordered alike, so q.k is
    the interleaved rotation's) then, with `cfg.qk_l2_norm`, norm q and k; NoPE layers
    scale q by `temperature` of each token's position (from `md`) when
    `cfg.attn_temperature_tuning`. The reordering applies on every layer (a permutation
    of both q and k leaves a NoPE layer's q.k unchanged).
    """
    if cfg.rope_interleave:
        q, k = deinterleave(q), deinterleave(k)
    rotary = jnp.asarray(rotary_layers(cfg))[layer]  # bool[]
    rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cfg.qk_l2_norm:
        eps = cfg.rms_norm_eps
        rq, rk = weightless_rms_norm(rq, eps), weightless_rms_norm(rk, eps)
    q, k = jnp.where(rotary, rq, q), jnp.where(rotary, rk, k)
    if cfg.attn_temperature_tuning:
        _, pos, _ = token_positions(md, q.shape[0])  # i32[T]
        scale = temperature(pos, cfg.floor_scale, cfg.attn_scale)  # f32[T]
        q = jnp.where(rotary, q, (q * scale[:, None, None]).astype(q.dtype))
    return q, k


def window_args(cfg, window) -> dict:
    """`AttentionOps.attend`'s window arguments for a layer's traced `window` entry: a
    negative one is a chunk (`chunk_size`), for models with chunked layers only (others
    pass the window alone, so their programs are unchanged)."""
    if not has_chunked_attention(cfg):
        return dict(sliding_window=window)
    return dict(sliding_window=jnp.maximum(window, 0), chunk_size=jnp.maximum(-window, 0))
