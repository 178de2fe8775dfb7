"""The `cpu` backend's C++ kernels: XLA FFI custom calls compiled on first use (`build.py`).

- `op.py` + `paged_decode.cc`: paged decode attention reading the page pool in place
  (the decode rows, and the tokens of short prompts, of `ragged_paged_attention/xla.py`).
- `gemm.py` + `stacked_gemm.cc`: the layer matmul over weights packed into panels, reading
  layer `i` of the whole stack in place (the panel linear method, `models/linear/panels.py`).
- `qgemm.py` + `stacked_qgemm.cc` (+ `qgemm_q4.h`, `qgemm_q8.h`): the same over q8/q4/FP8
  weights, the codes packed into panels and dequantized in registers (a quantized model's
  packed weights: GGUF blocks, GPTQ/AWQ/compressed-tensors groups, FP8 block scales).
- `lora.py` + `lora_sgmv.cc`: each token's LoRA update by its own adapter slot only
  (`models/linear/lora.py`'s "grouped" form), reading layer `i` of the slot stacks in place.

The CPU backend is for development, CI and small deployments: one host's cores, float32
compute (float32 or q8/q4/FP8 weights), one device (a tensor-parallel mesh serves on `xla`).
Production serving is the Pallas kernels on GPU and TPU.
"""

from pallas_kernels.cpu_ffi.op import (
    available,
    paged_decode_cpu,
    supports,
    unavailable_reason,
)

__all__ = ["available", "paged_decode_cpu", "supports", "unavailable_reason"]
