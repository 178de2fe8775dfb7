"""Gemma 4's MoE block (`enable_moe_block`): a dense MLP and routed experts side by side in
every layer, the experts on the shared mixture-of-experts machinery (`models.moe`).

As transformers' `Gemma4TextDecoderLayer`, with x the residual stream after attention:
`h1 = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(x)))`, the router reads x
itself (RMS-normed without a weight, times its `scale` [H] and `H ** -0.5`, `proj` [H, E],
softmax over all experts, the top k renormalized to sum one, each times its expert's
`per_expert_scale`), the experts (gated, `hidden_activation`) read
`pre_feedforward_layernorm_2(x)`, `h2 = post_feedforward_layernorm_2(experts)`; the block
returns `h1 + h2`, which the layer norms (`post_feedforward_layernorm`) and adds to x.

The weights live under the layer's `mlp` (the dense projections where a `GatedMLP` keeps
them, `router`, `experts`, the three norms), so the experts are every mixture of experts'
`layers/mlp/experts` stacks: quantized by a plan's `experts.*` modules, split by expert
parallelism, read whole in the serving form. `models.loaders.gemma4_moe_names` reads them
from transformers' names (`model.layers.{i}.router.proj.weight`, `experts.gate_up_proj`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ArchConfig
from models.gemma4 import plain_rms
from models.layers import ACTIVATIONS, RMSNorm
from models.linear import Linear, Methods
from models.moe import Experts, routed_experts
from models.moe_act import expert_act
from models.moe_parallel import ExpertSharding
from models.moe_route import route

ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
# The HF fields the block needs, each a positive integer.
MOE_FIELDS = ("num_experts", "top_k_experts", "moe_intermediate_size")


def has_moe_block(cfg: ArchConfig) -> bool:
    """Whether `cfg`'s layers run Gemma 4's MoE block (a Gemma 4 with experts)."""
    return cfg.is_moe and cfg.architecture in ARCHITECTURES


def moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The `ArchConfig` fields of a Gemma 4 text config's MoE block (none without
    `enable_moe_block`): its router is "softmax_topk" with the top k renormalized.

    Raises:
        ValueError: A missing or non-positive `num_experts`, `top_k_experts` or
            `moe_intermediate_size`, or `top_k_experts` above `num_experts` (named).
    """
    if not hf.get("enable_moe_block"):
        return {}
    values = {}
    for field in MOE_FIELDS:
        value = hf.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"enable_moe_block=True needs a positive integer {field}, "
                             f"got {value!r}")
        values[field] = value
    if values["top_k_experts"] > values["num_experts"]:
        raise ValueError(f"top_k_experts={values['top_k_experts']} must be at most "
                         f"num_experts={values['num_experts']}")
    return dict(num_experts=values["num_experts"], num_experts_per_tok=values["top_k_experts"],
                moe_intermediate_size=values["moe_intermediate_size"],
                router_order="softmax_topk", norm_topk_prob=True)


class Gemma4Router(nn.Module):
    """Gemma 4's router (transformers' `Gemma4TextRouter`): `proj` [H, E] over the
    weight-free RMS norm of the residual times `router_scale` [H] and `H ** -0.5`; softmax,
    top k renormalized, times `per_expert_scale` [E] of each chosen expert."""

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods

    @nn.compact
    def __call__(self, x: jax.Array, layer=None) -> tuple[jax.Array, jax.Array]:
        """x [T, H] (the residual stream) -> (weights f32[T, k], ids i32[T, k])."""
        cfg = self.cfg
        h, e = cfg.hidden_size, cfg.num_experts
        scale = self.param("router_scale", nn.initializers.ones, (h,), self.dtype)  # [H]
        per_expert = self.param("per_expert_scale", nn.initializers.ones, (e,),
                                self.dtype)  # [E]
        x = plain_rms(x, cfg.rms_norm_eps) * scale.astype(x.dtype) * jnp.asarray(
            h ** -0.5, x.dtype)  # [T, H]
        logits = Linear(e, self.methods.linear("gate"), False, self.dtype, layer,
                        name="proj")(x)  # [T, E]
        weights, ids = route(logits, cfg.num_experts_per_tok, cfg.router_order,
                             cfg.norm_topk_prob)  # f32[T, k], i32[T, k]
        return weights * per_expert[ids].astype(jnp.float32), ids


class Gemma4MoEBlock(nn.Module):
    """A Gemma 4 layer's MLP with `enable_moe_block`: the dense gated MLP and the routed
    experts beside it (module docstring), in the layer's `mlp` scope.

    Attributes:
        cfg: Architecture config (`has_moe_block`).
        dtype: Parameter dtype.
        methods: The model's methods (the dense projections' by name, the experts'
            stacks' by projection, the router's as "gate").
        sharding: How a device mesh splits the experts (`models.moe_parallel`); None:
            one device.
        return_ids: Also return the routed expert ids (routing capture).
    """

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods
    sharding: ExpertSharding | None = None
    return_ids: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, layer, residual: jax.Array):
        """x [T, H] (`pre_feedforward_layernorm` of the residual), `layer` i32[] and the
        residual stream [T, H] -> `h1 + h2` [T, H]; with `return_ids`, (that, i32[T, k])."""
        cfg, methods = self.cfg, self.methods

        def norm(name):
            return RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_offset,
                           methods.batch_invariant, name=name)

        def dense(n, name, h):
            return Linear(n, methods.linear(name), cfg.mlp_bias, self.dtype, layer,
                          name=name)(h)

        width = cfg.intermediate_size
        h = ACTIVATIONS[cfg.hidden_act](dense(width, "gate_proj", x)) * dense(
            width, "up_proj", x)  # [T, I]
        h1 = norm("post_feedforward_layernorm_1")(dense(cfg.hidden_size, "down_proj", h))
        weights, ids = Gemma4Router(cfg, self.dtype, methods, name="router")(residual, layer)
        experts, stacked = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                   methods, dtype=self.dtype, name="experts")()
        routed = routed_experts(norm("pre_feedforward_layernorm_2")(residual), weights, ids,
                                experts=experts, stacked=stacked, layer=layer,
                                act=expert_act(cfg), methods=methods,
                                sharding=self.sharding)  # [T, H]
        out = h1 + norm("post_feedforward_layernorm_2")(routed)
        return (out, ids) if self.return_ids else out
