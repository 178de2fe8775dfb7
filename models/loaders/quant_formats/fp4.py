"""FP4 E2M1 checkpoints read as they are onto `models.quant`'s ``mxfp4`` and ``nvfp4``:
compressed-tensors' `mxfp4-pack-quantized` and `nvfp4-pack-quantized` schemes
(`compressed_tensors_fp4`, which the compressed-tensors builder calls) and gpt-oss's own
MXFP4 expert stacks (`gpt_oss_expert_leaves`).

compressed-tensors stores a Linear `<module>` (N outputs, K inputs) as `weight_packed`
u8[N, K / 2] (byte j of a row holds value 2j in its low nibble and 2j + 1 in its high one,
each nibble E2M1's sign, exponent and mantissa bits) and `weight_scale` per block of K:
MXFP4 (`group` of 32) u8[N, K / 32] E8M0 exponents (2^(e - 127)); NVFP4 (`tensor_group` of
16) float8_e4m3fn[N, K / 16] beside `weight_global_scale` f32[1], which divides:
w = fp4 * scale / global. The codes and scales are kept as stored (transposed); the global
scale is kept as its reciprocal (a multiplier, one float32 rounding). Activations are
computed in the model's float dtype whatever the scheme's `input_activations` (NVFP4 and
MXFP4 W4A4 are served as W4A16; an `input_global_scale` is not read).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from models.loaders.quant_formats.gptq import read_field
from models.loaders.quant_formats.int_groups import check_shape
from models.quant import FP4_BLOCKS, FP4_SCALES, QuantFormat

# compressed-tensors format -> the kind it is read onto, its weight strategy and scale dtype.
FP4_FORMATS = {"mxfp4-pack-quantized": ("mxfp4", "group", "uint8"),
               "nvfp4-pack-quantized": ("nvfp4", "tensor_group", "float8_e4m3fn")}
SCALE_DTYPES = {"uint8": np.dtype(np.uint8), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}
GPT_OSS_BLOCK_BYTES = 16  # a block of 32 values, two per byte


def _check_args(fmt_name: str, weights: dict, where: str) -> str:
    """The kind of a scheme's FP4 `weights` args; ValueError naming the field that does not
    fit `fmt_name`."""
    kind, strategy, scale_dtype = FP4_FORMATS[fmt_name]
    if weights.get("num_bits") != 4 or weights.get("type") != "float":
        raise ValueError(f"{where}: num_bits {weights.get('num_bits')!r}, type "
                         f"{weights.get('type')!r} is not FP4 (num_bits 4, type 'float') as "
                         f"format {fmt_name!r} stores")
    if weights.get("symmetric", True) is not True:
        raise ValueError(f"{where}.symmetric: FP4 weights must be symmetric")
    if weights.get("strategy") != strategy:
        raise ValueError(f"{where}.strategy {weights.get('strategy')!r} is not supported for "
                         f"{fmt_name} (supported: {strategy})")
    if weights.get("group_size") != FP4_BLOCKS[kind]:
        raise ValueError(f"{where}.group_size {weights.get('group_size')!r} must be "
                         f"{FP4_BLOCKS[kind]} for {fmt_name}")
    stored = weights.get("scale_dtype")
    if stored is not None and str(stored).removeprefix("torch.") != scale_dtype:
        raise ValueError(f"{where}.scale_dtype {stored!r} is not supported for {fmt_name} "
                         f"(supported: torch.{scale_dtype})")
    if weights.get("actorder"):
        raise ValueError(f"{where}.actorder {weights['actorder']!r} is not supported for FP4 "
                         "weights")
    return kind


def compressed_tensors_fp4(fmt_name: str, weights: dict, where: str = "weights"):
    """The ``mxfp4``/``nvfp4`` format and reader of a compressed-tensors FP4 scheme.

    Args:
        fmt_name: "mxfp4-pack-quantized" or "nvfp4-pack-quantized" (`FP4_FORMATS`).
        weights: The scheme's `weights` quantization args (`num_bits`, `type`, `strategy`,
            `group_size`, `symmetric`, `scale_dtype`).
        where: The config path of `weights`, for messages.

    Returns:
        (format, reader `(source, weight name) -> row-form leaves`).

    Raises:
        ValueError: Arguments that are not symmetric 4-bit floats in the format's blocks
            (MXFP4: group 32, u8 scales; NVFP4: tensor_group 16, float8_e4m3fn scales);
            the message names the field. The reader raises one naming the tensor and the
            field for a missing or misshapen `weight_packed`, `weight_scale` or
            `weight_global_scale`.
    """
    kind = _check_args(fmt_name, weights, where)
    fmt = QuantFormat(kind, FP4_BLOCKS[kind])
    scale_leaf, scale_dtype = FP4_SCALES[kind]

    def reader(source, name: str) -> dict[str, np.ndarray]:
        if not name.endswith(".weight"):
            raise KeyError(name)
        base = name[:-len(".weight")]
        codes = read_field(source, base, "weight_packed")
        scales = read_field(source, base, "weight_scale")
        if codes.dtype != np.uint8 or codes.ndim != 2:
            raise ValueError(f"quantized tensor {base!r}: weight_packed must be uint8[N, K / 2] "
                             f"({fmt_name}), got {codes.dtype}{list(codes.shape)}")
        if scales.dtype != SCALE_DTYPES[scale_dtype] or scales.ndim != 2:
            raise ValueError(f"quantized tensor {base!r}: weight_scale must be {scale_dtype}"
                             f"[N, K / {fmt.block}] ({fmt_name}), got "
                             f"{scales.dtype}{list(scales.shape)}")
        n, groups = scales.shape
        check_shape(codes, (n, groups * fmt.block // 2), base,
                    f"weight_packed (for weight_scale's {groups} blocks of {fmt.block})")
        rows = {"qweight": codes, scale_leaf: scales}
        if kind == "nvfp4":
            g = read_field(source, base, "weight_global_scale")
            if g.size != 1 or g.dtype.kind != "f" or not np.isfinite(g).all() or g.item() <= 0:
                raise ValueError(f"quantized tensor {base!r}: weight_global_scale must be one "
                                 f"positive float, got {g.dtype}{list(g.shape)}")
            rows["global_scale"] = (1 / np.asarray(g, np.float32)).reshape(1, 1)
        return rows

    return fmt, reader


def gpt_oss_expert_leaves(blocks: np.ndarray, scales: np.ndarray, name: str) -> dict:
    """The ``mxfp4`` leaves of a gpt-oss expert stack (its `quant_method: "mxfp4"`).

    gpt-oss stores a projection of E experts (N outputs, K inputs) as `<name>_blocks`
    u8[E, N, K / 32, 16] (byte j of a block holds its values 2j, low nibble, and 2j + 1)
    and `<name>_scales` u8[E, N, K / 32] (E8M0 exponents); transformers' MXFP4 dequantizer
    (`transformers.integrations.mxfp4`) turns them into [E, K, N]. The same codes and
    exponents, transposed, are the on-device stack.

    Args:
        blocks: `<name>_blocks`.
        scales: `<name>_scales`.
        name: The projection's tensor name (for messages).

    Returns:
        {"qweight": u8[E, K / 2, N], "e8m0_scales": u8[E, K / 32, N]}.

    Raises:
        ValueError: Arrays that are not uint8, or whose shapes do not fit each other; the
            message names the tensor and the field.
    """
    for field, arr, ndim in (("blocks", blocks, 4), ("scales", scales, 3)):
        if arr.dtype != np.uint8 or arr.ndim != ndim:
            raise ValueError(f"quantized tensor {name!r}: {name}_{field} must be uint8 with "
                             f"{ndim} axes, got {arr.dtype}{list(arr.shape)}")
    e, n, groups = scales.shape
    check_shape(blocks, (e, n, groups, GPT_OSS_BLOCK_BYTES), name,
                f"{name}_blocks (for {name}_scales)")
    codes = blocks.reshape(e, n, groups * GPT_OSS_BLOCK_BYTES)  # u8[E, N, K / 2]
    return {"qweight": np.ascontiguousarray(codes.transpose(0, 2, 1)),
            "e8m0_scales": np.ascontiguousarray(scales.transpose(0, 2, 1))}
