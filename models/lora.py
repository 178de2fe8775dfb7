"""LoRA's place in the decoder: the modules an adapter may target, their shapes, and the
collection holding the device's adapter slot stacks.

The deltas themselves are a linear method wrapping the target's own
(`models.linear.lora.LoRALinear`), which also describes the stacks' layout.
"""

from __future__ import annotations

from models.config import LAYER_MATMULS, ArchConfig, layer_matmul_shapes

# The decoder modules an adapter may target, as (block, module): every layer matmul.
TARGETS = LAYER_MATMULS
# The Flax collection of the slot stacks: {"layers": {block: {module: {"a", "b"}}}}, each
# leaf led by the layer axis (A [L, in, S, R], B [L, S, R, out]), which the layer scan
# slices like the params.
COLLECTION = "lora"


def served_targets(cfg: ArchConfig) -> tuple[tuple[str, str], ...]:
    """The (block, module) pairs adapters may change in `cfg`'s layers: attention and the
    dense MLP's projections; attention only in a mixture of experts (its experts, router
    and shared expert are not adapted); the MLP only with global heads."""
    if cfg.has_global_heads:  # two attention shapes (`models.gemma4_heads`): the MLP only
        return () if cfg.is_moe or cfg.is_mixed else tuple(t for t in TARGETS if t[0] == "mlp")
    if cfg.is_moe or cfg.is_mixed:
        return tuple(t for t in TARGETS if t[0] == "self_attn")
    return TARGETS


def stack_shapes(cfg: ArchConfig, num_slots: int, rank: int
                 ) -> dict[tuple[str, str], tuple[tuple[int, ...], tuple[int, ...]]]:
    """(block, module) -> the shapes of its A [L, in, S, R] and B [L, S, R, out] stacks."""
    shapes = layer_matmul_shapes(cfg)
    return {t: ((cfg.num_layers, shapes[t][0], num_slots, rank),
                (cfg.num_layers, num_slots, rank, shapes[t][1]))
            for t in served_targets(cfg)}
