"""Building blocks shared by the decoder families: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ArchConfig
from models.linear import Linear, Methods
from models.rope import RopeScaling, rope_inv_freq
from pallas_kernels.invariant import fixed_sum


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers does.

    Attributes:
        eps: Epsilon under the square root.
        dtype: Parameter dtype.
        offset: 0.0 multiplies by the weight after the cast (Llama); 1.0 multiplies by
            `1 + weight` in float32 before it (Gemma; the weight starts at zero).
        fixed_order: The mean of squares summed in one fixed order whatever the number of
            rows (batch-invariant mode, `pallas_kernels.invariant.fixed_sum`).
    """

    eps: float
    dtype: jnp.dtype = jnp.float32
    offset: float = 0.0
    fixed_order: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.offset else nn.initializers.ones
        scale = self.param("scale", init, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        if self.fixed_order:
            mean = fixed_sum(x32 * x32) / x32.shape[-1]
        else:
            mean = jnp.mean(x32 * x32, axis=-1, keepdims=True)
        x32 = x32 * jax.lax.rsqrt(mean + self.eps)
        if self.offset:
            return (x32 * (self.offset + scale.astype(jnp.float32))).astype(x.dtype)
        return scale * x32.astype(x.dtype)


ACTIVATIONS = {"silu": nn.silu, "gelu_pytorch_tanh": lambda x: nn.gelu(x, approximate=True)}


def _cos_sin(positions: jax.Array, dim: int, theta: float, scaling: RopeScaling):
    inv_freq = jnp.asarray(rope_inv_freq(dim, theta, scaling))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # f32[num_tokens, dim]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    # NOTE: yarn's and longrope's attention factor scales cos and sin (as transformers'
    # `attention_scaling`), so it enters q.k squared and leaves v and the softmax scale alone.
    factor = scaling.attention_scaling()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos, sin


def rope_cos_sin(positions: jax.Array, cfg: ArchConfig) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables for the given positions: f32[num_tokens, rotary_dim], or with a
    local rotary (`cfg.local_rope_theta`) f32[2, num_tokens, rotary_dim], global then
    local (`layer_cos_sin` picks a layer's). `rotary_dim` is `cfg.rotary_dim` (the head
    unless `partial_rotary_factor` < 1)."""
    cos, sin = _cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    if cfg.local_rope_theta is None:
        return cos, sin
    cos_l, sin_l = _cos_sin(positions, cfg.rotary_dim, cfg.local_rope_theta,
                            cfg.local_rope_scaling)
    return jnp.stack([cos, cos_l]), jnp.stack([sin, sin_l])


def layer_cos_sin(cos: jax.Array, sin: jax.Array, window: jax.Array):
    """A layer's tables from `rope_cos_sin`'s: the local ones where the layer's (traced)
    window is set, when there are two."""
    if cos.ndim == 2:
        return cos, sin
    idx = (window > 0).astype(jnp.int32)  # i32[]: 0 global, 1 local
    return cos[idx], sin[idx]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [num_tokens, num_heads, head_dim] by half-split (non-interleaved) rotary;
    tables narrower than the head ([num_tokens, rotary_dim]) turn its first `rotary_dim`
    channels and pass the rest through (partial rotary)."""
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :dim], cos, sin), x[..., dim:]], axis=-1)
    half = dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, None, :].astype(x.dtype)
    sin = sin[:, None, :].astype(x.dtype)
    return x * cos + rotated * sin


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), `act` being `cfg.hidden_act` (SiLU by default); its
    width is `cfg.intermediate_size` unless `intermediate_size` is set (a shared expert).
    Each projection is a `Linear` of the method `methods` gives its name."""

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods
    intermediate_size: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array, layer=None) -> jax.Array:
        """x [T, hidden] -> [T, hidden]; `layer` (i32[], inside the layer scan) is the
        layer a stacked weight is read at (`models.linear.LinearMethod.stacked`)."""

        def dense(n, name, h):
            return Linear(n, self.methods.linear(name), self.cfg.mlp_bias, self.dtype, layer,
                          name=name)(h)

        width = self.intermediate_size or self.cfg.intermediate_size
        h = ACTIVATIONS[self.cfg.hidden_act](dense(width, "gate_proj", x))
        h = h * dense(width, "up_proj", x)
        return dense(self.cfg.hidden_size, "down_proj", h)
