"""FP8 weights with block scales (`models.quant`'s ``fp8``): codes widened inside the step.

`Fp8Linear` holds a checkpoint's FP8 codes [in, out] and their f32 block scales as stored
(block-wise, per channel or per tensor: `QuantFormat.blocks_for`) and multiplies through
`pallas_kernels.fp8_matmul`: the Pallas kernel on the `pallas` backend (the codes widened
one K-block at a time in the tile), elsewhere XLA's widen-scale-dot, which widens one
layer's codes inside the step (the CPU has no FP8 dot). Activations stay in the model's
float dtype (dynamic and static activation schemes alike): the served numbers are the
dequantized model's.
"""

from __future__ import annotations

import dataclasses

from models.linear.dense import QuantLinear
from models.quant import QuantFormat
from pallas_kernels import fp8_matmul
from pallas_kernels.fp8_matmul.reference import dequantize_fp8
from pallas_kernels.invariant import row_tiled


def infer_fp8_format(leaves: dict) -> QuantFormat:
    """The ``fp8`` format of stored leaves (arrays): each block is read off the scales'
    shape as the power of two that gives that many blocks (exact for the power-of-two
    blocks `models.loaders.quant_formats.fp8` admits), the whole axis for one block."""

    def block(size: int, blocks: int) -> int:
        if blocks == 1:
            return 0
        return 1 << max(0, (-(-size // blocks) - 1).bit_length())

    (k, n), (kb, nb) = leaves["qweight"].shape[-2:], leaves["block_scales"].shape[-2:]
    bn = block(n, nb)
    return QuantFormat("fp8", block(k, kb), block_n=1 if nb == n and n > 1 else bn)


@dataclasses.dataclass(frozen=True)
class Fp8Linear(QuantLinear):
    """An ``fp8`` weight (codes float8_e4m3fn[K, N], `block_scales` f32[Kb, Nb]): a
    `QuantLinear` (its fields, leaves and declaration) multiplied by `fp8_matmul`.

    Attributes:
        fmt: The stored format (its blocks).
        dtype: The activations' dtype (the codes are widened to it).
        kernel: `fp8_matmul`'s implementation: "pallas" (GPU/TPU) or "xla".
        row_tile: As `FloatLinear.row_tile`.
    """

    def _block(self, w) -> tuple[int, int]:
        return self.fmt.blocks_for(*w["qweight"].shape[-2:])

    def apply(self, w, x, layer=None):
        block = self._block(w)
        return row_tiled(lambda t: fp8_matmul(t.astype(self.dtype), w, block,
                                              backend=self.kernel), x, self.row_tile)

    def dense(self, w, dtype):
        return dequantize_fp8(w, self._block(w), dtype)

    def partition_spec(self, leaf, shape, split, axes, shards):
        """Splits the codes and their scales together, on block boundaries only.

        Raises:
            ValueError: A split that would cut a block (the message names the leaf's
                shape, the block and the shard count).
        """
        if split in ("out", "in") and leaf == "qweight":
            axis = -1 if split == "out" else -2
            size, block = shape[axis], self.fmt.blocks_for(*shape[-2:])[axis]
            # One block along the axis: its scales stay whole beside the split codes.
            if -(-size // block) > 1 and (size % shards or (size // shards) % block):
                raise ValueError(
                    f"an FP8 weight {tuple(shape)} in blocks of "
                    f"{'x'.join(map(str, self.fmt.blocks_for(*shape[-2:])))} cannot be "
                    f"split {shards} ways along its {'output' if split == 'out' else 'input'}"
                    f" axis: a shard of {size / shards:g} would cut a block of {block}")
        return super().partition_spec(leaf, shape, split, axes, shards)
