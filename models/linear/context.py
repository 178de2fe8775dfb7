"""What one forward pass tells the linear methods without the model passing it: the step's
real token count and each token's LoRA adapter slot (vLLM's forward context).

The model calls `Linear(...)(x)` and nothing more; a method that needs a per-step value
reads it here while the step is traced. The runner sets `real_rows` (its steps are padded
to a bucket: the CPU kernels skip the padding rows); `Model.forward` sets `lora_slots`
when the step carries adapters. Values are tracers of the trace being built, so a context
is entered inside the traced function, around the apply it concerns.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax


@dataclasses.dataclass(frozen=True)
class ForwardContext:
    """Per-step values for the linear methods.

    Attributes:
        real_rows: i32[]: the rows of a linear layer's input that are real tokens (they
            come first; the rest is padding whose outputs may be left 0); None: all.
        lora_slots: i32[T]: each token's adapter slot (-1: none); None: no adapters.
    """

    real_rows: jax.Array | None = None
    lora_slots: jax.Array | None = None


_EMPTY = ForwardContext()
_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "jaxserve_forward_context", default=None)


def current() -> ForwardContext:
    """The innermost forward context (empty outside any)."""
    return _CURRENT.get() or _EMPTY


@contextlib.contextmanager
def forward_context(**values) -> Iterator[ForwardContext]:
    """Sets `ForwardContext` fields (the others keep the enclosing context's) for the
    duration of the block.

    Raises:
        TypeError: A field `ForwardContext` does not have.
    """
    ctx = dataclasses.replace(current(), **values)
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
