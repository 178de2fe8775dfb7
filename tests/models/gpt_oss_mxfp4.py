"""Writes a tiny gpt-oss checkpoint as OpenAI's MXFP4 releases store it: each layer's expert
stacks `gate_up_proj` and `down_proj` as `*_blocks` u8[E, N, K / 32, 16] and `*_scales` u8
E8M0 [E, N, K / 32], quantized here independently of the engine's own quantizer (an E8M0
power of two per 32 inputs, the nearest E2M1 value, the low nibble first: transformers'
`integrations/mxfp4.py` unpacks `blk & 0x0F` to the even value and `blk >> 4` to the odd)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# The checkpoints' `quantization_config` (the published gpt-oss-20b's).
MXFP4_CONFIG = {"quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}


def mxfp4_blocks(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks u8[..., N, K / 32, 16], scales u8[..., N, K / 32]) of f32[..., N, K] rows."""
    *lead, n, k = rows.shape
    groups = rows.reshape(*lead, n, k // 32, 32)
    amax = np.abs(groups).max(-1, keepdims=True)
    # The smallest power of two that keeps the group's largest value within E2M1's 6.
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).clip(-127, 127)
    scaled = groups / np.exp2(exp)
    mag = np.abs(np.abs(scaled)[..., None] - E2M1).argmin(-1)  # nearest magnitude code
    codes = (mag | np.where(scaled < 0, 8, 0)).astype(np.uint8)  # sign in bit 3
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # u8[..., N, K / 32, 16]
    return blocks.astype(np.uint8), (exp[..., 0] + 127).astype(np.uint8)


def write_mxfp4(src: str, dst: str) -> str:
    """A copy of the float gpt-oss checkpoint `src` at `dst` with its experts in MXFP4."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        stack = tensors.pop(name)  # f32[E, K, N] ([in, out])
        blocks, scales = mxfp4_blocks(np.swapaxes(stack, 1, 2))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = MXFP4_CONFIG
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dst


def dequantized_hf(directory: str):
    """transformers' gpt-oss on the MXFP4 checkpoint, its experts dequantized (float32,
    eager attention): the oracle."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=transformers.Mxfp4Config(dequantize=True),
        attn_implementation="eager", dtype=torch.float32).eval()
