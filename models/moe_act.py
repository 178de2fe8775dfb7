"""The routed experts' gated activation: `act(gate) * up` for the activation names, or
gpt-oss's clamped SwiGLU (`ClampedSwiGLU`; its config fields are checked by
`models.moe_config.check_expert_act`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.layers import ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (transformers' `GptOssExperts._apply_gate`): the gate
    clamped above at `limit`, the up projection to [-limit, limit], then
    `(up + 1) * gate * sigmoid(alpha * gate)`. Hashable: a static argument of the experts.

    Attributes:
        alpha: The sigmoid's gain (1.702).
        limit: The clamp (gpt-oss's `swiglu_limit`, 7.0).
    """

    alpha: float
    limit: float

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


# What the experts' code is given as their activation: an `ACTIVATIONS` name or the clamp.
ExpertAct = str | ClampedSwiGLU


def expert_act(cfg) -> ExpertAct:
    """The routed experts' activation of an `ArchConfig`: the clamped SwiGLU when
    `swiglu_limit` is set, else `hidden_act`."""
    if cfg.swiglu_limit is None:
        return cfg.hidden_act
    return ClampedSwiGLU(float(cfg.swiglu_alpha), float(cfg.swiglu_limit))


def glu(act: ExpertAct, gate: jax.Array, up: jax.Array) -> jax.Array:
    """The gated hidden [rows, I] of the gate and up projections' outputs [rows, I]."""
    if isinstance(act, ClampedSwiGLU):
        return act(gate, up)
    return ACTIVATIONS[act](gate) * up
