"""The `cpu` backend's linear methods: weights packed into panels its C++ kernels read in place.

The CPU matmul kernel (`pallas_kernels/cpu_ffi/gemm.py`) multiplies by layer `i` of a whole
weight stack f32[L, K, N] packed into 16-column panels f32[L, P, K, 16] (P = 3 ceil(N / 48),
zero-padded), read in place at the traced layer index: the layer scan makes no per-layer
copy of the weights, and the panels spread over XLA's thread pool. A q8/q4/fp8/mxfp4/nvfp4
weight is packed leaf by leaf ("qweight", "scales"[, "zeros"], "block_scales",
"e8m0_scales" or "e4m3_scales" as [L, P, rows, 16] panels, `pallas_kernels/cpu_ffi/qgemm.py`;
a q4 weight's groups as the checkpoint has them, an fp8 weight's block scales widened to
one per column, FP4 codes in q4's panel order with their scales in their stored dtypes and
NVFP4's global scale [L, 1, 1] as it is) and dequantized in registers by the quantized
kernel.
The LM head [hidden, vocab] is packed the same way as a stack of one, [1, P, hidden, 16];
a tied embedding looks tokens up in the head's panels (one copy of the table).

The panels live in the `STACKS` collection at the module's path and leaf names
(`layers/self_attn/q_proj/kernel`, ..., `lm_head/kernel`, or `embed_tokens/embedding`
when tied); biases and norms stay in "params". Only the step's real tokens are multiplied
(`models.linear.context`: the runner says how many; the padding rows' outputs are 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ArchConfig, layer_matmul_shapes
from models.linear.base import EmbedMethod, LinearMethod, permute_inputs, read_stacks, split_perm
from models.linear.context import current
from models.quant import PERM, QuantFormat, QuantPlan
from pallas_kernels.cpu_ffi import gemm, qgemm
from pallas_kernels.quant_matmul.reference import dequantize

# The most an fp8 weight's scales may add, as a fraction of its codes' bytes, once widened to
# one per column (an f32 per bk codes: 4 / bk; the bound on device weight bytes, issue 62).
FP8_SCALE_GROWTH = 0.10


def _leaf_names(fmt: QuantFormat | None, float_name: str) -> tuple[str, ...]:
    if fmt is None:
        return (float_name,)
    return qgemm.LEAVES[fmt.kind] + ((PERM,) if fmt.act_order else ())


def _column_block(fmt: QuantFormat, leaves: dict) -> int:
    """Columns per scale of `fmt`'s standard leaves: fp8's block along N (1 otherwise)."""
    if fmt.kind != "fp8":
        return 1
    return fmt.blocks_for(*np.shape(leaves["qweight"])[-2:])[1]


def _pack(leaves: dict, fmt: QuantFormat | None, float_name: str, stacked: bool) -> dict:
    lead = (lambda a: np.asarray(a)) if stacked else (lambda a: np.asarray(a)[None])
    if fmt is None:
        return {float_name: gemm.pack(lead(leaves[float_name]))}
    arrays = {name: lead(leaves[name]) for name in qgemm.LEAVES[fmt.kind]}
    bn = _column_block(fmt, arrays)
    if bn > 1:  # the kernel reads one scale per column: an fp8 block's repeated across it
        n = arrays["qweight"].shape[-1]
        arrays["block_scales"] = np.repeat(arrays["block_scales"], bn, axis=-1)[..., :n]
    perm = {PERM: lead(leaves[PERM])} if PERM in leaves else {}  # [L, K, 1], as it is
    return {**qgemm.pack(arrays, fmt.kind), **perm}


def _unpack(panels: dict, fmt: QuantFormat | None, float_name: str, n: int,
            stacked: bool) -> dict:
    panels, perm = split_perm(panels)
    out = ({float_name: gemm.unpack(panels[float_name], n)} if fmt is None
           else {**qgemm.unpack(panels, n, fmt.kind), **({} if perm is None else {PERM: perm})})
    if fmt is not None and (bn := _column_block(fmt, out)) > 1:  # one scale per block again
        out = {**out, "block_scales": out["block_scales"][..., ::bn]}
    return out if stacked else {name: a[0] for name, a in out.items()}


def _matmul(fmt: QuantFormat | None, leaves: dict, x: jax.Array, layer, n: int,
            float_name: str) -> jax.Array:
    rows = current().real_rows  # i32[] or None (all)
    layer = 0 if layer is None else layer
    if fmt is None:
        return gemm.stacked_gemm(x, leaves[float_name], layer, n, rows)
    leaves, perm = split_perm(leaves)
    x = permute_inputs(x, None if perm is None else perm[layer])
    return qgemm.stacked_qgemm(x, leaves, fmt.kind, layer, n, rows)


@dataclasses.dataclass(frozen=True)
class PanelLinear(LinearMethod):
    """A float32 ("kernel") or q8/q4/fp8/mxfp4/nvfp4 (`fmt`) weight served as panels from
    `STACKS`."""

    fmt: QuantFormat | None = None
    stacked = True

    def leaf_shapes(self, k, n):
        if self.fmt is None:
            return {"kernel": ((k, n), jnp.dtype(jnp.float32))}
        return self.fmt.leaf_shapes(k, n)

    def weights(self, module, k, n, lead=(), name=None):
        return read_stacks(module, _leaf_names(self.fmt, "kernel")), n

    def apply(self, w, x, layer=None):
        leaves, n = w
        return _matmul(self.fmt, leaves, x, layer, n, "kernel")

    def to_serving(self, leaves, stacked):
        return _pack(leaves, self.fmt, "kernel", stacked)

    def to_standard(self, leaves, n, stacked):
        return _unpack(leaves, self.fmt, "kernel", n, stacked)


@dataclasses.dataclass(frozen=True)
class PanelEmbed(EmbedMethod):
    """A tied embedding stored as the LM head's panels: "embedding" f32[1, P, hidden, 16],
    or the quantized leaves' panels ([1, P, rows, 16]); lookups read the same panels."""

    fmt: QuantFormat | None = None
    stacked = True

    def weights(self, module, vocab, hidden):
        return read_stacks(module, _leaf_names(self.fmt, "embedding")), vocab

    def lookup(self, w, ids):
        leaves, _ = w
        if self.fmt is None:  # column id % 16 of panel id // 16
            return leaves["embedding"][0, ids // gemm.PANEL, :, ids % gemm.PANEL]
        return dequantize(qgemm.columns(leaves, ids), self.fmt.kind).T  # [T, hidden]

    def attend(self, w, h):
        leaves, vocab = w
        return _matmul(self.fmt, leaves, h.astype(jnp.float32), None, vocab, "embedding")

    def to_serving(self, leaves: dict) -> dict:
        """Panels of the standard table: [vocab, hidden] float, or [hidden, vocab] leaves."""
        if self.fmt is None:
            return {"embedding": gemm.pack(np.asarray(leaves["embedding"]).T[None])}
        return _pack(leaves, self.fmt, "embedding", stacked=False)

    def to_standard(self, leaves: dict, vocab: int) -> dict:
        """The inverse of `to_serving`."""
        if self.fmt is None:
            return {"embedding": gemm.unpack(leaves["embedding"], vocab)[0].T}
        return _unpack(leaves, self.fmt, "embedding", vocab, stacked=False)


def kernels_available(quantized: bool) -> bool:
    """Whether the CPU matmul kernel (and for a quantized model the quantized one) builds."""
    return gemm.available() and (not quantized or qgemm.available())


def plan_supported(plan: QuantPlan, cfg: ArchConfig) -> bool:
    """Whether every layer matmul and the LM head (the tied embedding) that `plan`
    quantizes has a format the CPU quantized kernel multiplies (`qgemm.supports`: q8 with
    any block dividing its input size; q4 in groups of a multiple of 32 dividing it, or
    per channel, float16 or float32 zeros: GPTQ, AWQ and compressed-tensors int4 among
    them; fp8 in blocks dividing it whose scales, widened to one per column, add at most
    `FP8_SCALE_GROWTH` to the codes' bytes, not a tied embedding; mxfp4 and nvfp4 with an
    input size a multiple of 32, not a tied embedding); other plans serve with XLA's
    `QuantLinear`/`Fp4Linear` (`can_panel`)."""
    head = "embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    shapes = {name: k for (_, name), (k, _) in layer_matmul_shapes(cfg).items()}
    for name, k in (*shapes.items(), (head, cfg.hidden_size)):
        fmt = plan.get(name)
        if fmt is None:
            continue
        block = fmt.block_for(k)
        if fmt.kind == "fp8" and (name == "embed_tokens" or 4 / block > FP8_SCALE_GROWTH):
            return False
        if fmt.kind in qgemm.FP4_BLOCKS and name == "embed_tokens":
            return False  # a tied FP4 table's lookups would need the codes' own order back
        if not qgemm.supports(fmt.kind, k, block):
            return False
    return True
