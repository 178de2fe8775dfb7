"""The linear-method interface, and the `Linear` and `Embedding` modules the models call.

A *linear method* is one way of storing and multiplying a linear layer's weight
[in, out]: which leaves it holds (shapes, dtypes, where in the Flax variables), the matmul
that reads them, the load-time transform from the standard leaves (what checkpoints and
`Model.params` hold) into the form it serves from, and the bytes it costs. Methods are
frozen dataclasses, so a model's choice of them is a static, hashable part of its module
tree. `models.linear.registry` chooses one per module when a model is loaded; the model
code only builds `Linear(features, method, ...)` and calls it.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from models.quant import PERM

# The Flax collection of weights read whole at a traced layer index (stacks [L, ...]): the
# layer scan broadcasts it to every layer instead of slicing it, so a layer reads its
# weights in place (XLA:CPU copies every sliced leaf out of its stack).
STACKS = "stacks"


class LinearMethod:
    """How one linear layer's weight is stored and multiplied (subclasses are frozen
    dataclasses).

    Attributes:
        stacked: The serving form keeps the weight whole ([L, ...], or [1, ...] outside
            the layer scan) in `STACKS`, read at the layer index `apply` is given; False:
            its leaves are "params" leaves, sliced per layer by the scan.
    """

    stacked = False

    def leaf_shapes(self, k: int, n: int) -> dict[str, tuple[tuple[int, ...], Any]]:
        """{leaf: (shape, dtype)} of a [k, n] weight in the standard layout."""
        raise NotImplementedError

    def weights(self, module: nn.Module, k: int, n: int, lead: tuple[int, ...] = (),
                name: str | None = None):
        """Declares (under `init`) or reads the weight's leaves in `module`'s variables.

        Args:
            module: The module that owns the weight (its variables hold the leaves).
            k: Input size.
            n: Output size.
            lead: Leading axes of a stack of such weights (the experts' [E]).
            name: Keep the leaves under this name in `module` (a float weight: one leaf
                of that name) rather than as `module`'s own leaves.

        Returns:
            What `apply` takes (method-specific: an array or a dict of leaves).
        """
        raise NotImplementedError

    def apply(self, w, x: jax.Array, layer=None) -> jax.Array:
        """y [T, n] = x [T, k] @ the weight (`w` from `weights`); `layer` (i32[], traced in
        the layer scan, or None) is the layer a stacked weight is read at."""
        raise NotImplementedError

    def forward(self, w, x: jax.Array, layer=None, bias: jax.Array | None = None) -> jax.Array:
        """`apply`, then the layer's bias if any (wrappers add their terms after it)."""
        y = self.apply(w, x, layer)
        return y if bias is None else y + bias

    def dense(self, w, dtype) -> jax.Array:
        """The weight as a float kernel dtype[..., k, n] (reference paths, grouped GEMMs)."""
        raise NotImplementedError

    def nbytes(self, k: int, n: int) -> int:
        """Bytes of the standard leaves of a [k, n] weight."""
        return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize
                   for shape, dtype in self.leaf_shapes(k, n).values())

    def partition_spec(self, leaf: str, shape: tuple[int, ...], split: str | None, axes,
                       shards: int) -> PartitionSpec:
        """How a tensor-parallel mesh splits standard leaf `leaf` of this weight.

        The default is for leaves laid out [..., K', N] (the input axis, or its blocks,
        second to last; the output axis last; stacked axes leading), as every method here.

        Args:
            leaf: The leaf's name ("kernel", "qweight", "bias", ...).
            shape: Its shape.
            split: "out" (column parallel: the output axis split over `axes`), "in" (row
                parallel: the input axis), or None (replicated).
            axes: The mesh axes splitting it.
            shards: The devices those axes span (an axis they do not divide stays whole).
        """
        ndim = len(shape)
        if split == "out" and shape[-1] % shards == 0:
            return PartitionSpec(*([None] * (ndim - 1)), axes)
        if split == "in" and leaf != "bias" and ndim >= 2 and shape[-2] % shards == 0:
            return PartitionSpec(*([None] * (ndim - 2)), axes, None)
        return PartitionSpec()

    def to_serving(self, leaves: dict, stacked: bool) -> dict:
        """The serving form's leaves of standard `leaves` (stacked over layers when
        `stacked`, else one weight): the identity unless the method stores otherwise."""
        return leaves

    def to_standard(self, leaves: dict, n: int, stacked: bool) -> dict:
        """The inverse of `to_serving` (`n`: the weight's output size)."""
        return leaves


class EmbedMethod:
    """How a token embedding [vocab, hidden] (and, tied, the LM head) is stored: its
    lookup and its `attend` (logits against every token)."""

    stacked = False

    def weights(self, module: nn.Module, vocab: int, hidden: int):
        """Declares or reads the table's leaves in `module` (call from `setup`)."""
        raise NotImplementedError

    def lookup(self, w, ids: jax.Array) -> jax.Array:
        """[T, hidden] rows of `ids` i32[T]."""
        raise NotImplementedError

    def attend(self, w, h: jax.Array) -> jax.Array:
        """[T, vocab] logits of hidden states h [T, hidden]."""
        raise NotImplementedError

    def to_serving(self, leaves: dict) -> dict:
        """The serving form's leaves of the standard table's `leaves` (the identity unless
        the method serves from another layout)."""
        return leaves

    def to_standard(self, leaves: dict, vocab: int) -> dict:
        """The inverse of `to_serving`."""
        return leaves


class Linear(nn.Module):
    """A linear layer whose weight and matmul are its `method`'s.

    Attributes:
        features: Output size.
        method: The `LinearMethod` (chosen by `models.linear.registry`).
        use_bias: Whether a bias [features] (a "params" leaf, in the method's dtype) is added.
        dtype: The bias's dtype.
        layer: i32[] inside the layer scan (the index a stacked weight is read at), else None.
    """

    features: int
    method: LinearMethod
    use_bias: bool = False
    dtype: Any = jnp.float32
    layer: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """y [T, features] of x [T, in]."""
        w = self.method.weights(self, x.shape[-1], self.features)
        bias = (self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
                if self.use_bias else None)
        return self.method.forward(w, x, self.layer, bias)


class Embedding(nn.Module):
    """The token embedding as its `method` stores it; `attend` is the tied LM head."""

    num_embeddings: int
    features: int
    method: EmbedMethod

    def setup(self):
        self.w = self.method.weights(self, self.num_embeddings, self.features)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """[T, features] rows of `ids` i32[T]."""
        return self.method.lookup(self.w, ids)

    def attend(self, h: jax.Array) -> jax.Array:
        """[T, num_embeddings] logits of hidden states h [T, features]."""
        return self.method.attend(self.w, h)


class _Leaves(nn.Module):
    """A group of parameter leaves under one name (`LinearMethod.weights(name=...)`)."""

    shapes: tuple  # ((leaf, shape, dtype name), ...)
    init: Any = nn.initializers.zeros

    @nn.compact
    def __call__(self) -> dict:
        return {leaf: self.param(leaf, self.init, shape, jnp.dtype(dtype))
                for leaf, shape, dtype in self.shapes}


def declare_leaves(module: nn.Module, shapes: dict, lead: tuple[int, ...] = (),
                   name: str | None = None, init=nn.initializers.zeros) -> dict:
    """Leaves {leaf: (shape, dtype)} (each led by `lead`) as params of `module`, or of a
    child named `name`; zeros at init (loaders fill them)."""
    spec = tuple((leaf, (*lead, *shape), np.dtype(dtype).name)
                 for leaf, (shape, dtype) in shapes.items())
    if name is not None:
        return _Leaves(spec, init, name=name)()
    return {leaf: module.param(leaf, init, shape, jnp.dtype(dtype)) for leaf, shape, dtype in spec}


def split_perm(w: dict) -> tuple[dict, jax.Array | None]:
    """(the leaves without `models.quant.PERM`, the permutation i32[..., K, 1] or None): an
    act-order weight's leaves, as every quantized method takes them apart."""
    if PERM not in w:
        return w, None
    return {name: a for name, a in w.items() if name != PERM}, w[PERM]


def permute_inputs(x: jax.Array, perm: jax.Array | None) -> jax.Array:
    """x [T, K] with its K axis in the order of an act-order weight's sorted rows:
    x[:, perm] (`perm` i32[K, 1]; None: x as it is). Every quantized method calls it
    before its matmul, so y = x[:, perm] @ w_sorted = x @ w."""
    return x if perm is None else jnp.take(x, perm[:, 0], axis=-1)


def unpermute_rows(kernel: jax.Array, perm: jax.Array | None) -> jax.Array:
    """A dense kernel [K, N] of sorted rows back in input order (row perm[j] = row j)."""
    return kernel if perm is None else jnp.zeros_like(kernel).at[perm[:, 0]].set(kernel)


def read_stacks(module: nn.Module, leaves) -> dict:
    """The `STACKS` leaves of `module`; ValueError naming what is missing."""
    out = {}
    for leaf in leaves:
        w = module.get_variable(STACKS, leaf)
        if w is None:
            raise ValueError(f"{'/'.join(module.path)}: no {leaf!r} in the {STACKS!r} "
                             "collection; serve the model through "
                             "models.linear.registry.serving_form")
        out[leaf] = w
    return out

