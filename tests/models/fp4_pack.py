"""compressed-tensors FP4 (MXFP4 and NVFP4) tensors written by the `compressed-tensors`
package's own code (its `generate_gparam` and `calculate_qparams`, the format's compressor)
and the reference weights from its own unpacker and `dequantize`, in float32: the oracle's
side of the FP4 tests (`ct_pack.compress` hands FP4 schemes here)."""

from __future__ import annotations

import numpy as np

MX, NV = "mxfp4-pack-quantized", "nvfp4-pack-quantized"
PRESETS = {"mxfp4": ("MXFP4A16", MX), "nvfp4": ("NVFP4A16", NV), "mxfp4-w4a4": ("MXFP4", MX),
           "nvfp4-w4a4": ("NVFP4", NV)}


def fp4_scheme(name: str):
    """compressed-tensors' preset scheme `PRESETS[name]` targeting every Linear, in its format."""
    from compressed_tensors.quantization import preset_name_to_scheme

    preset, fmt = PRESETS[name]
    sch = preset_name_to_scheme(preset, ["Linear"])
    sch.format = fmt
    return sch


def compress_fp4(w: np.ndarray, sch) -> tuple[dict, np.ndarray]:
    """One Linear's FP4 tensors (bfloat16 weights quantized by compressed-tensors' qparams
    and compressor) and the float32 weight its unpacker and `dequantize` give back."""
    import torch
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.compressors.mx_utils import decompress_mx_scale
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    args = sch.weights
    wb = torch.from_numpy(w).to(torch.bfloat16)
    n, k = wb.shape
    blocks = wb.reshape(n, k // args.group_size, args.group_size)
    state = {"weight": wb}
    gs = None
    if args.strategy == "tensor_group":  # NVFP4: one global scale per tensor
        gs = generate_gparam(wb.amin().float(), wb.amax().float())
        state["weight_global_scale"] = gs
    scale, zero = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gs)
    state.update(weight_scale=scale, weight_zero_point=zero)
    compressor = BaseCompressor.get_value_from_registry(sch.format)
    out = {key: v.contiguous() for key, v in compressor.compress(state, sch).items()}
    values = unpack_fp4_from_uint8(out["weight_packed"], n, k, dtype=torch.float32)
    stored = out["weight_scale"]
    wide = decompress_mx_scale(stored).float() if stored.dtype == torch.uint8 else stored.float()
    back = dequantize(values, wide, args=args, global_scale=gs, dtype=torch.float32)
    return out, back.numpy()
