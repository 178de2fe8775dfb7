"""Qwen3-Next's fused Gated DeltaNet projections cut into the decoder's (Qwen3.5's) pieces.

Qwen3-Next stores `linear_attn.in_proj_qkvz` with its rows grouped by key head: for each of
the Hk key heads, its query (dk rows), key (dk), the r = Hv / Hk value heads it serves
(r * dv) and their gates z (r * dv); and `in_proj_ba` likewise: each key head's r betas then
its r decay inputs. The decoder keeps Qwen3.5's split (`in_proj_qkv`: every query head,
then every key head, then every value head, the convolution's channel order; `in_proj_z`,
`in_proj_b`, `in_proj_a`), so both families share one parameter tree.
"""

from __future__ import annotations

import numpy as np

from models.config import ArchConfig

# The decoder's piece -> (Qwen3-Next's fused module, the piece's name in it).
PIECES = {"in_proj_qkv": ("in_proj_qkvz", "qkv"), "in_proj_z": ("in_proj_qkvz", "z"),
          "in_proj_b": ("in_proj_ba", "b"), "in_proj_a": ("in_proj_ba", "a")}


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
    q, k, v, z = parts
    return np.concatenate([q, k, v]) if piece == "qkv" else z
