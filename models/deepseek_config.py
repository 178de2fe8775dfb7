"""The config fields of DeepSeek-V2/V3 (and Kimi K2): multi-head latent attention, DeepSeek's
routing, dense first layers and shared experts, read into `ArchConfig` fields; and the
checks `ArchConfig` runs on those fields."""

from __future__ import annotations

import math
from typing import Any

from models.rope import parse_rope

# transformers' config defaults for the fields a checkpoint may omit, per version.
DEFAULTS = {
    "v2": dict(first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536, n_group=None,
               n_routed_experts=64, n_shared_experts=2, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=1.0,
               topk_group=None, topk_method="greedy", norm_topk_prob=False,
               moe_intermediate_size=1407),
    "v3": dict(first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536, n_group=8,
               n_routed_experts=256, n_shared_experts=1, qk_nope_head_dim=128,
               qk_rope_head_dim=64, v_head_dim=128, routed_scaling_factor=2.5, topk_group=4,
               norm_topk_prob=True, moe_intermediate_size=2048, rope_interleave=True),
}
# DeepSeek-V2's `topk_method`s: plain top-k of the softmax, or top-k within the best groups.
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def _positive(hf: dict[str, Any], name: str) -> int:
    value = hf.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name}={value!r} for {hf['architectures'][0]} must be a positive "
                         "integer")
    return value


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(factor) + 1` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(hf: dict[str, Any], qk_head_dim: int) -> float:
    """MLA's softmax scale, as transformers' `yarn_apply_mscale`: `qk_head_dim ** -0.5`,
    times `yarn_mscale(factor, mscale_all_dim) ** 2` under a scaled rotary that sets
    `mscale_all_dim` (DeepSeek scales the whole q.k, not only its roped part)."""
    scale = qk_head_dim ** -0.5
    scaling = parse_rope(hf)[1]
    if scaling.rope_type != "default" and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale


def deepseek_fields(hf: dict[str, Any], version: str) -> dict[str, Any]:
    """The `ArchConfig` fields of a DeepSeek config (`version` "v2" or "v3"): MLA's ranks and
    head widths (`head_dim` is the roped key part, `qk_rope_head_dim`), the softmax scale
    (`attention_multiplier`), the router (V3: sigmoid scores with the correction bias,
    group-limited top-k, `norm_topk_prob`; V2: softmax, `greedy` or
    `group_limited_greedy`), `routed_scaling_factor`, the shared experts
    (`n_shared_experts` experts' width, ungated) and the dense layers
    (`first_k_dense_replace`).

    Raises:
        ValueError: A field transformers' class would not serve or that does not fit:
            `attention_bias`, an odd or missing width, a V2 `topk_method` it lacks or
            `norm_topk_prob` (its router never renormalizes), `first_k_dense_replace`
            leaving no sparse layer (each named).
    """
    # NOTE: a null `q_lora_rank` means no query low rank (q_proj), not the default.
    q_none = "q_lora_rank" in hf and hf["q_lora_rank"] is None
    hf = {**DEFAULTS[version], **{k: v for k, v in hf.items() if v is not None}}
    arch = hf["architectures"][0]
    if hf.get("attention_bias"):
        raise ValueError(f"unsupported attention_bias=True for {arch}: MLA projections "
                         "without biases are served")
    rank, nope = _positive(hf, "kv_lora_rank"), _positive(hf, "qk_nope_head_dim")
    rope, v = _positive(hf, "qk_rope_head_dim"), _positive(hf, "v_head_dim")
    q_rank = 0 if q_none else _positive(hf, "q_lora_rank")
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim={rope} for {arch} must be even (rotary pairs)")
    n = int(hf["num_hidden_layers"])
    dense = int(hf["first_k_dense_replace"])
    if not 0 <= dense < n:
        raise ValueError(f"first_k_dense_replace={dense} for {arch} must leave a sparse "
                         f"layer among the {n}")
    experts = _positive(hf, "n_routed_experts")
    fields = dict(
        kv_lora_rank=rank, q_lora_rank=q_rank, qk_nope_head_dim=nope, v_head_dim=v,
        head_dim=rope, num_kv_heads=int(hf["num_attention_heads"]),
        attention_multiplier=mla_softmax_scale(hf, nope + rope),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        num_experts=experts, num_experts_per_tok=_positive(hf, "num_experts_per_tok"),
        moe_intermediate_size=_positive(hf, "moe_intermediate_size"),
        shared_expert_intermediate_size=int(hf["moe_intermediate_size"])
        * int(hf.get("n_shared_experts") or 0),
        shared_expert_gated=False, dense_layers=tuple(range(dense)),
        routed_scaling_factor=float(hf["routed_scaling_factor"]))
    if version == "v3":
        return dict(fields, router_order="sigmoid_topk", n_group=int(hf["n_group"]),
                    topk_group=int(hf["topk_group"]),
                    norm_topk_prob=bool(hf["norm_topk_prob"]))
    method = hf["topk_method"]
    if method not in V2_TOPK_METHODS:
        raise ValueError(f"unsupported topk_method {method!r} for {arch}; supported: "
                         f"{', '.join(V2_TOPK_METHODS)}")
    if hf.get("norm_topk_prob"):
        raise ValueError(f"unsupported norm_topk_prob=True for {arch}: transformers' "
                         "DeepSeek-V2 router never renormalizes its top-k weights")
    grouped = method == "group_limited_greedy"
    return dict(fields, router_order="softmax_topk", norm_topk_prob=False,
                n_group=int(hf["n_group"]) if grouped else 1,
                topk_group=int(hf["topk_group"]) if grouped else 1)


def check_groups(cfg) -> None:
    """Raises ValueError unless `cfg`'s (an `ArchConfig` with experts) router groups fit:
    `n_group` dividing the experts, `topk_group` in 1..n_group with room for the top-k,
    two experts a group for a sigmoid router, a positive `routed_scaling_factor`."""
    e, g = cfg.num_experts, cfg.n_group
    if g < 1 or e % g:
        raise ValueError(f"n_group={g} must divide the {e} routed experts (n_routed_experts)")
    if not 1 <= cfg.topk_group <= g:
        raise ValueError(f"topk_group={cfg.topk_group} must be in 1..n_group ({g})")
    if cfg.num_experts_per_tok > cfg.topk_group * (e // g):
        raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds the "
                         f"{cfg.topk_group * (e // g)} experts of topk_group={cfg.topk_group} "
                         "groups")
    if cfg.router_order == "sigmoid_topk" and e // g < 2:
        raise ValueError(f"n_group={g} leaves fewer than 2 experts a group; a group's score "
                         "is its two best experts'")
    if not cfg.routed_scaling_factor > 0:
        raise ValueError(f"routed_scaling_factor must be positive, got "
                         f"{cfg.routed_scaling_factor}")


# MLA's plain linear projections besides `LAYER_MATMULS`' q_proj and o_proj (`models.mla`),
# each served by its name's method (an FP8 checkpoint's blocks as stored). `kv_b_proj` is not
# one: its kernel is read whole and split per head (`models.mla.LinearWeight`).
MLA_MATMULS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")

# How multi-head latent attention attends (`ArchConfig.mla_form`, `models.mla`).
MLA_FORMS = ("absorbed", "expanded", "prefill_expanded")


def check_mla(cfg) -> None:
    """Raises ValueError unless `cfg`'s (an `ArchConfig`) latent-attention fields fit: all
    zero without `kv_lora_rank`; with it, positive widths, no GQA-only feature, and a
    roped key part (`head_dim`) rotated whole."""
    dims = ("q_lora_rank", "qk_nope_head_dim", "v_head_dim")
    if cfg.mla_form not in MLA_FORMS:
        raise ValueError(f"unknown mla_form {cfg.mla_form!r}; choose one of "
                         f"{', '.join(MLA_FORMS)}")
    if not cfg.is_mla:
        if cfg.kv_lora_rank < 0 or any(getattr(cfg, n) for n in dims):
            raise ValueError(f"{', '.join(dims)} need multi-head latent attention "
                             f"(kv_lora_rank > 0, got {cfg.kv_lora_rank})")
        if cfg.mla_form != "absorbed":
            raise ValueError(f"mla_form={cfg.mla_form!r} needs multi-head latent attention "
                             f"(kv_lora_rank > 0, got {cfg.kv_lora_rank})")
        return
    for name in dims:
        if getattr(cfg, name) < (0 if name == "q_lora_rank" else 1):
            raise ValueError(f"{name} must be positive for multi-head latent attention, "
                             f"got {getattr(cfg, name)}")
    if cfg.has_linear_attention or cfg.attn_output_gate or cfg.qk_norm:
        raise ValueError("multi-head latent attention (kv_lora_rank) is not served with "
                         "linear_layers, attn_output_gate or qk_norm")
    if cfg.rotary_dim != cfg.head_dim:
        raise ValueError(f"partial_rotary_factor={cfg.partial_rotary_factor}: MLA's roped "
                         f"key part (head_dim={cfg.head_dim}) turns whole")
