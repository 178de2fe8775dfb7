"""The portable linear methods: float weights, and q8/q4 codes multiplied by `quant_matmul`.

`FloatLinear` holds a kernel [in, out] (a Flax `Dense`'s leaf, "kernel") and multiplies
with XLA; `QuantLinear` holds the leaves of `models.quant` (codes, f16 scales, q4 zeros)
and multiplies through `pallas_kernels.quant_matmul` (the Pallas kernel on GPU/TPU, XLA's
elsewhere), never keeping a dequantized copy. With `row_tile` (batch-invariant mode) both
run over fixed tiles of rows (`pallas_kernels.invariant.row_tiled`). `FloatEmbed` and
`QuantEmbed` are the token embedding in the same two forms (the quantized one stored as
[hidden, vocab], the tied LM head's layout, looked up by column).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from models.linear.base import (
    EmbedMethod,
    LinearMethod,
    declare_leaves,
    permute_inputs,
    split_perm,
    unpermute_rows,
)
from models.quant import PERM, QuantFormat
from pallas_kernels import quant_embed, quant_matmul
from pallas_kernels.invariant import row_tiled
from pallas_kernels.quant_matmul.reference import dequantize


def _dot(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x [T, k] @ kernel [k, n] as a Flax `Dense` computes it (x cast to the kernel's dtype)."""
    x = x.astype(kernel.dtype)
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


@dataclasses.dataclass(frozen=True)
class FloatLinear(LinearMethod):
    """A float kernel [in, out] ("kernel"; a bare leaf when named, as the experts' stacks).

    Attributes:
        dtype: The kernel's dtype (and the matmul's).
        row_tile: Multiply over fixed tiles of this many rows (batch-invariant mode); 0:
            all rows at once.
    """

    dtype: Any = jnp.float32
    row_tile: int = 0

    def leaf_shapes(self, k, n):
        return {"kernel": ((k, n), jnp.dtype(self.dtype))}

    def weights(self, module, k, n, lead=(), name=None):
        init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1,
                                            batch_axis=tuple(range(len(lead))))
        return module.param(name or "kernel", init, (*lead, k, n), jnp.dtype(self.dtype))

    def apply(self, w, x, layer=None):
        return row_tiled(lambda t: _dot(t, w), x, self.row_tile)

    def dense(self, w, dtype):
        return w.astype(dtype)


@dataclasses.dataclass(frozen=True)
class QuantLinear(LinearMethod):
    """A q8/q4 weight (`models.quant`'s leaves) multiplied by `quant_matmul`.

    Attributes:
        fmt: The stored format.
        dtype: The activations' dtype.
        kernel: `quant_matmul`'s implementation: "pallas" (GPU/TPU) or "xla".
        row_tile: As `FloatLinear.row_tile`.
    """

    fmt: QuantFormat
    dtype: Any = jnp.float32
    kernel: str = "xla"
    row_tile: int = 0

    def leaf_shapes(self, k, n):
        return self.fmt.leaf_shapes(k, n)

    def weights(self, module, k, n, lead=(), name=None):
        return declare_leaves(module, self.fmt.leaf_shapes(k, n), lead, name)

    def apply(self, w, x, layer=None):
        w, perm = split_perm(w)
        x = permute_inputs(x, perm)
        return row_tiled(lambda t: quant_matmul(t.astype(self.dtype), w, self.fmt.kind,
                                                backend=self.kernel), x, self.row_tile)

    def partition_spec(self, leaf, shape, split, axes, shards):
        """Splits the codes and their group scales (and zeros) together: a row-parallel
        split of K falls on group boundaries only. An act-order permutation ([..., K, 1])
        stays whole.

        Raises:
            ValueError: A K split that would cut a group of several along K (the message
                names the weight's shape, the group and the shard count); one group per
                output channel stays whole beside the split codes (it scales each partial
                sum). A K split of an act-order weight: its sorted rows hold inputs from
                anywhere in K, so a device's rows need other devices' activations.
        """
        if split == "in" and shards > 1 and self.fmt.act_order:
            raise ValueError(
                f"an act-order {self.fmt.kind} weight (desc_act/actorder: its inputs sorted "
                f"by group) cannot be split {shards} ways along its input axis: the sorted "
                "rows move inputs across the shards; serve it without tensor parallelism")
        if leaf == PERM:
            return PartitionSpec()
        if split == "in" and leaf == "qweight" and shards > 1:
            k = shape[-2] * (2 if self.fmt.kind == "q4" else 1)
            block = self.fmt.block_for(k)
            if block < k and (k % shards or (k // shards) % block):
                raise ValueError(
                    f"a {self.fmt.kind} weight of {k} inputs in groups of {block} cannot be "
                    f"split {shards} ways along its input axis: a shard of {k / shards:g} "
                    f"inputs would cut a group")
        return super().partition_spec(leaf, shape, split, axes, shards)

    def dense(self, w, dtype):
        def fn(leaves):  # one [K, N] weight, rows back in input order
            leaves, perm = split_perm(leaves)
            return unpermute_rows(dequantize(leaves, self.fmt.kind, dtype), perm)

        for _ in range(w["qweight"].ndim - 2):  # one vmap per leading axis
            fn = jax.vmap(fn)
        return fn(w)


@dataclasses.dataclass(frozen=True)
class FloatEmbed(EmbedMethod):
    """A float table [vocab, hidden] ("embedding", a Flax `Embed`'s leaf)."""

    dtype: Any = jnp.float32
    row_tile: int = 0

    def weights(self, module, vocab, hidden):
        init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
        return module.param("embedding", init, (vocab, hidden), jnp.dtype(self.dtype))

    def lookup(self, w, ids):
        return jnp.take(w, ids, axis=0)

    def attend(self, w, h):
        return row_tiled(lambda t: jnp.dot(t.astype(w.dtype), w.T), h, self.row_tile)


@dataclasses.dataclass(frozen=True)
class QuantEmbed(EmbedMethod):
    """A quantized table stored [hidden, vocab] (the LM head's layout), looked up by column."""

    fmt: QuantFormat
    dtype: Any = jnp.float32
    kernel: str = "xla"
    row_tile: int = 0

    def weights(self, module, vocab, hidden):
        return declare_leaves(module, self.fmt.leaf_shapes(hidden, vocab))

    def lookup(self, w, ids):
        return quant_embed(w, self.fmt.kind, ids, self.dtype)

    def attend(self, w, h):
        return row_tiled(lambda t: quant_matmul(t.astype(self.dtype), w, self.fmt.kind,
                                                backend=self.kernel), h, self.row_tile)
