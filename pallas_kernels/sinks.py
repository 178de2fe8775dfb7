"""Learned attention sinks (gpt-oss): one extra logit per query head in every softmax.

transformers' eager attention appends `sinks[h]` (f32, not scaled by `sm_scale`, no soft
cap) as an extra column of each row's scores, takes the softmax over the row plus that
column and drops the column: the sink takes probability mass but adds no value. For a row
whose real keys have log-sum-exp `lse` (logits after scale, cap and mask), that is

    out_with_sinks = out * sigmoid(lse - sink) = out / (1 + exp(sink - lse))

where `out` is the row's ordinary softmax output. Every attention path keeps an online
softmax state (running max `m`, denominator `denom`), so `lse = m + log(denom)` and the
sink is one multiply after the last key block; a row with no keys (`denom == 0`: padding)
has `lse = -inf`, a factor of 0, and stays 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_sinks(sinks, num_q_heads: int) -> None:
    """Raises ValueError unless `sinks` is None or an array of shape [num_q_heads].

    Args:
        sinks: The per-query-head sink logits, or None (no sinks).
        num_q_heads: Query heads of the attention call (q's second axis).
    """
    if sinks is None:
        return
    shape = getattr(sinks, "shape", None)
    if shape is None or tuple(shape) != (num_q_heads,):
        raise ValueError(f"sinks must be f32[num_q_heads = {num_q_heads}] (one logit per query "
                         f"head), got shape {shape}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks must be a float array, got dtype {sinks.dtype}")


def sink_factor(m: jax.Array, denom: jax.Array, sink: jax.Array) -> jax.Array:
    """`sigmoid(lse - sink)` of rows with online-softmax state (m, denom): the factor that
    turns a row's normalized output into its output with a sink (0 where denom is 0).

    Written as `1 / (1 + exp(sink - lse))` with plain exp and log only (the Pallas kernels
    lower it as it is): exp overflowing to inf gives the right limit 0, never NaN.

    Args:
        m: f32 running max of each row (any shape).
        denom: f32 sum of exp(logit - m) over the row's keys, m's shape.
        sink: f32 sink logit of each row, broadcastable to m.
    """
    lse = m + jnp.log(denom)  # -inf where the row saw no key
    return 1.0 / (1.0 + jnp.exp(sink.astype(jnp.float32) - lse))


def grouped_sinks(sinks: jax.Array, num_kv_heads: int) -> jax.Array:
    """Sinks f32[Hq] as f32[num_kv_heads, group]: the query-head layout every path uses
    (query head h * group + j shares KV head h)."""
    return sinks.astype(jnp.float32).reshape(num_kv_heads, -1)
