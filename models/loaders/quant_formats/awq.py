"""AWQ checkpoints (`quant_method: "awq"`, GEMM packing), read as they are onto `q4`
(`int_groups`).

Each quantized Linear `<module>` stores (K input features, N outputs, G = K / group_size):

* `<module>.qweight` int32[K, N / 8]: eight 4-bit codes per word along N, bit slot i
  (bits [4i, 4i + 4)) holding value AWQ_ORDER[i] of the word's eight columns.
* `<module>.qzeros` int32[G, N / 8]: zero points stored the same way (stored as they are).
* `<module>.scales` f16[G, N].

w[n, k] = (q[k, n] - z[k // group_size, n]) * scales[k // group_size, n].
"""

from __future__ import annotations

import numpy as np

from models.config import ArchConfig
from models.loaders.checkpoint_quant import CheckpointFormat, register
from models.loaders.quant_formats.gptq import linear_modules, read_int_leaves
from models.loaders.quant_formats.int_groups import check_shape, group_format, to_rows, unpack_int32
from models.quant import QuantPlan

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
VERSIONS = ("gemm",)


@register("awq")
def awq_format(qc: dict, path: str, cfg: ArchConfig) -> CheckpointFormat:
    """The AWQ format of `qc` (bits 4, group_size, zero_point, version "gemm").

    Raises:
        ValueError: Bits other than 4, an unsupported group size or packing version
            (GEMV, Marlin, ...), or `zero_point: false` (the message names the field).
    """
    where = f"{path}: quantization_config"
    bits, group = int(qc.get("bits", qc.get("w_bit", 4))), int(qc.get("group_size",
                                                                   qc.get("q_group_size", 128)))
    if bits != 4:
        raise ValueError(f"{where}: bits={bits} is not supported for AWQ (supported: 4)")
    version = str(qc.get("version", "gemm")).lower()
    if version not in VERSIONS:
        raise ValueError(f"{where}.version {version!r} is not supported (supported: gemm)")
    if not qc.get("zero_point", True):
        raise ValueError(f"{where}.zero_point=false is not supported (AWQ GEMM stores zeros)")
    fmt = group_format(bits, group, False, where)

    def reader(source, name: str) -> dict[str, np.ndarray]:
        base = name.removesuffix(".weight")
        qweight, scales, qzeros = read_int_leaves(source, base, "[K, N / 8]")
        k, n = qweight.shape[0], qweight.shape[1] * 8
        if fmt.block and k % group:
            raise ValueError(f"quantized tensor {base!r}: group_size {group} does not divide "
                             f"its {k} input features")
        groups = 1 if fmt.block == 0 else k // group
        check_shape(scales, (groups, n), base, "scales")
        check_shape(qzeros, (groups, n // 8), base, "qzeros")
        codes = unpack_int32(qweight, bits, axis=1, order=AWQ_ORDER).T  # u8[N, K]
        zero_points = unpack_int32(qzeros, bits, axis=1, order=AWQ_ORDER).T  # [N, G]
        return to_rows(fmt, codes, scales.T, zero_points)

    plan = QuantPlan(tuple((m, fmt) for m in linear_modules(cfg)), "awq")
    return CheckpointFormat("awq", plan, reader)
