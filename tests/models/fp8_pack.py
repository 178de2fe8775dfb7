"""FP8 checkpoints written from the format's published definition, for the FP8 tests.

DeepSeek-V3's (and Qwen3-FP8's) `quant_method: "fp8"`: each linear `weight` is
float8_e4m3fn [out, in] with `weight_scale_inv` f32 [ceil(out / bn), ceil(in / bk)] for
`weight_block_size` [bn, bk] (w = q * scale_inv, the scale the block's max |w| / 448);
without a block size one `weight_scale` per tensor; compressed-tensors' per-channel
`weight_scale` is [out, 1]. Written here independently of `models/` (the oracle's side).
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from tests.models.helpers import set_quantization_config

E4M3_MAX = 448.0


def _block(shape, block) -> tuple[int, int]:
    n, k = shape
    return {"tensor": (n, k), "channel": (1, k)}[block] if isinstance(block, str) else block


def pack_fp8(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """(codes float8_e4m3fn[N, K], scales) of f32[N, K] in `block`: (bn, bk) (scales
    [ceil(N / bn), ceil(K / bk)]), "tensor" (scales [1]) or "channel" ([N, 1])."""
    n, k = w.shape
    bn, bk = _block(w.shape, block)
    nb, kb = -(-n // bn), -(-k // bk)
    padded = np.zeros((nb * bn, kb * bk), np.float32)
    padded[:n, :k] = w
    blocks = padded.reshape(nb, bn, kb, bk)
    amax = np.abs(blocks).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    q = (blocks / scale[:, None, :, None]).reshape(nb * bn, kb * bk)[:n, :k]
    q = np.clip(q, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    if block == "tensor":
        scale = scale.reshape(1)
    return q, scale


def unpack_fp8(q: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    """The inverse: f32[N, K], block by block."""
    n, k = q.shape
    bn, bk = _block(q.shape, block)
    scale = np.asarray(scale, np.float32).reshape(-(-n // bn), -(-k // bk))
    w = q.astype(np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= scale[i, j]
    return w


def is_fp8_linear(name: str) -> bool:
    """The tensors an FP8 checkpoint stores in FP8: every `*_proj.weight` (attention, MLP,
    routed and shared experts; DeepSeek's `kv_a_proj_with_mqa` too); not the router `gate`,
    norms, embedding or LM head."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight"))


def write_fp8_dir(directory: str, hf_model, block, quant_config: dict,
                  scale_suffix: str = "_scale_inv") -> dict[str, np.ndarray]:
    """Saves `hf_model` into `directory` with its linears in FP8 (`block`) and
    `quant_config` as its quantization_config; returns every tensor dequantized (f32)."""
    from safetensors.numpy import save_file
    from safetensors.torch import load_file

    hf_model.save_pretrained(directory, safe_serialization=True)
    tensors, dense = {}, {}
    # The saved names (transformers keeps a MoE's experts fused in memory, one per file).
    for name, p in load_file(os.path.join(directory, "model.safetensors")).items():
        w = p.float().numpy().copy()
        dense[name] = tensors[name] = w
        if is_fp8_linear(name):
            q, s = pack_fp8(w, block)
            tensors[name], tensors[name + scale_suffix] = q, s
            dense[name] = unpack_fp8(q, s, block)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    set_quantization_config(directory, quant_config)
    return dense


def write_dense_dir(directory: str, fp8_dir: str, dense: dict[str, np.ndarray]) -> str:
    """The dequantized model of `fp8_dir` (its `dense` tensors, no quantization_config) in
    `directory`: what transformers loads as the oracle."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(fp8_dir, "config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k != "quantization_config"}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(dense, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return directory
