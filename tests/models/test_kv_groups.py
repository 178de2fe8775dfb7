"""KV cache group layouts: layers grouped by window, equal slots per group, the edge cases."""

from __future__ import annotations

import pytest

from models.kv_groups import kv_group_layout, single_group


def _check(layout, windows):
    """Every layer in one (group, slot), groups hold one window each, no slot used twice."""
    seen = set()
    for layer, (g, slot) in enumerate(zip(layout.layer_group, layout.layer_slot, strict=True)):
        assert 0 <= slot < layout.num_slots and (g, slot) not in seen
        seen.add((g, slot))
        assert layout.windows[g] == windows[layer]


def test_gemma3_pattern_groups_five_sliding_per_global():
    windows = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(12))  # 10 local, 2 global
    layout = kv_group_layout(windows, max_model_len=8192)
    assert (layout.num_slots, layout.windows) == (2, (0, 512, 512, 512, 512, 512))
    _check(layout, windows)


def test_uneven_counts_pad_a_few_slots():
    windows = tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(26))  # Gemma 3 1B: 4 + 22
    layout = kv_group_layout(windows, max_model_len=32768)
    assert layout.num_slots == 4 and layout.num_groups == 7  # 28 slots for 26 layers
    _check(layout, windows)


def test_gemma2_alternation_is_two_groups():
    windows = (4096, 0) * 13
    layout = kv_group_layout(windows, max_model_len=8192)
    assert (layout.num_slots, layout.windows) == (13, (0, 4096))
    _check(layout, windows)


def test_one_kind_of_layer_is_the_plain_layout():
    assert kv_group_layout((0,) * 4) == single_group(4)
    mistral = kv_group_layout((4096,) * 4, max_model_len=32768)  # every layer sliding
    assert mistral == single_group(4, 4096) and not mistral.is_hybrid


def test_a_window_past_max_model_len_is_full_attention():
    # No page could ever leave such a window: one group, nothing given back.
    assert kv_group_layout((4096, 0, 4096), max_model_len=2048) == single_group(3)
    assert kv_group_layout((4096, 0), max_model_len=4096) == single_group(2)
    assert kv_group_layout((4095, 0), max_model_len=4096).is_hybrid


def test_disabled_keeps_one_table_and_masks_only():
    layout = kv_group_layout((16, 0, 16), max_model_len=64, enabled=False)
    assert layout == single_group(3) and layout.windows == (0,)


def test_chunked_layers_are_a_group_of_their_own():
    """Llama 4's chunked layers (window -C) form their own groups beside the full ones; a
    chunk of max_model_len or more is full attention."""
    layout = kv_group_layout((-8, 0, -8, 0), max_model_len=64)
    assert layout.windows == (0, -8) and layout.layer_group == (1, 0, 1, 0)
    assert not kv_group_layout((-64, 0), max_model_len=64).is_hybrid


@pytest.mark.parametrize("windows,message", [
    ((), "layer_windows is empty"),
])
def test_bad_windows_are_an_error(windows, message):
    with pytest.raises(ValueError, match=message):
        kv_group_layout(windows)
