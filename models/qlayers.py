"""Flax modules for quantized weights (`QDense`, `QEmbed`) and the plan-driven factories
(`dense`, `embed`) that pick a module's layer from the model's `QuantPlan`.

A module with a format in the plan holds the leaves of `models.quant` (codes, f16 scales,
q4 zeros) instead of a float kernel; every matmul goes through
`pallas_kernels.quant_matmul`, which never keeps a dequantized copy of the weight. A module
the plan packs reads its weight packed for the CPU matmul kernel (`models.packed`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.packed import PackedDense, PackedEmbed
from models.quant import QuantFormat, QuantPlan
from pallas_kernels import quant_embed, quant_matmul
from pallas_kernels.invariant import row_tiled


def _quant_params(module: nn.Module, fmt: QuantFormat, k: int, n: int) -> dict:
    return {name: module.param(name, nn.initializers.zeros, shape, jnp.dtype(dtype))
            for name, (shape, dtype) in fmt.leaf_shapes(k, n).items()}


class QDense(nn.Module):
    """A Dense layer over a quantized kernel [in, out] (see `models.quant`)."""

    features: int
    fmt: QuantFormat
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    backend: str = "xla"
    row_tile: int = 0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = _quant_params(self, self.fmt, x.shape[-1], self.features)
        y = row_tiled(lambda t: quant_matmul(t.astype(self.dtype), w, self.fmt.kind,
                                             backend=self.backend), x, self.row_tile)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class QEmbed(nn.Module):
    """Token embedding stored quantized as [hidden, vocab] (the tied LM head's layout)."""

    num_embeddings: int
    features: int
    fmt: QuantFormat
    dtype: jnp.dtype = jnp.float32
    backend: str = "xla"
    row_tile: int = 0

    def setup(self):
        self.w = _quant_params(self, self.fmt, self.features, self.num_embeddings)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """dtype[T, hidden] rows of `ids`."""
        return quant_embed(self.w, self.fmt.kind, ids, self.dtype)

    def attend(self, h: jax.Array) -> jax.Array:
        """Logits [T, vocab] of hidden states against the (tied) embedding."""
        return row_tiled(lambda t: quant_matmul(t.astype(self.dtype), self.w, self.fmt.kind,
                                                backend=self.backend), h, self.row_tile)


class TiledDense(nn.Module):
    """`nn.Dense` (same parameters: kernel [in, out], bias) whose matmul runs over fixed
    tiles of `row_tile` rows (`pallas_kernels.invariant.row_tiled`): batch-invariant mode."""

    features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    row_tile: int = 16

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", nn.initializers.lecun_normal(),
                            (x.shape[-1], self.features), self.dtype)
        y = row_tiled(lambda t: t.astype(self.dtype) @ kernel, x, self.row_tile)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


def tiled_attend(embedding: jax.Array, h: jax.Array, row_tile: int) -> jax.Array:
    """Logits [T, vocab] of h [T, hidden] against a float embedding [vocab, hidden], in
    fixed row tiles (`nn.Embed.attend`'s product)."""
    return row_tiled(lambda t: t.astype(embedding.dtype) @ embedding.T, h, row_tile)


def dense(plan: QuantPlan, name: str, features: int, bias: bool, dtype, backend: str,
          in_setup: bool = False, layer=None, rows=None):
    """The layer of module `name` as `plan` stores it: `nn.Dense`, a `QDense` when the plan
    quantizes it, a `PackedDense` (reading layer `layer` of the packed stack, i32[] or None
    outside the layer scan, and multiplying only the step's `rows` real tokens, i32[] or
    None for all) when it packs it; with `plan.row_tile` (batch-invariant mode) a
    float one is a `TiledDense` and a quantized one multiplies in row tiles too. Named
    `name` unless built in a `setup`, where Flax names it after the attribute."""
    kw = {} if in_setup else {"name": name}
    if plan.packs(name):
        return PackedDense(features, bias, dtype, 0 if layer is None else layer,
                           plan.get(name), rows, **kw)
    fmt = plan.get(name)
    if fmt is None and plan.row_tile:
        return TiledDense(features, bias, dtype, plan.row_tile, **kw)
    if fmt is None:
        return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype, **kw)
    return QDense(features, fmt, bias, dtype, backend, plan.row_tile, **kw)


def embed(plan: QuantPlan, num_embeddings: int, features: int, dtype, backend: str):
    """The token embedding as `plan` stores it (`nn.Embed`, `QEmbed` or `PackedEmbed`), for
    a `setup`."""
    if plan.packs("embed_tokens"):
        return PackedEmbed(num_embeddings, features, plan.get("embed_tokens"))
    fmt = plan.get("embed_tokens")
    if fmt is None:
        return nn.Embed(num_embeddings, features, dtype=dtype, param_dtype=dtype)
    return QEmbed(num_embeddings, features, fmt, dtype, backend, plan.row_tile)
