"""The kernels the model calls (KV writes, attention, matmuls), behind one interface (`ops`).

One folder per kernel, each with its pure-`jnp` reference (the oracle of its tests):

    ragged_paged_attention/  attention over mixed prefill and decode tokens: the Pallas
                             kernels (`kernel.py` Triton/interpreter, `kernel_tpu.py`
                             Mosaic) and `xla.py`, the plain-XLA path the CPU serves with
    paged_decode_attention/  the Pallas decode kernel (one query token per request)
    mla/                     multi-head latent attention (DeepSeek) over latent pages (one
                             latent row per token): the oracle and the latent write
                             (`reference.py`), XLA (`xla.py`), Pallas (`kernel.py`
                             Triton/interpreter, `kernel_tpu.py` Mosaic)
    kv_write/                the Pallas KV write (a step's K/V into the page pool)
    quant_matmul/            matmuls against quantized weights: Pallas (`kernel.py`), XLA
                             (`xla.py`)
    fp8_matmul/              matmuls against FP8 weights with block scales: Pallas
                             (`kernel.py`), XLA's widen-and-dot (`reference.py`)
    fp4_matmul/              matmuls against FP4 E2M1 weights with block scales (MXFP4,
                             NVFP4): Pallas (`kernel.py`), XLA's decode-and-dot
                             (`reference.py`)
    gated_delta/             Gated DeltaNet's recurrence with per-request state slots: the
                             sequential oracle (`reference.py`), the chunked XLA form
                             (`xla.py`), the Pallas kernel (`kernel.py`)
    ssd/                     Mamba-2's selective state-space scan with per-request state
                             slots: the sequential oracle (`reference.py`), the chunked
                             XLA form (`xla.py`), the Pallas kernel (`kernel.py`)
    causal_conv1d/           the linear layers' short causal conv with its carried state
                             (`reference.py`, jnp on every backend)
    cpu_ffi/                 the `cpu` backend's C++ kernels (XLA FFI custom calls, built
                             on first use): paged decode attention and the layer matmul
                             over packed weights; for development, CI and small deployments

Shared by them: `ops.py` (backend dispatch, the only module the model calls), `metadata.py`
(per-step metadata, pool layout), `state_slots.py` (the linear layers' per-request state
slots), `flash.py` (the online-softmax step), `kv_quant.py` (8-bit pages), `tuning.py`
(tuned sizes per platform).
"""

from pallas_kernels.attention_ops import AttentionOps
from pallas_kernels.metadata import AttentionMetadata, kv_pages_shape
from pallas_kernels.ops import (
    ATTENTION_BACKENDS,
    causal_conv1d,
    fp4_matmul,
    fp8_matmul,
    gated_delta_rule,
    mla_attention,
    mla_attention_expanded,
    quant_matmul,
    ragged_paged_attention,
    resolve_backend,
    ssd,
    write_kv,
    write_latent,
)
from pallas_kernels.quant_matmul.reference import quant_embed

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionOps",
    "AttentionMetadata",
    "causal_conv1d",
    "fp4_matmul",
    "fp8_matmul",
    "gated_delta_rule",
    "kv_pages_shape",
    "mla_attention",
    "mla_attention_expanded",
    "quant_embed",
    "quant_matmul",
    "ragged_paged_attention",
    "resolve_backend",
    "ssd",
    "write_kv",
    "write_latent",
]
