"""Building blocks shared by the decoder families: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ArchConfig, RopeScaling
from models.qlayers import dense as make_dense
from models.quant import QuantPlan


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers does."""

    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return scale * x32.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse rotary frequencies f32[head_dim // 2], with linear or Llama 3 scaling."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32)
                                / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv_freq


def rope_cos_sin(positions: jax.Array, cfg: ArchConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables f32[num_tokens, head_dim] for the given positions."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [num_tokens, num_heads, head_dim] by half-split (non-interleaved) rotary."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    cfg: ArchConfig
    dtype: jnp.dtype = jnp.float32
    quant: QuantPlan = QuantPlan()
    backend: str = "xla"

    @nn.compact
    def __call__(self, x: jax.Array, layer=None) -> jax.Array:
        """x [T, hidden] -> [T, hidden]; `layer` (i32[], inside the layer scan) is the index
        packed weights are read at (`models.qlayers.dense`)."""
        dense = lambda n, name: make_dense(self.quant, name, n, self.cfg.mlp_bias, self.dtype,
                                           self.backend, layer=layer)

        h = nn.silu(dense(self.cfg.intermediate_size, "gate_proj")(x))
        h = h * dense(self.cfg.intermediate_size, "up_proj")(x)
        return dense(self.cfg.hidden_size, "down_proj")(h)
