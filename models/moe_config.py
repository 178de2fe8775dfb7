"""The mixture-of-experts fields of an HF config: expert counts and widths, and which layers
stay dense (Qwen-MoE's `mlp_only_layers` and `decoder_sparse_step`)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def sparse_fields(hf: dict[str, Any], num_experts_key: str, expert_size_key: str,
                  mixed: bool = False) -> dict:
    """The mixture-of-experts fields of an HF config (`num_experts_key`: its expert count,
    `expert_size_key`: one expert's width).

    With `mixed` (Qwen2-MoE, Qwen3-MoE), the layers whose MLP stays dense, as
    transformers decides: layer i is sparse unless it is in `mlp_only_layers` or
    `(i + 1) % decoder_sparse_step` is not 0 (`ArchConfig.dense_layers`). Other families'
    transformers classes read neither field, and neither do we.

    Raises:
        ValueError: No experts; an `mlp_only_layers` entry that is not a layer, a
            `decoder_sparse_step` below 1, or fields that leave no layer sparse (named).
    """
    arch = hf["architectures"][0]
    # NOTE: transformers 5 saves some configs' `num_experts` as `num_local_experts`
    # (its attribute map); published checkpoints spell it `num_experts`.
    num_experts = int(hf.get(num_experts_key) or hf.get("num_local_experts") or 0)
    if num_experts <= 0:
        raise ValueError(f"{arch} config has {num_experts_key}={num_experts}; a mixture of "
                         "experts needs at least one")
    if hf.get("output_router_logits"):
        logger.info("%s: output_router_logits is ignored (serving returns no router "
                    "logits)", arch)
    fields = dict(num_experts=num_experts, num_experts_per_tok=int(hf["num_experts_per_tok"]),
                  moe_intermediate_size=int(hf[expert_size_key]))
    if mixed:
        fields["dense_layers"] = _dense_layers(hf, arch)
    return fields


def _dense_layers(hf: dict[str, Any], arch: str) -> tuple[int, ...]:
    """The dense layers `mlp_only_layers` and `decoder_sparse_step` give (`sparse_fields`)."""
    n = int(hf["num_hidden_layers"])
    only = list(hf.get("mlp_only_layers") or [])
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in only):
        raise ValueError(f"mlp_only_layers={only} for {arch}: every entry must be a layer "
                         f"index in 0..{n - 1}")
    step = hf.get("decoder_sparse_step")
    step = 1 if step is None else step
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"decoder_sparse_step={step!r} for {arch} must be an integer >= 1")
    dense = tuple(i for i in range(n) if i in only or (i + 1) % step)
    if len(dense) == n:
        raise ValueError(f"mlp_only_layers={only} and decoder_sparse_step={step} leave no "
                         f"sparse layer among the {n} layers of this {arch}")
    return dense


def check_expert_act(cfg) -> None:
    """Checks an `ArchConfig`'s expert activation and bias fields.

    Raises:
        ValueError: A `swiglu_limit` or `swiglu_alpha` that is not positive, or
            `swiglu_limit`/`moe_bias` on a model without routed experts (named).
    """
    if cfg.swiglu_limit is not None and not cfg.swiglu_limit > 0:
        raise ValueError(f"swiglu_limit must be positive (or None), got {cfg.swiglu_limit}")
    if not cfg.swiglu_alpha > 0:
        raise ValueError(f"swiglu_alpha must be positive, got {cfg.swiglu_alpha}")
    if not cfg.num_experts:
        for name in ("swiglu_limit", "moe_bias"):
            if getattr(cfg, name) not in (None, False):
                raise ValueError(f"{name}={getattr(cfg, name)} needs routed experts "
                                 "(num_experts > 0)")

