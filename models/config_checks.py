"""The mixture-of-experts and linear-attention checks of an `ArchConfig` (`__post_init__` runs
them), and the router orders and linear-layer kinds they accept."""

from __future__ import annotations

from models.deepseek_config import check_groups
from models.moe_config import check_expert_act

# What a hybrid's linear layers are: Gated DeltaNet (`models.gated_deltanet`) or Mamba-2
# (`models.mamba2`, Granite 4.0).
LINEAR_KINDS = ("gated_deltanet", "mamba2")
# How a mixture-of-experts router turns logits into weights (`models.moe.route`):
# softmax over all experts then top-k (Qwen-MoE, OLMoE, DeepSeek-V2), top-k logits then softmax
# (Mixtral), or sigmoid scores, top-k by score plus a correction bias (DeepSeek-V3).
# Llama 4's "topk_sigmoid": the top-k logits through a sigmoid, each weight scaling its
# expert's INPUT (`models.moe.MoEMLP`).
ROUTER_ORDERS = ("softmax_topk", "topk_softmax", "sigmoid_topk", "topk_sigmoid")


def check_moe(cfg) -> None:
    """Checks a mixture of experts' fields of an `ArchConfig` (its dense layers, router,
    expert activation and groups).

    Raises:
        ValueError: A field out of range, named.
    """
    if cfg.num_experts < 0 or cfg.shared_expert_intermediate_size < 0:
        raise ValueError(f"num_experts ({cfg.num_experts}) and "
                         f"shared_expert_intermediate_size "
                         f"({cfg.shared_expert_intermediate_size}) must be >= 0")
    if not cfg.num_experts:
        check_expert_act(cfg)
        if cfg.dense_layers:
            raise ValueError(f"dense_layers={list(cfg.dense_layers)} needs a mixture "
                             "of experts (num_experts > 0)")
        return
    if not 0 < cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be in "
                         f"1..num_experts ({cfg.num_experts})")
    if cfg.moe_intermediate_size <= 0:
        raise ValueError(f"moe_intermediate_size must be positive, got "
                         f"{cfg.moe_intermediate_size}")
    if cfg.router_order not in ROUTER_ORDERS:
        raise ValueError(f"unsupported router_order {cfg.router_order!r}; supported: "
                         f"{', '.join(ROUTER_ORDERS)}")
    check_groups(cfg)
    check_expert_act(cfg)
    dense = cfg.dense_layers
    if list(dense) != sorted(set(dense)) or not all(0 <= i < cfg.num_layers
                                                    for i in dense):
        raise ValueError(f"dense_layers={list(dense)} must be distinct layers in "
                         f"0..{cfg.num_layers - 1}, ascending")
    if len(dense) == cfg.num_layers:
        raise ValueError(f"dense_layers={list(dense)} leaves no sparse layer; a model "
                         "without experts has num_experts=0")

def check_linear(cfg) -> None:
    """Checks a linear-attention hybrid's fields of an `ArchConfig`.

    Raises:
        ValueError: An unknown `linear_kind`, bad `linear_layers` or head sizes, named.
    """
    lin = cfg.linear_layers
    if cfg.linear_kind not in LINEAR_KINDS:
        raise ValueError(f"unsupported linear_kind {cfg.linear_kind!r}; supported: "
                         f"{', '.join(LINEAR_KINDS)}")
    if not lin:
        return
    if list(lin) != sorted(set(lin)) or not all(0 <= i < cfg.num_layers for i in lin):
        raise ValueError(f"linear_layers={list(lin)} must be distinct layers in "
                         f"0..{cfg.num_layers - 1}, ascending")
    if len(lin) == cfg.num_layers:
        raise ValueError(f"linear_layers={list(lin)} leaves no full_attention layer; a "
                         "hybrid needs at least one")
    for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim"):
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{name} must be positive for linear_attention layers, got "
                             f"{getattr(cfg, name)}")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ValueError(f"linear_num_value_heads ({cfg.linear_num_value_heads}) must "
                         f"be a multiple of linear_num_key_heads "
                         f"({cfg.linear_num_key_heads})")
