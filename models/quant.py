"""Weight quantization formats: what a quantized projection stores, and host-side quantizers.

Five on-device formats cover every mode (`QuantFormat.kind`):

* ``q8``: ``qweight`` i8[K, N] with ``scales`` f16[K // block, N]; w = q * scale. Q8_0
  (block 32) and int8 weight-only (per output channel: block = K) are both ``q8``.
* ``q4``: ``qweight`` u8[K // 2, N] (two 4-bit values per byte) with ``scales`` f16 and
  ``zeros`` (f16, or f32: `QuantFormat.zero_dtype`) [K // block, N], block a multiple of
  32 (GGUF's 32, a checkpoint's group of 64 or 128, or K); w = q * scale + zero. GGUF's
  Q4_0 (zero = -8 * scale), Q4_1 (zero = its min) and Q4_K (each 32-weight sub-block's
  6-bit scale and min expanded to f16) all map onto it without re-quantizing, as GPTQ's
  and AWQ's groups do (zero = -z * scale).
* ``fp8``: ``qweight`` float8_e4m3fn[K, N] with ``block_scales`` f32[ceil(K / bk),
  ceil(N / bn)]; w = q * scale of its (bk, bn) block, the last block along each axis cut
  short where bk or bn does not divide it. Block-wise FP8 checkpoints (DeepSeek-V3's and
  Qwen3-FP8's 128x128 `weight_scale_inv`), per output channel (bk = K, bn = 1) and per
  tensor (bk = K, bn = N) are all ``fp8`` (`models.loaders.quant_formats.fp8`).
* ``mxfp4``: FP4 E2M1 codes ``qweight`` u8[K // 2, N] (two per byte, below) with
  ``e8m0_scales`` u8[K // 32, N], each a power of two stored as its exponent + 127;
  w = fp4(code) * 2^(e - 127). gpt-oss's experts and compressed-tensors' MXFP4.
* ``nvfp4``: the same codes in blocks of 16 with ``e4m3_scales`` float8_e4m3fn[K // 16, N]
  and one ``global_scale`` f32[1, 1] per weight; w = fp4(code) * (scale * global_scale).
  compressed-tensors' NVFP4 (its ``weight_global_scale`` divides: 1 / it is stored).

A q8/q4 weight of an act-order checkpoint (GPTQ's `desc_act`, compressed-tensors'
`actorder`: input k in group g_idx[k], any order) is stored with its K rows sorted by group
(`QuantFormat.act_order`) and one more leaf, ``perm`` i32[K, 1]: row j holds input
perm[j], so y = x[..., perm] @ w (`models.linear.base.permute_inputs`).

Layout: K (the contraction axis) leads, as in a Flax `Dense` kernel [in, out]; the tied
embedding is stored the same way ([hidden, vocab]: the LM head's layout) and looked up by
column. In a ``q4`` block b, code row ``b * 16 + j`` holds value ``b * 32 + j`` in its
low nibble and ``b * 32 + 16 + j`` in its high nibble (GGUF's Q4_0 byte order). An FP4
code row ``r`` holds value ``2 * r`` in its low nibble and ``2 * r + 1`` in its high one
(the checkpoints' own pairs, transposed); a nibble is sign (bit 3), exponent (bits 1-2)
and mantissa (bit 0) of E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.

Host-side functions here work on the *row form* [N, K] that checkpoints use (HF Linear
weights, GGUF rows); `to_leaves` transposes into the on-device layout.
"""

from __future__ import annotations

import dataclasses

import numpy as np

QUANTIZATIONS = ("auto", "none", "gguf", "int8", "q8_0")
# A mixture of experts' routed expert stacks, as a plan names them (`models.moe.Experts`):
# apart from the dense MLP's and the shared expert's `gate_proj`/`up_proj`/`down_proj`.
EXPERT_MODULES = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
# Modules a plan may quantize: the decoder's projections, the routed experts, the embedding
# and the LM head.
QUANT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                 *EXPERT_MODULES, "embed_tokens", "lm_head")
Q4_BLOCK = 32
# The FP4 kinds: their blocks along K and the name of their block-scale leaf.
FP4_BLOCKS = {"mxfp4": 32, "nvfp4": 16}
FP4_SCALES = {"mxfp4": ("e8m0_scales", "uint8"), "nvfp4": ("e4m3_scales", "float8_e4m3fn")}
# Kinds whose codes hold two values per byte along K.
NIBBLE_KINDS = ("q4", "mxfp4", "nvfp4")
PERM = "perm"  # an act-order weight's input permutation leaf (`QuantFormat.act_order`)


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """On-device format of one quantized weight.

    Attributes:
        kind: "q8", "q4", "fp8", "mxfp4" or "nvfp4".
        block: Values per scale along K (0: one scale per output channel, i.e. block = K);
            a q4 block is a multiple of 32 (its codes pair up within 32-value sub-blocks);
            mxfp4's is 32 and nvfp4's 16 (`FP4_BLOCKS`).
        zero_dtype: The q4 zeros' dtype: "float16", or "float32" where a checkpoint's
            zero points must stay exact (an asymmetric GPTQ/AWQ zero -z * scale needs up
            to 15 mantissa bits; the CPU panel kernel reads both).
        block_n: ``fp8`` only: values per scale along N (0: all of N, 1: per channel).
        act_order: q8/q4 only: the rows are sorted by group and ``perm`` i32[K, 1] says
            which input each holds (an act-order checkpoint's groups made contiguous).
    """

    kind: str
    block: int = 32
    zero_dtype: str = "float16"
    block_n: int = 0
    act_order: bool = False

    def blocks_for(self, k: int, n: int) -> tuple[int, int]:
        """``fp8``'s (bk, bn) block for a [k, n] weight (0 resolved to the whole axis)."""
        return self.block_for(k), n if self.block_n == 0 else self.block_n

    def block_for(self, k: int) -> int:
        """The block length for a weight with contraction size `k`."""
        return k if self.block == 0 else self.block

    def leaf_shapes(self, k: int, n: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """{leaf name: (shape, dtype name)} of a [k, n] weight in this format.

        Raises:
            ValueError: `k` is not a multiple of the block (or of 2 for 4-bit packing).
        """
        if self.kind == "fp8":  # edge blocks cut short: no divisibility needed
            bk, bn = self.blocks_for(k, n)
            return {"qweight": ((k, n), "float8_e4m3fn"),
                    "block_scales": ((-(-k // bk), -(-n // bn)), "float32")}
        block = self.block_for(k)
        if k % block:
            raise ValueError(f"{self.kind} block {block} does not divide the input size {k}")
        if self.kind in FP4_BLOCKS:
            if block != FP4_BLOCKS[self.kind]:
                raise ValueError(f"{self.kind} block {block} must be {FP4_BLOCKS[self.kind]}")
            scale, dtype = FP4_SCALES[self.kind]
            shapes = {"qweight": ((k // 2, n), "uint8"), scale: ((k // block, n), dtype)}
            if self.kind == "nvfp4":
                shapes["global_scale"] = ((1, 1), "float32")
            return shapes
        perm = {PERM: ((k, 1), "int32")} if self.act_order else {}
        if self.kind == "q8":
            return {"qweight": ((k, n), "int8"), "scales": ((k // block, n), "float16"),
                    **perm}
        if block % Q4_BLOCK:
            raise ValueError(f"q4 block {block} (input size {k}) is not a multiple of "
                             f"{Q4_BLOCK}")
        return {"qweight": ((k // 2, n), "uint8"), "scales": ((k // block, n), "float16"),
                "zeros": ((k // block, n), self.zero_dtype), **perm}

    @property
    def bits(self) -> int:
        return 4 if self.kind in NIBBLE_KINDS else 8


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    """How each module's weight is stored in the standard layout: quantized (and how), or
    dense (hashable: a static part of the model). How a weight is served is its linear
    method's business (`models.linear`), chosen from this plan.

    Attributes:
        formats: (module name, format) pairs; modules not listed stay dense.
        name: The `quantization` setting the plan came from ("int8", "gguf", ...).
    """

    formats: tuple[tuple[str, QuantFormat], ...] = ()
    name: str = "none"

    def get(self, module: str) -> QuantFormat | None:
        return dict(self.formats).get(module)

    def __bool__(self) -> bool:
        return bool(self.formats)

    def to_dict(self) -> dict:
        return {"name": self.name, "formats": {m: _fields(f) for m, f in self.formats}}

    @classmethod
    def from_dict(cls, d: dict) -> QuantPlan:
        return cls(tuple((m, QuantFormat(*f)) for m, f in d["formats"].items()), d["name"])


NO_QUANT = QuantPlan()  # every weight dense


def _fields(f: QuantFormat) -> list:
    """`f`'s fields as `QuantPlan.to_dict` stores them: the defaults at the end left out."""
    fields = [f.kind, f.block, f.zero_dtype, f.block_n, f.act_order]
    if f.act_order:
        return fields
    return fields[:4] if f.kind == "fp8" else fields[:3] if f.zero_dtype != "float16" \
        else fields[:2]


def kind_of(leaves) -> str | None:
    """The format kind ("q8", "q4", "fp8", "mxfp4", "nvfp4") of a quantized weight's leaves
    (a dict of them, or their names), None for a float one (no "qweight")."""
    if "qweight" not in leaves:
        return None
    if "block_scales" in leaves:
        return "fp8"
    for kind, (scale, _) in FP4_SCALES.items():
        if scale in leaves:
            return kind
    return "q4" if "zeros" in leaves else "q8"


def uniform_plan(name: str, fmt: QuantFormat, modules=QUANT_MODULES) -> QuantPlan:
    """A plan quantizing every module in `modules` to `fmt`."""
    return QuantPlan(tuple((m, fmt) for m in modules), name)


def quantize_q8_rows(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 quantization of row-form weights.

    Args:
        w: f32[N, K].
        block: Values per scale along K (K: per row).

    Returns:
        (q i8[N, K], scales f16[N, K // block]); w ~= q * scale. The scale is rounded to
        f16 *before* q is computed, so q * scale is exactly what the device computes.
    """
    n, k = w.shape
    wb = w.reshape(n, k // block, block).astype(np.float32)
    scale = (np.abs(wb).max(axis=-1) / 127.0).astype(np.float16)  # f16[N, K // block]
    s32 = scale.astype(np.float32)[..., None]
    q = np.where(s32 > 0, np.rint(wb / np.where(s32 > 0, s32, 1.0)), 0.0)
    return np.clip(q, -127, 127).astype(np.int8).reshape(n, k), scale


def pack_q4_rows(values: np.ndarray) -> np.ndarray:
    """u8[N, K] values in 0..15 -> u8[N, K // 2] in the module docstring's byte order."""
    n, k = values.shape
    v = values.reshape(n, k // Q4_BLOCK, 2, Q4_BLOCK // 2).astype(np.uint8)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_q4_rows(codes: np.ndarray) -> np.ndarray:
    """Inverse of `pack_q4_rows`: u8[N, K // 2] -> u8[N, K]."""
    n, half = codes.shape
    p = codes.reshape(n, half // (Q4_BLOCK // 2), 1, Q4_BLOCK // 2)
    return np.concatenate([p & 15, p >> 4], axis=2).reshape(n, half * 2)


def dequantize_rows(fmt: QuantFormat, rows: dict[str, np.ndarray]) -> np.ndarray:
    """f32[N, K] from row-form leaves ({"qweight", "scales"[, "zeros"][, "perm" i32[1, K]]}:
    columns back in input order); the numpy oracle."""
    q, scale = rows["qweight"], rows["scales"].astype(np.float32)
    if fmt.kind == "q4":
        q = unpack_q4_rows(q)
    n, k = q.shape
    block = k // scale.shape[1]
    w = q.reshape(n, k // block, block).astype(np.float32) * scale[..., None]
    if fmt.kind == "q4":
        w = w + rows["zeros"].astype(np.float32)[..., None]
    w = w.reshape(n, k)
    if PERM in rows:  # column j holds input perm[j]
        out = np.empty_like(w)
        out[:, np.asarray(rows[PERM]).reshape(-1)] = w
        return out
    return w


def quantize_rows(fmt: QuantFormat, w: np.ndarray) -> dict[str, np.ndarray]:
    """Quantizes f32[N, K] row-form weights into `fmt`'s row-form leaves.

    ``q4`` uses GGUF Q4_1's rule (per block: min and (max - min) / 15), the one 4-bit
    quantizer needed when a checkpoint is dense.
    """
    n, k = w.shape
    block = fmt.block_for(k)
    if fmt.kind == "q8":
        q, scale = quantize_q8_rows(w, block)
        return {"qweight": q, "scales": scale}
    wb = w.reshape(n, k // block, block).astype(np.float32)
    lo, hi = wb.min(axis=-1), wb.max(axis=-1)
    scale = ((hi - lo) / 15.0).astype(np.float16)
    zero = lo.astype(np.float16)
    s32 = scale.astype(np.float32)[..., None]
    q = np.rint((wb - zero.astype(np.float32)[..., None]) / np.where(s32 > 0, s32, 1.0))
    q = np.clip(np.where(s32 > 0, q, 0), 0, 15).astype(np.uint8).reshape(n, k)
    return {"qweight": pack_q4_rows(q), "scales": scale, "zeros": zero}


def to_leaves(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Row form [N, ...] -> the on-device layout [..., N] (every leaf transposed)."""
    return {name: np.ascontiguousarray(a.T) for name, a in rows.items()}


def quantize_stack(fmt: QuantFormat, w: np.ndarray) -> dict[str, np.ndarray]:
    """Quantizes a stack of [K, N] kernels (f32[..., K, N], e.g. the experts' [L, E, K, N])
    into `fmt`'s on-device leaves with the same leading axes ([..., K', N] each).

    Raises:
        ValueError: K is not a multiple of the format's block.
    """
    lead, (k, n) = w.shape[:-2], w.shape[-2:]
    fmt.leaf_shapes(k, n)  # checks the block divides K
    flat = np.asarray(w, np.float32).reshape(-1, k, n)
    leaves = [to_leaves(quantize_rows(fmt, m.T)) for m in flat]  # one [K, N] kernel each
    return {name: np.stack([x[name] for x in leaves]).reshape(*lead, *leaves[0][name].shape)
            for name in leaves[0]}


def quantize_params(params: dict, plan: QuantPlan) -> dict:
    """Quantizes a dense params tree (host or device arrays) as `plan` says, on the host.

    Dense kernels [in, out] (stacked layers: [L, in, out]), the embedding [vocab, hidden]
    and the routed experts' stacks ([L, E, in, out], `EXPERT_MODULES`) of every module the
    plan names become that module's quantized leaves (NumPy; experts keep their leading
    axes); all other leaves are returned as they are.
    """

    def convert(fmt: QuantFormat, rows_of: list[np.ndarray], stack: bool) -> dict:
        leaves = [to_leaves(quantize_rows(fmt, r)) for r in rows_of]
        return {k: np.stack([x[k] for x in leaves]) if stack else leaves[0][k]
                for k in leaves[0]}

    def experts(tree: dict) -> dict:  # {"gate_proj": [(L,) E, K, N], ...}: the routed stacks
        out = dict(tree)
        for name, w in tree.items():
            fmt = plan.get(f"experts.{name}")
            if fmt is not None and not isinstance(w, dict):  # a dict: already quantized
                out[name] = quantize_stack(fmt, np.asarray(w, np.float32))
        return out

    def walk(tree: dict, stacked: bool) -> dict:
        out = {}
        for key, sub in tree.items():
            if key == "experts" and isinstance(sub, dict):
                out[key] = experts(sub)
                continue
            fmt = plan.get(key) if isinstance(sub, dict) else None
            if fmt is not None and ("kernel" in sub or "embedding" in sub):
                if "embedding" in sub:
                    leaves = convert(fmt, [np.asarray(sub["embedding"], np.float32)], False)
                else:
                    kernel = np.asarray(sub["kernel"], np.float32)
                    per_layer = list(kernel) if stacked else [kernel]
                    leaves = convert(fmt, [k.T for k in per_layer], stacked)
                if "bias" in sub:
                    leaves["bias"] = sub["bias"]
                out[key] = leaves
            elif isinstance(sub, dict):
                out[key] = walk(sub, stacked or key == "layers")
            else:
                out[key] = sub
        return out

    return walk(params, False)
