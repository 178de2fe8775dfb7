"""Batched LoRA deltas: every token of a step adds its own adapter's low-rank update.

The device keeps `S` adapter slots per target module, stacked and zero-padded to the
largest rank served: A [in, S, R] and B [S, R, out] (the adapter's scaling folded into B,
as `models.loaders.peft_adapter` lays it out; A's input axis first so that `x @ A` over
every slot at once is one plain [T, in] @ [in, S*R] matmul). A step carries each token's
slot (-1: the base model alone). Two ways to compute the deltas, the same numbers:

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

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ArchConfig
from pallas_kernels.cpu_ffi import lora as kernel

LORA_IMPLS = ("masked", "gathered", "grouped")
# The decoder modules an adapter may target, as (block, module).
TARGETS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
           ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
           ("mlp", "down_proj"))
# The Flax collection of the slot stacks: {"layers": {block: {module: {"a", "b"}}}}, each
# leaf led by the layer axis (A [L, in, S, R], B [L, S, R, out]), which the layer scan
# slices like the params.
COLLECTION = "lora"


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


def module_shapes(cfg: ArchConfig) -> dict[tuple[str, str], tuple[int, int]]:
    """(in, out) of every module an adapter may target in `cfg`'s decoder layers."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    return {("self_attn", "q_proj"): (h, q), ("self_attn", "k_proj"): (h, kv),
            ("self_attn", "v_proj"): (h, kv), ("self_attn", "o_proj"): (q, h),
            ("mlp", "gate_proj"): (h, i), ("mlp", "up_proj"): (h, i),
            ("mlp", "down_proj"): (i, h)}


def served_targets(cfg: ArchConfig) -> tuple[tuple[str, str], ...]:
    """The (block, module) pairs adapters may change in `cfg`'s layers: attention and the
    dense MLP's projections; attention only in a mixture of experts (its experts, router
    and shared expert are not adapted)."""
    if cfg.is_moe or cfg.is_mixed:
        return tuple(t for t in TARGETS if t[0] == "self_attn")
    return TARGETS


def stack_shapes(cfg: ArchConfig, num_slots: int, rank: int
                 ) -> dict[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]]:
    """(block, module) -> the shapes of its A [L, in, S, R] and B [L, S, R, out] stacks."""
    shapes = module_shapes(cfg)
    return {t: ((cfg.num_layers, shapes[t][0], num_slots, rank),
                (cfg.num_layers, num_slots, rank, shapes[t][1]))
            for t in served_targets(cfg)}


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


def add_lora(module: nn.Module, name: str, x: jax.Array, y: jax.Array,
             slots: jax.Array | None, impl: str = "masked", layer=None) -> jax.Array:
    """`y` (the output of `module`'s projection `name` of `x`) plus each token's LoRA
    update by `impl`, when the step carries adapter slots (`slots` i32[T]) and the
    variables hold the projection's stacks (collection `COLLECTION`: {"a": [in, S, R],
    "b": [S, R, out]} sliced by the layer scan, or whole, [L, ...], read at `layer` (i32[])
    by the "grouped" kernel); else `y` as it is."""
    if slots is None or not module.has_variable(COLLECTION, name):
        return y
    w = module.get_variable(COLLECTION, name)
    if impl == "grouped":
        out = kernel.lora_sgmv(y, x, slots, w["a"], w["b"], 0 if layer is None else layer)
        return out.astype(y.dtype)
    return y + lora_delta(x.astype(w["a"].dtype), slots, w["a"], w["b"], impl).astype(y.dtype)
