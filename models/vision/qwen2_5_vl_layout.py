"""Qwen2.5-VL's vision token layout, computed on the host from the static `grid_thw`: the window
order of the merged patches and its inverse, the 2-D rotary positions, and the attention
segments (windows, or whole frames) as padded gather tables for `segment_attention`."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class Segments:
    """Contiguous attention segments over a sequence, padded to the longest one.

    Attributes:
        gather: i32[num_segments, max_len]: the token each padded slot reads (a segment's last
            token repeated past its end, so padding reads real data that `valid` masks).
        valid: bool[num_segments, max_len]: the slots that hold a segment's token.
        scatter: i32[num_tokens]: each token's slot in the flattened [num_segments * max_len].
    """

    gather: np.ndarray
    valid: np.ndarray
    scatter: np.ndarray


def segments_of(lengths: list[int]) -> Segments:
    """The padded tables of consecutive segments of `lengths` tokens (each > 0)."""
    lens = np.asarray(lengths, np.int64)  # i64[num_segments]
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    slot = np.arange(int(lens.max()))  # i64[max_len]
    valid = slot[None, :] < lens[:, None]  # bool[num_segments, max_len]
    gather = starts[:, None] + np.minimum(slot[None, :], lens[:, None] - 1)
    scatter = np.flatnonzero(valid)  # in token order: segments are consecutive
    return Segments(gather.astype(np.int32), valid, scatter.astype(np.int32))


@dataclasses.dataclass(frozen=True, eq=False)
class VisionLayout:
    """Where each vision token of one `encode_images` call goes (transformers'
    `get_vision_window_index`, `get_vision_position_ids` and `get_vision_cu_seqlens`).

    Tokens arrive in the processor's order (per image, merge window by merge window); the
    encoder runs them in window order and the merger's outputs go back to the processor's order.

    Attributes:
        window_index: i32[num_units]: the merged unit (merge_size^2 consecutive patches) each
            window-order unit takes, over all images (each image's units offset by those before).
        reverse_index: i32[num_units]: its inverse (argsort), for the merger's outputs.
        positions: i32[num_patches, 2]: each window-order patch's (row, column) in its image.
        windows: `Segments` of the window blocks, in window order.
        frames: `Segments` of the full-attention blocks: one per image frame (t * h * w / t).
    """

    window_index: np.ndarray
    reverse_index: np.ndarray
    positions: np.ndarray
    windows: Segments
    frames: Segments


def _patch_positions(t: int, h: int, w: int, merge: int) -> np.ndarray:
    """i64[t * h * w, 2]: (row, column) of each patch in the processor's order (merge window
    by merge window, each window row-major), repeated per frame."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")  # [h, w] each
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(np.stack([rows, cols], axis=-1), (t, 1))


def _window_order(t: int, h: int, w: int, side: int) -> tuple[np.ndarray, list[int]]:
    """One image's merged units in window order, and each window's unit count.

    Windows are `side` x `side` merged units, row-major over the image, frame by frame; the
    last row and column of windows are cut short by the image's edge (transformers pads them
    and drops the padding, the same thing)."""
    units = np.arange(t * h * w).reshape(t, h, w)
    order, counts = [], []
    for frame in units:
        for r in range(0, h, side):
            for c in range(0, w, side):
                block = frame[r:r + side, c:c + side].reshape(-1)
                order.append(block)
                counts.append(block.size)
    return np.concatenate(order), counts


@functools.lru_cache(maxsize=64)
def vision_layout(grid_thw: tuple[tuple[int, int, int], ...], merge: int,
                  window_units: int) -> VisionLayout:
    """The layout of the images `grid_thw` ((t, h, w) patches each) for merge size `merge`
    and windows of `window_units` merged units a side. Cached: the engine buckets by size."""
    unit = merge * merge
    index, windows, frames, positions = [], [], [], []
    offset = 0
    for t, h, w in grid_thw:
        order, counts = _window_order(t, h // merge, w // merge, window_units)
        index.append(order + offset)
        windows += [c * unit for c in counts]
        frames += [h * w] * t
        pos = _patch_positions(t, h, w, merge).reshape(-1, unit, 2)  # [units, unit, 2]
        positions.append(pos[order].reshape(-1, 2))
        offset += t * (h // merge) * (w // merge)
    window_index = np.concatenate(index)
    return VisionLayout(window_index.astype(np.int32),
                        np.argsort(window_index).astype(np.int32),
                        np.concatenate(positions).astype(np.int32),
                        segments_of(windows), segments_of(frames))
