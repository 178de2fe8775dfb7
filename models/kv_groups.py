"""KV cache groups: which layers share a block table, and where each keeps its KV in the pool.

A hybrid model (Gemma 2/3: sliding-window layers and full-attention layers) keeps each kind
of layer's KV in its own groups of pages, as vLLM's hybrid KV cache does. Every group
holds the same number of layers (`num_slots`), so one page id means the same amount of
memory in every group and all groups draw from one pool:

    kv_pages: dtype[num_slots, 2, num_kv_heads, num_pages, page_size, head_dim]

Layer `l` reads and writes slot `layer_slot[l]` of the pages in its group's block table
(`layer_group[l]`). A page handed to a group holds that group's layers in all its slots.
A sliding group needs only the pages covering each request's last `window` tokens, so the
host-side manager gives the others back while the request runs. With one group (every
layer alike, or the hybrid cache disabled) the layout is the plain one: slot = layer.
A model with linear-attention layers (Qwen3-Next, Qwen3.5: `models.hybrid`) keeps KV only
for its full-attention layers: "layer" here counts those alone (`ArchConfig.attention_windows`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroupLayout:
    """How a model's layers map onto KV cache groups and pool slots.

    Attributes:
        windows: Per group: its sliding window in tokens (0: full attention, every page kept;
            -C: chunked local attention, pages before the current chunk of C go back).
        layer_group: Per model layer: the group whose block table it reads.
        layer_slot: Per model layer: its index on the pool's axis 0.
        num_slots: Layers a page holds (the pool's axis 0).
    """

    windows: tuple[int, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def is_hybrid(self) -> bool:
        """Whether there is more than one group (block tables per group on the device)."""
        return self.num_groups > 1


def single_group(num_layers: int, window: int = 0) -> KVGroupLayout:
    """The plain layout: one group, slot = layer."""
    return KVGroupLayout((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def _slots_per_group(counts: list[int], num_layers: int) -> int:
    """Layers per group: the largest size whose padding (slots no layer uses, since a kind
    with c layers needs ceil(c / g) groups of g) stays within an eighth of the layers."""
    for g in range(min(counts), 0, -1):
        waste = sum(-(-c // g) * g - c for c in counts)
        if waste * 8 <= num_layers:
            return g
    return 1


def kv_group_layout(layer_windows: tuple[int, ...], max_model_len: int | None = None,
                    enabled: bool = True) -> KVGroupLayout:
    """Groups the layers by window.

    A window of `max_model_len` tokens or more never lets a page go, so such layers count
    as full attention. Layers of one kind fill groups of `num_slots` consecutive layers
    (full attention first); a kind whose count does not divide leaves slots unused.

    Args:
        layer_windows: Per-layer sliding window (0: full attention; -C: chunks of C tokens,
            Llama 4's `attention_chunk_size`).
        max_model_len: Longest sequence served (None: no cap on windows).
        enabled: False keeps one group (every page kept; windows only mask).

    Returns:
        The layout.

    Raises:
        ValueError: No layers.
    """
    if not layer_windows:
        raise ValueError("layer_windows is empty: a model needs at least one layer")
    cap = max_model_len or 0
    # NOTE: a chunk of max_model_len or more is full attention too (no query leaves chunk 0).
    windows = [0 if cap and abs(w) >= cap else w for w in layer_windows]
    n = len(windows)
    kinds = sorted(set(windows), key=lambda w: (w != 0, w))  # 0 (full) first
    if len(kinds) == 1:
        return single_group(n, kinds[0])
    if not enabled:
        return single_group(n, 0)
    members = {w: [i for i, x in enumerate(windows) if x == w] for w in kinds}
    g = _slots_per_group([len(m) for m in members.values()], n)
    group_windows: list[int] = []
    layer_group, layer_slot = [0] * n, [0] * n
    for w in kinds:
        layers = members[w]
        for start in range(0, len(layers), g):
            for slot, layer in enumerate(layers[start:start + g]):
                layer_group[layer], layer_slot[layer] = len(group_windows), slot
            group_windows.append(w)
    return KVGroupLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot), g)
