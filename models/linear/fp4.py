"""FP4 E2M1 weights with block scales (`models.quant`'s ``mxfp4`` and ``nvfp4``): codes
decoded inside the step.

`Fp4Linear` holds a checkpoint's FP4 codes [in / 2, out] (two per byte, as stored) and
their block scales in their stored dtypes (MXFP4: u8 E8M0 exponents per 32 inputs; NVFP4:
float8_e4m3fn per 16 inputs and one float32 global scale), and multiplies through
`pallas_kernels.fp4_matmul`: the Pallas kernel on the `pallas` backend (a chunk of codes
decoded per tile), elsewhere XLA's decode-and-dot (the 16-entry E2M1 table and the scales
applied inside the step, one layer at a time). Activations stay in the model's float
dtype, whatever the checkpoint's activation scheme: the served numbers are the
dequantized model's.
"""

from __future__ import annotations

import dataclasses

from models.linear.base import LinearMethod
from models.linear.dense import QuantLinear
from pallas_kernels import fp4_matmul
from pallas_kernels.fp4_matmul.reference import dequantize_fp4
from pallas_kernels.invariant import row_tiled


@dataclasses.dataclass(frozen=True)
class Fp4Linear(QuantLinear):
    """An ``mxfp4`` or ``nvfp4`` weight (codes u8[K / 2, N], block scales [K / block, N],
    NVFP4's `global_scale` [1, 1]): a `QuantLinear` (its fields, leaves and declaration)
    multiplied by `fp4_matmul`.

    Attributes:
        fmt: The stored format (its kind; the block is the kind's).
        dtype: The activations' dtype (the codes are decoded to it).
        kernel: `fp4_matmul`'s implementation: "pallas" (GPU/TPU) or "xla".
        row_tile: As `FloatLinear.row_tile`.
    """

    def apply(self, w, x, layer=None):
        return row_tiled(lambda t: fp4_matmul(t.astype(self.dtype), w, self.fmt.kind,
                                              backend=self.kernel), x, self.row_tile)

    def dense(self, w, dtype):
        return dequantize_fp4(w, self.fmt.kind, dtype)

    def partition_spec(self, leaf, shape, split, axes, shards):
        """Splits the codes and their block scales together; a row-parallel split of K
        falls on block boundaries only (the global scale stays whole: [..., 1, 1]).

        Raises:
            ValueError: A K split that would cut a block (the message names the weight's
                kind, its input size, the block and the shard count).
        """
        if split == "in" and leaf == "qweight" and shards > 1:
            k, block = 2 * shape[-2], self.fmt.block
            if k % shards or (k // shards) % block:
                raise ValueError(
                    f"an {self.fmt.kind} weight of {k} inputs in blocks of {block} cannot be "
                    f"split {shards} ways along its input axis: a shard of {k / shards:g} "
                    "inputs would cut a block")
        # NOTE: the base rule, not QuantLinear's (whose check reads q4/q8 groups).
        return LinearMethod.partition_spec(self, leaf, shape, split, axes, shards)
