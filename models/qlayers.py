"""Flax modules for quantized weights (`QDense`, `QEmbed`), panel mode's (`PanelDense`,
`PanelEmbed`) and the plan-driven factories.

A module with a format in the model's `QuantPlan` holds the leaves of `models.quant`
(codes, f16 scales, q4 zeros) instead of a float kernel; every matmul goes through
`pallas_kernels.quant_matmul`, which never keeps a dequantized copy of the weight.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.quant import QuantFormat, QuantPlan
from pallas_kernels import quant_embed, quant_matmul


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

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = _quant_params(self, self.fmt, x.shape[-1], self.features)
        y = quant_matmul(x.astype(self.dtype), w, self.fmt.kind, backend=self.backend)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class PanelDense(nn.Module):
    """A Dense layer whose kernel is layer `layer` of stacked panels (`models.panels`):
    only its bias, if any, is a parameter of its own."""

    features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, panels: jax.Array, layer) -> jax.Array:
        from pallas_kernels.cpu_ffi.gemm import stacked_gemm

        y = stacked_gemm(x, panels, layer, self.features).astype(self.dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class PanelEmbed(nn.Module):
    """The LM head in panel mode (`models.panels`): its weight [hidden, vocab] packed as
    panels f32[1, P, hidden, 16] under "panels". `attend` is the LM head matmul (the
    CPU matmul kernel); `__call__` looks tokens up in the same panels, so a tied
    embedding is stored once."""

    num_embeddings: int
    features: int

    def setup(self):
        from pallas_kernels.cpu_ffi.gemm import PANEL, num_panels

        self.panels = self.param("panels", nn.initializers.zeros, (
            1, num_panels(self.num_embeddings), self.features, PANEL), jnp.float32)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """f32[T, hidden] rows of `ids` i32[T]: column id % 16 of panel id // 16."""
        from pallas_kernels.cpu_ffi.gemm import PANEL

        return self.panels[0, ids // PANEL, :, ids % PANEL]

    def attend(self, h: jax.Array) -> jax.Array:
        """f32[T, vocab] logits of hidden states h [T, hidden]."""
        from pallas_kernels.cpu_ffi.gemm import stacked_gemm

        return stacked_gemm(h.astype(jnp.float32), self.panels, 0, self.num_embeddings)


class QEmbed(nn.Module):
    """Token embedding stored quantized as [hidden, vocab] (the tied LM head's layout)."""

    num_embeddings: int
    features: int
    fmt: QuantFormat
    dtype: jnp.dtype = jnp.float32
    backend: str = "xla"

    def setup(self):
        self.w = _quant_params(self, self.fmt, self.features, self.num_embeddings)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """dtype[T, hidden] rows of `ids`."""
        return quant_embed(self.w, self.fmt.kind, ids, self.dtype)

    def attend(self, h: jax.Array) -> jax.Array:
        """Logits [T, vocab] of hidden states against the (tied) embedding."""
        return quant_matmul(h.astype(self.dtype), self.w, self.fmt.kind, backend=self.backend)


def dense(plan: QuantPlan, name: str, features: int, bias: bool, dtype, backend: str,
          in_setup: bool = False, panels: dict | None = None, layer=None):
    """`nn.Dense` or, when `plan` quantizes `name`, a `QDense`, named `name` (unless built
    in a `setup`, where Flax names it after the attribute). With `panels` (a layer matmul
    in panel mode, `models/panels.py`): a callable multiplying by `panels[name]` at
    `layer` through a `PanelDense`."""
    if panels is not None:
        return lambda x: PanelDense(features, bias, dtype, name=name)(x, panels[name], layer)
    fmt = plan.get(name)
    kw = {} if in_setup else {"name": name}
    if fmt is None:
        return nn.Dense(features, use_bias=bias, dtype=dtype, param_dtype=dtype, **kw)
    return QDense(features, fmt, bias, dtype, backend, **kw)
