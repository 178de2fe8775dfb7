"""FP8 checkpoints read as they are: `quant_method: "fp8"` (DeepSeek-V3, Qwen3-FP8: block
scales `weight_scale_inv`; or one `weight_scale` per tensor) and, for the compressed-tensors
builder, its `float-quantized` schemes (`compressed_tensors_fp8`: per tensor, channel or
block `weight_scale`).

Each layer matmul (and each routed expert) is `weight` float8_e4m3fn[N, K] and its f32
scales over [ceil(N / bn), ceil(K / bk)] blocks (w = q * scale), kept on the device as
`models.quant`'s ``fp8`` leaves; so are DeepSeek's MLA projections (`MLA_MATMULS`), edge
blocks included (kv_a_proj_with_mqa's 576 outputs are four blocks of 128 and one of 64).
The embedding, the LM head, the norms and the MoE router (`gate`) stay float, as the format
leaves them. A weight the model reads as float but the checkpoint stores in FP8 (DeepSeek's
`kv_b_proj`, whose kernel MLA splits per head: ~1B of DeepSeek-V3's 671B values, 2 GB in
bfloat16) is dequantized at load (`dequantize_fp8_rows`), then cast to the model's dtype.
Activations are computed in the model's float dtype under either `activation_scheme` (a
static checkpoint's `input_scale` is not read): the served model is the dequantized one.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

from models.config import LAYER_MATMULS
from models.deepseek_config import MLA_MATMULS
from models.loaders.checkpoint_quant import CheckpointFormat, register
from models.quant import EXPERT_MODULES, QuantFormat, QuantPlan

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FMTS = ("e4m3",)
ACTIVATION_SCHEMES = ("dynamic", "static")
LAYER_MODULES = tuple(dict.fromkeys(name for _, name in LAYER_MATMULS))
# What a per-layer `modules_to_not_convert` entry may name and still leave every planned
# module of the layer quantized (the plan is one format per module name, for all layers).
_FLOAT_ANYWAY = re.compile(r"(^|\.)(gate|shared_expert_gate|\w*norm\w*|embed_tokens|lm_head)$")


def read_fp8(source, name: str, fmt: QuantFormat, scale_suffix: str) -> dict[str, np.ndarray]:
    """The row-form ``fp8`` leaves of weight `name`: its codes [N, K] and the scales
    `name + scale_suffix` as f32 [ceil(N / bn), ceil(K / bk)] (a per-tensor scalar or a
    per-channel [N] read as that shape).

    Raises:
        KeyError: The weight is absent (the caller reports it).
        ValueError: Codes that are not float8_e4m3fn, a missing scale, or a scale of the
            wrong shape or dtype; the message names the tensor and the field.
    """
    q = source.get(name)
    where = source.where(name)
    if q.dtype != FP8_DTYPE or q.ndim != 2:
        raise ValueError(f"tensor {name!r} in {where}: {q.dtype}{list(q.shape)}, expected "
                         "a float8_e4m3fn [out, in] matrix (quantization_config.fmt 'e4m3')")
    n, k = q.shape
    bk, bn = fmt.blocks_for(k, n)
    want = (-(-n // bn), -(-k // bk))
    scale_name = name + scale_suffix
    try:
        s = source.get(scale_name)
    except KeyError:
        raise ValueError(f"tensor {scale_name!r} is missing from {source.where(scale_name)}: "
                         f"the FP8 weight {name!r} needs its {scale_suffix.lstrip('_')!r}"
                         ) from None
    # A per-tensor scalar or [1], or a per-channel [N], stands for its [Nb, Kb] grid.
    fits = (tuple(s.shape) == want if s.ndim == 2
            else s.size == want[0] * want[1] and 1 in want)
    # bfloat16 (llm-compressor's scales for a bfloat16 model) is ml_dtypes' kind "V".
    if not fits or (s.dtype.kind != "f" and s.dtype.name != "bfloat16") or s.dtype.itemsize < 2:
        raise ValueError(
            f"tensor {scale_name!r} in {source.where(scale_name)}: {s.dtype}{list(s.shape)}, "
            f"expected float scales {list(want)} for the weight {list(q.shape)} in blocks of "
            f"{bn}x{bk} (quantization_config.weight_block_size)")
    return {"qweight": q, "block_scales": np.asarray(s, np.float32).reshape(want)}


def dequantize_fp8_rows(leaves: dict[str, np.ndarray], fmt: QuantFormat) -> np.ndarray:
    """f32[N, K] of `read_fp8`'s row-form leaves (codes [N, K], scales [Nb, Kb]): each
    code times its block's scale, the last block along each axis cut short."""
    q, scales = leaves["qweight"], leaves["block_scales"]
    n, k = q.shape
    bk, bn = fmt.blocks_for(k, n)
    per_value = np.repeat(np.repeat(scales, bn, axis=0)[:n], bk, axis=1)[:, :k]  # f32[N, K]
    return q.astype(np.float32) * per_value


def _block_format(block, field: str) -> QuantFormat:
    """``fp8`` in blocks `block` = [bn, bk] (out, in), as the config's `field` gives it."""
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 and b & (b - 1) == 0 for b in block)):
        raise ValueError(f"quantization_config.{field} {block!r} must be two positive powers "
                         "of two [out, in] (the block of values one scale covers)")
    return QuantFormat("fp8", block[1], block_n=block[0])


def _modules(qc: dict, cfg, path: str) -> tuple[str, ...]:
    """The modules kept in FP8: every layer matmul (and routed expert stack) except those
    `modules_to_not_convert` (or MiniMax's `ignored_layers`) names for every layer."""
    planned = (*LAYER_MODULES, *(EXPERT_MODULES if cfg is not None and cfg.is_moe else ()),
               *(MLA_MATMULS if cfg is not None and cfg.is_mla else ()))
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise ValueError(f"{path}: quantization_config.modules_to_not_convert {skip!r} must "
                         "be a list of module names")
    dropped = set()
    for entry in skip:
        if _FLOAT_ANYWAY.search(entry):
            continue  # float in every FP8 checkpoint already
        if re.search(r"(^|\.)layers\.\d+(\.|$)", entry):
            raise ValueError(f"{path}: quantization_config.modules_to_not_convert names "
                             f"{entry!r}: one layer's matmul left float while the others "
                             "are FP8 is not supported")
        dropped |= {m for m in planned if m.rsplit(".", 1)[-1] == entry.rsplit(".", 1)[-1]}
    return tuple(m for m in planned if m not in dropped)


@register("fp8")
def fp8_format(qc: dict, path: str, cfg) -> CheckpointFormat:
    """The `quant_method: "fp8"` format of a checkpoint (transformers'
    `FineGrainedFP8Config` and vLLM's `Fp8Config` fields).

    Raises:
        ValueError: An unknown `fmt` or `activation_scheme`, a `weight_block_size` that
            is not two powers of two, a `scale_fmt` other than float, or a
            `modules_to_not_convert` naming one layer's matmul; the message names the field.
    """
    fmt_name = qc.get("fmt", "e4m3")
    if fmt_name not in FMTS:
        raise ValueError(f"{path}: quantization_config.fmt {fmt_name!r} is not supported "
                         f"(supported: {', '.join(FMTS)})")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ACTIVATION_SCHEMES:
        raise ValueError(f"{path}: quantization_config.activation_scheme {scheme!r} is not "
                         f"supported (supported: {', '.join(ACTIVATION_SCHEMES)})")
    if qc.get("scale_fmt", "float") not in ("float", "ue8m0"):
        # ue8m0 (DeepSeek-V3.1) stores f32 scales that are powers of two: read as floats.
        raise ValueError(f"{path}: quantization_config.scale_fmt {qc['scale_fmt']!r} is not "
                         "supported (supported: float, ue8m0)")
    block = qc.get("weight_block_size")
    if block is None:  # one scale per tensor
        fmt, suffix = QuantFormat("fp8", 0, block_n=0), "_scale"
    else:
        fmt, suffix = _block_format(block, "weight_block_size"), "_scale_inv"
    modules = _modules(qc, cfg, path)

    def reader(source, name):
        if not name.endswith(".weight"):
            raise KeyError(name)
        return read_fp8(source, name, fmt, suffix)

    def dense_reader(source, name):
        arr = source.get(name)
        if arr.dtype != FP8_DTYPE:
            return arr
        return dequantize_fp8_rows(read_fp8(source, name, fmt, suffix), fmt)

    return CheckpointFormat("fp8", QuantPlan(tuple((m, fmt) for m in modules), "fp8"), reader,
                            dense_reader)


def compressed_tensors_fp8(weights: dict, where: str = "weights") -> tuple[QuantFormat,
                                                                            object]:
    """The ``fp8`` format and reader of a compressed-tensors `float-quantized` scheme's
    weight arguments (FP8 W8A8 or W8A16: `weight` float8_e4m3fn, `weight_scale` per tensor
    [1], per channel [N, 1] or per block [ceil(N / bn), ceil(K / bk)]), for the
    compressed-tensors builder to plan its FP8 groups with.

    Args:
        weights: The scheme's `weights` quantization args (`num_bits`, `type`,
            `strategy`, `block_structure`, `symmetric`).
        where: The config path of `weights`, for messages.

    Returns:
        (format, reader `(source, weight name) -> row-form leaves`).

    Raises:
        ValueError: Arguments that are not symmetric 8-bit floats, or an unsupported
            strategy; the message names the field.
    """
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise ValueError(f"{where}: num_bits {weights.get('num_bits')!r}, type "
                         f"{weights.get('type')!r} is not FP8 (num_bits 8, type 'float')")
    if weights.get("symmetric", True) is not True:
        raise ValueError(f"{where}.symmetric: FP8 weights must be symmetric")
    strategy = weights.get("strategy")
    if strategy == "tensor":
        fmt = QuantFormat("fp8", 0, block_n=0)
    elif strategy == "channel":
        fmt = QuantFormat("fp8", 0, block_n=1)
    elif strategy == "block":
        fmt = _block_format(weights.get("block_structure"), f"{where}.block_structure")
    else:
        raise ValueError(f"{where}.strategy {strategy!r} is not supported for FP8 weights "
                         "(supported: tensor, channel, block)")

    def reader(source, name):
        if not name.endswith(".weight"):
            raise KeyError(name)
        return read_fp8(source, name, fmt, "_scale")

    return fmt, reader
