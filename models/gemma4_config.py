"""Gemma 4's `ArchConfig` fields checked, and which layer's KV each layer reads (KV sharing).

Gemma 4 (`Gemma4TextConfig.kv_sharing_modes`): the last `kv_shared_layers` layers compute no
K/V of their own; each reads the K/V of the last earlier non-shared layer of its kind
(sliding or full attention: its window). They keep no pool slot: `ArchConfig.attention_layers`
leaves them out, so a page holds the other layers only, and the decoder hands each shared
layer its source's slot and group (`kv_sources`) and writes nothing for it.
"""

from __future__ import annotations


def kv_sources(cfg) -> tuple[int, ...]:
    """Per model layer: the layer whose KV it reads (itself unless KV-shared).

    Args:
        cfg: An `ArchConfig`.

    Returns:
        The source layer of each layer: a shared layer's is the last non-shared layer with
        its window (its kind).

    Raises:
        ValueError: A shared layer whose kind no earlier non-shared layer has (named by
            `num_kv_shared_layers`).
    """
    first = cfg.num_layers - cfg.kv_shared_layers
    sources = list(range(cfg.num_layers))
    for i in range(first, cfg.num_layers):
        own = [j for j in range(first) if cfg.layer_windows[j] == cfg.layer_windows[i]]
        if not own:
            kind = "sliding" if cfg.layer_windows[i] else "full"
            raise ValueError(f"num_kv_shared_layers={cfg.kv_shared_layers}: shared layer {i} "
                             f"({kind} attention) has no earlier non-shared {kind} layer to "
                             "read its KV from")
        sources[i] = own[-1]
    return tuple(sources)


def kv_slot_index(cfg) -> tuple[int, ...]:
    """Per model layer: the index of its KV source among `cfg.attention_layers` (the layers
    a `models.kv_groups.KVGroupLayout` maps), so slot and group are the source's."""
    rank = {layer: k for k, layer in enumerate(cfg.attention_layers)}
    return tuple(rank[s] for s in kv_sources(cfg))


def check_gemma4(cfg) -> None:
    """Checks Gemma 4's fields of an `ArchConfig` (no-ops for other families).

    Raises:
        ValueError: A negative per-layer input size or one without a table,
            `kv_shared_layers` outside [0, num_layers) or a shared layer without a source,
            KV sharing with linear-attention layers, a double-wide MLP of an odd width, or
            global heads that cannot be served (`_check_global_heads`); each names the field.
    """
    if cfg.per_layer_input_size < 0 or cfg.per_layer_vocab_size < 0:
        raise ValueError(f"hidden_size_per_layer_input ({cfg.per_layer_input_size}) and "
                         f"vocab_size_per_layer_input ({cfg.per_layer_vocab_size}) must be >= 0")
    if cfg.per_layer_input_size and not cfg.per_layer_vocab_size:
        raise ValueError(f"hidden_size_per_layer_input={cfg.per_layer_input_size} needs a "
                         f"positive vocab_size_per_layer_input (got {cfg.per_layer_vocab_size})")
    if not 0 <= cfg.kv_shared_layers < cfg.num_layers:
        raise ValueError(f"num_kv_shared_layers={cfg.kv_shared_layers} must be in "
                         f"[0, {cfg.num_layers}): some layer has to compute the KV")
    if cfg.kv_shared_layers:
        if cfg.linear_layers:
            raise ValueError("num_kv_shared_layers with linear_attention layers is not served")
        kv_sources(cfg)
    if cfg.has_global_heads:
        _check_global_heads(cfg)
    if cfg.double_wide_mlp and cfg.intermediate_size % 2:
        raise ValueError(f"use_double_wide_mlp: the doubled intermediate_size must be even, "
                         f"got {cfg.intermediate_size}")


def _check_global_heads(cfg) -> None:
    """Full-attention layers of their own head shape (`models.gemma4_heads`) need
    KV heads dividing the query heads, an explicit attention scale (each kind's default
    would differ), and layers of both kinds; linear-attention, MLA and gated-output layers
    are not combined with them."""
    if cfg.global_head_dim < 0 or cfg.global_kv_heads < 0:
        raise ValueError(f"global_head_dim ({cfg.global_head_dim}) and num_global_key_value_heads"
                         f" ({cfg.global_kv_heads}) must be >= 0")
    if cfg.global_kv_heads and cfg.num_heads % cfg.global_kv_heads:
        raise ValueError(f"num_attention_heads ({cfg.num_heads}) must be a multiple of "
                         f"num_global_key_value_heads ({cfg.global_kv_heads})")
    if cfg.attention_multiplier is None:
        raise ValueError("global_head_dim needs an explicit attention scale "
                         "(attention_multiplier): the two head widths' defaults differ")
    kinds = {w == 0 for w in cfg.layer_windows}
    if kinds != {True, False}:
        raise ValueError(f"global_head_dim={cfg.global_head_dim}: layer_windows has "
                         "no sliding layer or no full-attention layer; give the one head shape "
                         "as head_dim and num_kv_heads")
    if cfg.linear_layers or cfg.is_mla or cfg.attn_output_gate or cfg.attention_sinks:
        raise ValueError("global_head_dim is served with plain softmax attention only (no "
                         "linear_attention layers, MLA, output gate or sinks)")
