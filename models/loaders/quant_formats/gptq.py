"""GPTQ checkpoints (`quant_method: "gptq"`, or an older file's `quantize_config.json`),
read as they are onto `q4` (4 bits) or `q8` (8 bits, symmetric) (`int_groups`).

Each quantized Linear `<module>` stores (K input features, N outputs, G groups):

* `<module>.qweight` int32[K * bits / 32, N]: codes stored along K, value j of a word in
  bits [bits * j, bits * (j + 1)).
* `<module>.qzeros` int32[G, N * bits / 32]: zero points stored the same way along N. The
  original format (`checkpoint_format` "gptq", AutoGPTQ's v1) stores z - 1; "gptq_v2"
  (GPTQModel) stores z.
* `<module>.scales` f16[G, N]; `<module>.g_idx` i32[K] (optional): each input's group.

w[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]. With act-order (`desc_act`)
the groups are not contiguous runs of K: K is sorted by g_idx at load and the permutation
kept beside the codes (`act_order`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.config import ArchConfig
from models.loaders.checkpoint_quant import CheckpointFormat, register
from models.loaders.quant_formats.act_order import act_order_modules, group_rows
from models.loaders.quant_formats.int_groups import check_shape, group_format, unpack_int32
from models.quant import EXPERT_MODULES, QuantPlan

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHECKPOINT_FORMATS = {"gptq": 1, "gptq_v2": 0}  # format -> offset added to stored zeros


def linear_modules(cfg: ArchConfig) -> tuple[str, ...]:
    """The plan's modules a GPTQ/AWQ checkpoint quantizes: every decoder Linear (and the
    routed experts' stacks of a mixture of experts); embeddings, LM head and router stay
    float."""
    return LINEARS + (EXPERT_MODULES if cfg.is_moe else ())


def read_field(source, base: str, field: str) -> np.ndarray:
    """`<base>.<field>` from the checkpoint; ValueError naming both when it is missing."""
    try:
        return np.asarray(source.get(f"{base}.{field}"))
    except KeyError:
        raise ValueError(f"quantized tensor {base!r}: {field} is missing from "
                         f"{source.where(f'{base}.{field}')}") from None


def read_int_leaves(source, base: str, layout: str) -> tuple[np.ndarray, ...]:
    """(qweight, scales, qzeros) of the GPTQ/AWQ Linear `base`; `layout` describes the
    qweight it must be (for the message).

    Raises:
        ValueError: A leaf is missing, or qweight is not a 2-D int32 array.
    """
    qweight, scales, qzeros = (read_field(source, base, f)
                               for f in ("qweight", "scales", "qzeros"))
    if qweight.dtype != np.int32 or qweight.ndim != 2:
        raise ValueError(f"quantized tensor {base!r}: qweight must be int32{layout}, "
                         f"got {qweight.dtype}{list(qweight.shape)}")
    return qweight, scales, qzeros


@register("gptq")
def gptq_format(qc: dict, path: str, cfg: ArchConfig) -> CheckpointFormat:
    """The GPTQ format of `qc` (bits, group_size, sym, desc_act, checkpoint_format).

    Raises:
        ValueError: An unsupported bits/group_size/sym combination, a quantized LM head,
            or an unknown checkpoint_format (the message names the field).
    """
    where = f"{path}: quantization_config"
    bits, group = int(qc.get("bits", 4)), int(qc.get("group_size", 128))
    symmetric = bool(qc.get("sym", True))
    fmt = group_format(bits, group, symmetric, where)
    ckpt_format = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if ckpt_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"{where}.checkpoint_format {ckpt_format!r} is not supported "
                         f"(supported: {', '.join(CHECKPOINT_FORMATS)})")
    if qc.get("lm_head"):
        raise ValueError(f"{where}.lm_head=true (a quantized LM head) is not supported")
    offset = CHECKPOINT_FORMATS[ckpt_format]
    modules = linear_modules(cfg)
    # desc_act: the modules whose g_idx is out of order somewhere keep a permutation.
    permuted = (act_order_modules(path, cfg, modules, "g_idx")
                if qc.get("desc_act") and fmt.block else set())
    formats = {m: dataclasses.replace(fmt, act_order=m in permuted) for m in modules}

    def reader(source, name: str) -> dict[str, np.ndarray]:
        base = name.removesuffix(".weight")
        parts = base.split(".")
        fmt = formats[("experts." if "experts" in parts else "") + parts[-1]]
        qweight, scales, qzeros = read_int_leaves(source, base, f"[K * {bits} / 32, N]")
        k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
        groups = 1 if fmt.block == 0 else k // group
        if fmt.block and k % group:
            raise ValueError(f"quantized tensor {base!r}: group_size {group} does not divide "
                             f"its {k} input features")
        check_shape(scales, (groups, n), base, "scales")
        check_shape(qzeros, (groups, n * bits // 32), base, "qzeros")
        try:
            g_idx = np.asarray(source.get(f"{base}.g_idx"))
        except KeyError:
            g_idx = None
        codes = unpack_int32(qweight, bits, axis=0).T  # u8[N, K]
        zero_points = unpack_int32(qzeros, bits, axis=1).T.astype(np.int32) + offset  # [N, G]
        if fmt.kind == "q8" and np.any(zero_points != 128):
            raise ValueError(f"quantized tensor {base!r}: qzeros hold zero points other than "
                             f"128 (asymmetric 8-bit), which are not supported")
        return group_rows(fmt, codes, scales.T, zero_points, g_idx, base, "g_idx")

    plan = QuantPlan(tuple(formats.items()), "gptq")
    return CheckpointFormat("gptq", plan, reader)
