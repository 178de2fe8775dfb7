"""Decodes GGUF's quantized blocks (Q8_0, Q4_0, Q4_1, Q4_K) into jaxserve's row-form leaves.

No value is re-quantized: Q8_0 becomes ``q8`` (block 32) and the 4-bit types become ``q4``
(see `models.quant`). Block layouts follow ggml's format description: Q8_0 = f16 scale +
32 int8; Q4_0 = f16 scale + 16 bytes of nibbles (value - 8); Q4_1 = f16 scale + f16 min +
16 bytes; Q4_K = a 256-value super-block: f16 d, f16 dmin, 12 bytes of 6-bit sub-block
scales and mins, 128 bytes of nibbles (each 32-byte run holds two 32-value sub-blocks,
low nibbles first).
"""

from __future__ import annotations

import numpy as np

from models.quant import QuantFormat, pack_q4_rows

# GGUF type name -> the jaxserve format it is kept in.
GGUF_KEPT = {"Q8_0": QuantFormat("q8", 32), "Q4_0": QuantFormat("q4", 32),
             "Q4_1": QuantFormat("q4", 32), "Q4_K": QuantFormat("q4", 32)}


def _half(raw: np.ndarray, start: int) -> np.ndarray:
    """The f16 stored at byte `start` of every block (raw: u8[..., bytes])."""
    return np.ascontiguousarray(raw[..., start:start + 2]).view(np.float16)[..., 0]


def _decode_q8_0(raw):  # raw: u8[N, nb, 34]
    q = np.ascontiguousarray(raw[..., 2:]).view(np.int8)
    return {"qweight": q.reshape(raw.shape[0], -1), "scales": _half(raw, 0)}


def _decode_q4_0(raw):  # raw: u8[N, nb, 18]
    d = _half(raw, 0)
    qs = np.ascontiguousarray(raw[..., 2:]).reshape(raw.shape[0], -1)
    return {"qweight": qs, "scales": d, "zeros": (d.astype(np.float32) * -8).astype(np.float16)}


def _decode_q4_1(raw):  # raw: u8[N, nb, 20]
    d, m = _half(raw, 0), _half(raw, 2)
    qs = np.ascontiguousarray(raw[..., 4:]).reshape(raw.shape[0], -1)
    return {"qweight": qs, "scales": d, "zeros": m}


def _q4_k_scales(sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """6-bit (scale, min) of the 8 sub-blocks from the 12 bytes that hold them (sc: u8[..., 12])."""
    sc = sc.astype(np.uint8)
    scales, mins = np.empty(sc.shape[:-1] + (8,), np.uint8), np.empty(sc.shape[:-1] + (8,),
                                                                      np.uint8)
    scales[..., :4] = sc[..., 0:4] & 63
    mins[..., :4] = sc[..., 4:8] & 63
    scales[..., 4:] = (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)
    mins[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return scales, mins


def _decode_q4_k(raw):  # raw: u8[N, nsb, 144]
    n, nsb = raw.shape[:2]
    d = _half(raw, 0).astype(np.float32)[..., None]  # f32[N, nsb, 1]
    dmin = _half(raw, 2).astype(np.float32)[..., None]
    sc, mn = _q4_k_scales(raw[..., 4:16])  # u8[N, nsb, 8]
    qs = raw[..., 16:].reshape(n, nsb, 4, 32)
    lo, hi = qs & 15, qs >> 4  # sub-blocks 2c (low nibbles) and 2c + 1 (high)
    values = np.stack([lo, hi], axis=3).reshape(n, nsb * 256)  # u8[N, K]
    scale = (d * sc).astype(np.float16).reshape(n, nsb * 8)
    zero = (-dmin * mn).astype(np.float16).reshape(n, nsb * 8)
    return {"qweight": pack_q4_rows(values), "scales": scale, "zeros": zero}


_DECODERS = {"Q8_0": (34, 32, _decode_q8_0), "Q4_0": (18, 32, _decode_q4_0),
             "Q4_1": (20, 32, _decode_q4_1), "Q4_K": (144, 256, _decode_q4_k)}


def decode_gguf_rows(type_name: str, raw: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """Row-form leaves of a GGUF tensor stored as `type_name`.

    Args:
        type_name: One of `GGUF_KEPT`.
        raw: u8[N, bytes per row] as `gguf.GGUFReader` exposes the tensor's data.
        k: Values per row.

    Raises:
        ValueError: An unsupported type or a row size that does not match the type.
    """
    if type_name not in _DECODERS:
        raise ValueError(f"GGUF type {type_name} cannot stay quantized; kept types: "
                         f"{', '.join(GGUF_KEPT)}")
    nbytes, block, decode = _DECODERS[type_name]
    raw = np.asarray(raw, np.uint8)
    if k % block or raw.shape[-1] != k // block * nbytes:
        raise ValueError(f"{type_name} row of {k} values needs {k // block * nbytes} bytes, "
                         f"got {raw.shape[-1]}")
    return decode(raw.reshape(raw.shape[0], k // block, nbytes))
