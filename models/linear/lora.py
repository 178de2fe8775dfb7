"""LoRA as a linear method that wraps another: each token adds its own adapter's update.

The device keeps `S` adapter slots per target module, stacked and zero-padded to the
largest rank served: A [in, S, R] and B [S, R, out] (the adapter's scaling folded into B,
as `models.loaders.peft_adapter` lays it out; A's input axis first so that `x @ A` over
every slot at once is one plain [T, in] @ [in, S*R] matmul), in the `models.lora.COLLECTION`
variables at the module's path. A step carries each token's slot (-1: the base model
alone; `models.linear.context`). Three ways to compute the deltas, the same numbers:

- "masked": `x @ A` for every slot at once (the [T, S*R] shrink), each token's columns of
  other slots zeroed, then one [T, S*R] @ [S*R, out] expand: two dense matmuls whose cost
  follows S*R, not the number of distinct adapters, reading each weight once.
- "gathered": each token's A and B gathered ([T, in, R], [T, R, out]) and applied per row;
  reads the weights once per token (vLLM's BGMV shape).
- "grouped" (float32 on one CPU device, the default there): the CPU LoRA kernel
  (`pallas_kernels/cpu_ffi/lora.py`) groups the rows by slot and multiplies each group by
  its slot's R columns only (an SGMV shape), reading the layer's slice of the whole stacks
  in place: the layer scan broadcasts the collection instead of slicing it
  (`scan_slices_lora`).

The XLA forms run only when some token of the step has an adapter (a `lax.cond`): a step
on the base model alone pays one predicate per module (the kernel returns at once).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.linear.base import LinearMethod
from models.linear.context import current
from models.lora import COLLECTION
from pallas_kernels.cpu_ffi import lora as kernel

LORA_IMPLS = ("masked", "gathered", "grouped")


def lora_delta(x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array,
               impl: str = "masked") -> jax.Array:
    """Each token's LoRA update of one module.

    Args:
        x: [T, in] the module's input.
        slots: i32[T] each token's adapter slot, -1 for none.
        a: [in, S, R] the slots' A stacks.
        b: [S, R, out] the slots' B stacks, scaled.
        impl: One of `LORA_IMPLS` ("grouped": the CPU kernel, float32).

    Returns:
        [T, out] in x's dtype: zeros for tokens with no adapter.

    Raises:
        ValueError: An unknown `impl`, or stacks whose shapes do not fit `x`.
    """
    if impl not in LORA_IMPLS:
        raise ValueError(f"unknown LoRA impl {impl!r}; supported: {', '.join(LORA_IMPLS)}")
    d_in, num_slots, rank = a.shape
    if b.shape[:2] != (num_slots, rank) or x.shape[-1] != d_in or slots.shape != x.shape[:1]:
        raise ValueError(f"LoRA stacks A {a.shape}, B {b.shape} do not fit tokens {x.shape} "
                         f"with slots {slots.shape}: want [in, S, R], [S, R, out], [T, in], "
                         "[T]")
    out_shape = (x.shape[0], b.shape[-1])
    x, slots, a, b = (jnp.asarray(v) for v in (x, slots, a, b))
    if impl == "grouped":  # one layer's stacks: the kernel's layer axis of length 1
        zeros = jnp.zeros(out_shape, jnp.float32)
        return kernel.lora_sgmv(zeros, x, slots, a[None], b[None]).astype(x.dtype)

    def gathered():
        safe = jnp.maximum(slots, 0)
        h = jnp.einsum("ti,itr->tr", x, a[:, safe])  # [T, R]
        y = jnp.einsum("tr,tro->to", h, b[safe])  # [T, out]
        return jnp.where((slots >= 0)[:, None], y, 0).astype(x.dtype)

    def masked():
        h = x @ a.reshape(d_in, num_slots * rank)  # [T, S*R]
        col_slot = jnp.arange(num_slots * rank, dtype=slots.dtype) // rank  # i32[S*R]
        h = jnp.where(col_slot == slots[:, None], h, 0)  # each token's own slot's columns
        return (h @ b.reshape(num_slots * rank, -1)).astype(x.dtype)  # [T, out]

    return jax.lax.cond(jnp.any(slots >= 0), gathered if impl == "gathered" else masked,
                        lambda: jnp.zeros(out_shape, x.dtype))


def resolve_impl(impl: str, dtype, one_device: bool) -> str:
    """The LoRA form a model serves with: "auto" is "grouped" (the CPU LoRA kernel) for a
    float32 model on one device of the CPU platform where the kernel builds (whichever
    attention backend), else "masked"; an explicit form is kept.

    Raises:
        ValueError: "grouped" where the kernel cannot serve, or an unknown form.
    """
    fits = jnp.dtype(dtype) == jnp.float32 and one_device and kernel.available()
    if impl == "auto":
        return "grouped" if fits else "masked"
    if impl not in LORA_IMPLS:
        raise ValueError(f"unknown LoRA impl {impl!r}; supported: auto, {', '.join(LORA_IMPLS)}")
    if impl == "grouped" and not fits:
        raise ValueError("lora_impl='grouped' needs the CPU LoRA kernel: float32 weights on "
                         f"one CPU device (got dtype {jnp.dtype(dtype).name}, "
                         f"{'one device' if one_device else 'a mesh'}, platform "
                         f"{jax.default_backend()!r}"
                         f"{'' if kernel.available() else ', the kernel unavailable'})")
    return impl


def scan_slices_lora(impl: str) -> bool:
    """Whether the layer scan slices the `COLLECTION` stacks per layer (the XLA forms) or
    broadcasts them whole for the kernel to read at the traced layer ("grouped")."""
    return impl != "grouped"


@dataclasses.dataclass(frozen=True)
class LoRALinear(LinearMethod):
    """`base` plus each token's LoRA update by `impl`, when the step carries adapter slots
    (`ForwardContext.lora_slots`) and the module's variables hold its stacks ({"a": [in,
    S, R], "b": [S, R, out]} sliced by the layer scan, or whole, [L, ...], read at the
    layer by "grouped"); else `base` alone."""

    base: LinearMethod
    impl: str = "masked"

    @property
    def stacked(self) -> bool:
        return self.base.stacked

    def leaf_shapes(self, k, n):
        return self.base.leaf_shapes(k, n)

    def weights(self, module, k, n, lead=(), name=None):
        stacks = None
        if module.has_variable(COLLECTION, "a"):
            stacks = module.get_variable(COLLECTION, "a"), module.get_variable(COLLECTION, "b")
        return self.base.weights(module, k, n, lead, name), stacks

    def apply(self, w, x, layer=None):
        return self.forward(w, x, layer)

    def forward(self, w, x, layer=None, bias=None):
        base_w, stacks = w
        y = self.base.forward(base_w, x, layer, bias)
        slots = current().lora_slots
        if slots is None or stacks is None:
            return y
        a, b = stacks
        if self.impl == "grouped":
            out = kernel.lora_sgmv(y, x, slots, a, b, 0 if layer is None else layer)
            return out.astype(y.dtype)
        return y + lora_delta(x.astype(a.dtype), slots, a, b, self.impl).astype(y.dtype)

    def dense(self, w, dtype):
        return self.base.dense(w[0], dtype)

    def to_serving(self, leaves, stacked):
        return self.base.to_serving(leaves, stacked)

    def to_standard(self, leaves, n, stacked):
        return self.base.to_standard(leaves, n, stacked)
