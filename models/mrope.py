"""Qwen2-VL/Qwen2.5-VL's multimodal rotary (M-RoPE): the (temporal, height, width) positions of
a prompt with images (transformers' `get_rope_index`) and the decoder's cos/sin tables, each
frequency band turned by its section's position row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_MROPE_SECTION = (16, 24, 24)  # transformers' default when the config is silent


def mrope_section_of(text_config: dict) -> tuple[int, ...]:
    """The M-RoPE sections of a Qwen2.5-VL `text_config` (or a flat transformers 4 config):
    `rope_parameters.mrope_section`, else `rope_scaling.mrope_section`, else the default."""
    for key in ("rope_parameters", "rope_scaling"):
        section = (text_config.get(key) or {}).get("mrope_section")
        if section is not None:
            return tuple(int(s) for s in section)
    return DEFAULT_MROPE_SECTION


def mrope_positions(input_ids, image_grid_thw, image_token_id: int,
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """A prompt's M-RoPE positions, as transformers' `Qwen2_5_VLModel.get_rope_index`.

    Text tokens take one position on all three rows, counting on from the previous token's
    group. An image's `t * h * w / merge^2` placeholder tokens take (start + frame,
    start + row, start + column) over its merged grid, `start` being where the text stood; the
    text after it continues from start + max(h, w) / merge (the image's largest position + 1
    for a single frame, which every image is).

    Args:
        input_ids: int[num_tokens]: the prompt with each image's placeholders expanded.
        image_grid_thw: The images' (t, h, w) patch grids, in prompt order.
        image_token_id: The placeholder token (`image_token_id` of config.json).
        spatial_merge_size: The vision config's merge size.

    Returns:
        (positions i32[3, num_tokens], delta): `delta` = max position + 1 - num_tokens, so the
        token at index i >= num_tokens (generated text) takes position i + delta on all rows
        (`mrope_text_positions`).

    Raises:
        ValueError: The placeholders do not match the grids (count or a cut-short image).
    """
    ids = np.asarray(input_ids).reshape(-1)
    is_image = ids == image_token_id  # bool[num_tokens]
    grids = [tuple(int(x) for x in g) for g in image_grid_thw]
    sizes = [t * (h // spatial_merge_size) * (w // spatial_merge_size) for t, h, w in grids]
    if int(is_image.sum()) != sum(sizes):
        raise ValueError(f"the prompt has {int(is_image.sum())} image tokens, its images' "
                         f"grids {grids} take {sum(sizes)}")
    positions = np.zeros((3, ids.size), np.int64)
    pos, i, image = 0, 0, 0
    while i < ids.size:
        if not is_image[i]:
            positions[:, i] = pos
            pos, i = pos + 1, i + 1
            continue
        t, h, w = grids[image]
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if not is_image[i:i + sizes[image]].all():
            raise ValueError(f"image {image} ({grids[image]}) needs {sizes[image]} consecutive "
                             f"image tokens from index {i}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        positions[:, i:i + sizes[image]] = pos + np.stack([tt, hh, ww]).reshape(3, -1)
        pos += max(gh, gw)  # transformers 5's step (its largest position + 1 for one frame)
        i, image = i + sizes[image], image + 1
    delta = int(positions.max(initial=-1)) + 1 - ids.size
    return positions.astype(np.int32), delta


def mrope_text_positions(first: int, num: int, delta: int) -> np.ndarray:
    """i32[3, num]: the positions of tokens first .. first + num - 1 after the prompt
    (`mrope_positions`'s `delta`), the same on all three rows."""
    return np.broadcast_to(np.arange(first, first + num) + delta, (3, num)).astype(np.int32)


def mrope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float,
                  mrope_section: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The decoder's M-RoPE tables (transformers' `Qwen2_5_VLRotaryEmbedding`), in the layout of
    `models.layers.rope_cos_sin` (half-split; `models.layers.apply_rope` turns q and k by them).

    Frequency band j (of rotary_dim / 2) is turned by position row `s % 3`, s being the section
    of `mrope_section` that holds j: (16, 24, 24) gives bands 0-15 the temporal row, 16-39 the
    height row and 40-63 the width row. Text tokens have equal rows, so their tables are plain
    RoPE's.

    Args:
        positions: i32[3, num_tokens]: `mrope_positions`'s rows (traced or not).
        rotary_dim: Rotated channels of a head (the head_dim).
        theta: The rotary base (`rope_theta`).
        mrope_section: Bands per section, summing to rotary_dim / 2 (static).

    Returns:
        (cos, sin): f32[num_tokens, rotary_dim] each.

    Raises:
        ValueError: `mrope_section` does not sum to rotary_dim / 2.
    """
    if rotary_dim % 2 or sum(mrope_section) != rotary_dim // 2:
        raise ValueError(f"mrope_section {tuple(mrope_section)} must sum to half the rotary "
                         f"dimension {rotary_dim}")
    row = np.repeat(np.arange(len(mrope_section)) % 3, mrope_section)  # i64[rotary_dim / 2]
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim)
    pos = jnp.asarray(positions).astype(jnp.float32)[row].T  # f32[num_tokens, rotary_dim / 2]
    freqs = pos * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # f32[num_tokens, rotary_dim]
    return jnp.cos(emb), jnp.sin(emb)
