"""Pure-jnp causal depthwise conv1d over the ragged batch with carried state (the oracle, and
the path every backend serves with).

Row r's inputs this step are preceded by its last W - 1 inputs of earlier steps (its slot's
conv state, zeros at its first chunk); token t's output is

    y[t, c] = act(bias[c] + sum_j weight[j, c] * xx[t - (W - 1) + j, c])

over that history xx, and the slot keeps the row's last W - 1 inputs.

NOTE: no Pallas kernel. The op reads each input W times and does W multiply-adds per
value: it is memory-bound, and XLA fuses the tap gather, the sum, the bias and the SiLU
into one pass over x (plus a gather of R states), which is what a kernel would do. The
model's projections around it cost hundreds of times more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.state_slots import (
    check_rows,
    initial_states,
    q_lens_of,
    token_rows,
    write_back,
)

ACTIVATIONS = ("silu", None)


def check_conv_shapes(x, weight, bias, conv_state, slots, cu_q_lens, kv_lens,
                      activation) -> None:
    """Raises ValueError naming the argument that does not fit (see
    `causal_conv1d_reference` for the shapes)."""
    if x.ndim != 2:
        raise ValueError(f"x must be [num_tokens, channels], got shape {x.shape}")
    channels = x.shape[1]
    if weight.ndim != 2 or weight.shape[1] != channels or weight.shape[0] < 1:
        raise ValueError(f"weight {weight.shape} must be [width, channels={channels}]")
    if bias is not None and bias.shape != (channels,):
        raise ValueError(f"bias {bias.shape} must be [channels] = [{channels}]")
    width = weight.shape[0]
    if conv_state.ndim != 3 or conv_state.shape[1:] != (width - 1, channels):
        raise ValueError(f"conv_state {conv_state.shape} must be [num_slots, width - 1, "
                         f"channels] = [num_slots, {width - 1}, {channels}]")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not one of {ACTIVATIONS}")
    check_rows(conv_state, slots, cu_q_lens, kv_lens)


def _history(x, prev, row, start, offset):
    """Row `row`'s inputs at `offset` (i32[...]) from its first token `start` this step:
    x's where offset >= 0, else the carried state's (offset -1 its newest)."""
    width_m1 = prev.shape[1]
    from_x = x[jnp.clip(start + offset, 0, x.shape[0] - 1)]  # f32[..., C]
    from_state = prev[row, jnp.clip(width_m1 + offset, 0, width_m1 - 1)]  # f32[..., C]
    return jnp.where((offset >= 0)[..., None], from_x, from_state)


def causal_conv1d_reference(x, weight, bias, conv_state, slots, cu_q_lens, kv_lens,
                            activation: str | None = "silu"):
    """Causal depthwise conv1d of each row's tokens, continuing from its slot's state.

    Args:
        x: f32[T, C] the step's inputs, packed by row (tokens past cu_q_lens[-1] padding).
        weight: f32[W, C] each channel's taps, oldest first.
        bias: f32[C] or None.
        conv_state: f32[S, W - 1, C] each slot's last W - 1 inputs, oldest first.
        slots: i32[R]; cu_q_lens: i32[R + 1]; kv_lens: i32[R] (`pallas_kernels.state_slots`).
        activation: "silu" or None.

    Returns:
        (y f32[T, C] zero on padding tokens, the pool with each row's last W - 1 inputs in
        its slot; a row shorter than W - 1 keeps the newest part of its old state).
    """
    check_conv_shapes(x, weight, bias, conv_state, slots, cu_q_lens, kv_lens, activation)
    num_tokens, _ = x.shape
    width = weight.shape[0]
    x32, w32 = x.astype(jnp.float32), weight.astype(jnp.float32)
    if width == 1:  # no history: a per-channel scale
        prev = jnp.zeros((slots.shape[0], 1, x.shape[1]), jnp.float32)
    else:
        prev = initial_states(conv_state.astype(jnp.float32), slots, cu_q_lens, kv_lens)
    row, valid = token_rows(cu_q_lens, num_tokens)  # i32[T], bool[T]
    taps = jnp.arange(width, dtype=jnp.int32)
    # Token t's tap j reads the input (W - 1 - j) before it: x's own row, else the state.
    start = cu_q_lens[row]  # i32[T]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    offset = (t - start)[:, None] - (width - 1) + taps  # i32[T, W]
    xx = _history(x32, prev, row[:, None], start[:, None], offset)  # f32[T, W, C]
    y = jnp.einsum("twc,wc->tc", xx, w32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if activation == "silu":
        y = jax.nn.silu(y)
    y = jnp.where(valid[:, None], y, 0.0)
    if width == 1:
        return y, conv_state
    # The row's last W - 1 inputs: offsets q_len - (W - 1) .. q_len - 1 from its start.
    rows = jnp.arange(slots.shape[0], dtype=jnp.int32)
    keep = q_lens_of(cu_q_lens)[:, None] - (width - 1) + taps[:-1]  # i32[R, W - 1]
    new = _history(x32, prev, rows[:, None], cu_q_lens[:-1, None], keep)  # f32[R, W-1, C]
    return y, write_back(conv_state, slots, cu_q_lens, new)
