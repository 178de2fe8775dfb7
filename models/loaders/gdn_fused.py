"""Gated DeltaNet checkpoint tensors in the decoder's layout: q, k, v channels grouped by key
head, and Qwen3-Next's fused projections cut into Qwen3.5's pieces.

Qwen3-Next stores `linear_attn.in_proj_qkvz` with its rows grouped by key head: for each of
the Hk key heads, its query (dk rows), key (dk), the r = Hv / Hk value heads it serves
(r * dv) and their gates z (r * dv); and `in_proj_ba` likewise: each key head's r betas then
its r decay inputs. Qwen3.5 stores `in_proj_qkv` flat (every query head, then every key
head, then every value head), and both store the convolution's channels flat too. The
decoder keeps Qwen3.5's pieces (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) with
`in_proj_qkv`'s and the convolution's channels grouped by key head, [q_g, k_g, v_g] for each
key head g (`grouped_channels`): a key head and its value heads are then one contiguous run
of channels, which tensor parallelism splits by heads. (The convolution is depthwise, so
moving channels together with its weights changes nothing else.)
"""

from __future__ import annotations

import numpy as np

from models.config import ArchConfig

# The decoder's piece -> (Qwen3-Next's fused module, the piece's name in it).
PIECES = {"in_proj_qkv": ("in_proj_qkvz", "qkv"), "in_proj_z": ("in_proj_qkvz", "z"),
          "in_proj_b": ("in_proj_ba", "b"), "in_proj_a": ("in_proj_ba", "a")}


def grouped_channels(cfg: ArchConfig) -> np.ndarray:
    """i32[C]: for each channel of the grouped layout, its index in the flat one."""
    hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    per_v = cfg.linear_num_value_heads // hk * cfg.linear_value_head_dim
    kd = hk * dk
    return np.concatenate([np.concatenate([np.arange(g * dk, (g + 1) * dk),
                                           kd + np.arange(g * dk, (g + 1) * dk),
                                           2 * kd + np.arange(g * per_v, (g + 1) * per_v)])
                           for g in range(hk)])


def flat_to_grouped(cfg: ArchConfig, name: str, arr: np.ndarray) -> np.ndarray:
    """A checkpoint's flat q/k/v channels (`linear_attn.in_proj_qkv` rows, `conv1d` channels)
    in the decoder's grouped order; other tensors as they are."""
    if not name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):
        return arr
    return arr[grouped_channels(cfg)]


def fused_name(name: str) -> tuple[str, str] | None:
    """(fused tensor name, piece) a piece's tensor `name` is cut from, or None."""
    stem, _, leaf = name.rpartition(".")
    module, _, own = stem.rpartition(".")
    if not module.endswith("linear_attn") or own not in PIECES:
        return None
    fused, piece = PIECES[own]
    return f"{module}.{fused}.{leaf}", piece


def cut_piece(cfg: ArchConfig, fused_name: str, arr: np.ndarray, piece: str) -> np.ndarray:
    """Rows of `piece` ("qkv", "z", "b" or "a") of the fused tensor `arr` [rows, hidden].

    Raises:
        ValueError: The fused tensor's row count is not what the config's heads give.
    """
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, hv // hk
    per_head = (dk, dk, r * dv, r * dv) if fused_name.endswith("qkvz.weight") else (r, r)
    if arr.shape[0] != hk * sum(per_head):
        raise ValueError(f"tensor {fused_name!r} has {arr.shape[0]} rows, expected "
                         f"{hk} key heads x {sum(per_head)} = {hk * sum(per_head)} for "
                         f"{cfg.architecture}")
    grouped = arr.reshape(hk, sum(per_head), *arr.shape[1:])  # [Hk, per head, hidden]
    bounds = np.cumsum((0, *per_head))
    parts = [grouped[:, bounds[i]:bounds[i + 1]].reshape(-1, *arr.shape[1:])
             for i in range(len(per_head))]  # each [Hk * width, hidden], head-major
    if len(parts) == 2:
        return parts[0] if piece == "b" else parts[1]
    if piece == "z":
        return parts[3]
    # Already grouped by key head (the decoder's order): each head's q, k and v rows.
    return grouped[:, :bounds[3]].reshape(-1, *arr.shape[1:])
