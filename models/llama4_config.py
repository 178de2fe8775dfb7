"""Llama 4's `ArchConfig` fields: checks and the per-layer facts the decoder reads
(NoPE layers, chunked local attention as negative `layer_windows`)."""

from __future__ import annotations


def chunk_sizes(cfg) -> tuple[int, ...]:
    """Per layer of `cfg` (an `ArchConfig`): its attention chunk (0: none), from the
    negative entries of `layer_windows`."""
    return tuple(max(-w, 0) for w in cfg.layer_windows)


def has_chunked_attention(cfg) -> bool:
    """Whether some layer of `cfg` attends within chunks (Llama 4's `attention_chunk_size`)."""
    return any(w < 0 for w in cfg.layer_windows)


def rotary_layers(cfg) -> tuple[bool, ...]:
    """Per layer: whether its attention rotates q and k (`use_rope` and not a NoPE layer)."""
    return tuple(cfg.use_rope and i not in cfg.nope_layers for i in range(cfg.num_layers))


def check_llama4(cfg) -> None:
    """Checks the Llama 4 fields of an `ArchConfig`.

    Raises:
        ValueError: `nope_layers` entries that are not distinct ascending layers, or a
            temperature tuning whose `floor_scale` or `attn_scale` is not positive.
    """
    nope = cfg.nope_layers
    if list(nope) != sorted(set(nope)) or not all(0 <= i < cfg.num_layers for i in nope):
        raise ValueError(f"nope_layers={list(nope)} must be distinct layers in "
                         f"0..{cfg.num_layers - 1}, ascending")
    if cfg.attn_temperature_tuning:
        for name in ("floor_scale", "attn_scale"):
            if not getattr(cfg, name) > 0:
                raise ValueError(f"{name} must be positive with attn_temperature_tuning, got "
                                 f"{getattr(cfg, name)}")
