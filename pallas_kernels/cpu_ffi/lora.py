"""The `cpu` backend's LoRA kernel: each token times its own adapter slot's rank only.

`lora_sgmv(y, x, slots, a, b, layer)` returns y + each token's LoRA update, reading layer
`layer` of the slot stacks A f32[L, in, S, R] and B f32[L, S, R, out] (`models.lora`'s
layout) in place: the rows are grouped by slot inside the kernel and each group multiplied
by its slot's R columns (an SGMV shape), where the XLA forms multiply every row by all
S * R columns ("masked") or gather per-row copies of the weights ("gathered")
(`lora_sgmv.cc`).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

TARGET = "jaxserve_lora_sgmv_cpu"
SOURCE = os.path.join(os.path.dirname(__file__), "lora_sgmv.cc")
MAX_RANK = 512  # the kernel's rank limit (`kMaxRank`)


@functools.cache
def _registered() -> str | None:
    """Builds and registers the FFI target once per process; None, or why it failed."""
    from pallas_kernels.cpu_ffi.build import register

    return register(SOURCE, "LoraSgmv", TARGET, "the CPU LoRA kernel",
                    "LoRA updates use XLA's masked form")


def available() -> bool:
    """Whether the kernel could be built and registered here (builds it on first call)."""
    return jax.default_backend() == "cpu" and _registered() is None


def lora_sgmv(y: jax.Array, x: jax.Array, slots: jax.Array, a: jax.Array, b: jax.Array,
              layer=0) -> jax.Array:
    """y plus each token's LoRA update by its own slot (rows of slot -1 unchanged).

    Args:
        y: f32[T, out] the projection's output.
        x: f32[T, in] its input.
        slots: i32[T] each token's slot, -1 for none.
        a: f32[L, in, S, R] the slots' A stacks.
        b: f32[L, S, R, out] the slots' B stacks, scaled.
        layer: i32[] which layer of the stacks (clamped to [0, L)).

    Returns:
        f32[T, out].

    Raises:
        ValueError: Shapes that do not fit, or a rank past `MAX_RANK`.
        RuntimeError: The kernel is unavailable here.
    """
    num_layers, d_in, num_slots, rank = a.shape
    if (b.shape != (num_layers, num_slots, rank, y.shape[-1]) or x.shape != (y.shape[0], d_in)
            or slots.shape != y.shape[:1] or rank > MAX_RANK):
        raise ValueError(f"lora_sgmv: stacks A {a.shape}, B {b.shape} do not fit y {y.shape}, "
                         f"x {x.shape}, slots {slots.shape} (rank at most {MAX_RANK})")
    if not available():
        raise RuntimeError("the CPU LoRA kernel is unavailable here")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(y.shape, jnp.float32),
                            input_output_aliases={0: 0})
    return call(y.astype(jnp.float32), x.astype(jnp.float32), slots.astype(jnp.int32),
                a.astype(jnp.float32), b.astype(jnp.float32), jnp.asarray(layer, jnp.int32))
