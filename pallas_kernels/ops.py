"""The kernels' one dispatch: KV writes, attention and matmuls, on each backend.

The model holds an `AttentionOps` (`pallas_kernels/attention_ops.py`, chosen when the model is
loaded, `models.linear`) and calls `write_kv` and `attend` on it, which call the functions
here: which kernel runs, and the rotation of 8-bit pages (`kv_quant.kv_rotation`), are decided
in these two files, never in the model.

Backends:
    "xla":    plain XLA: the KV write's reference scatter and `ragged_paged_attention_xla`,
              whose cost follows the live context (the jnp references stay the oracles).
    "cpu":    "xla" with its decode rows in a C++ kernel that reads the page pool in place
              (`pallas_kernels.cpu_ffi`, built on first use; CPU only, one device's
              pool: tensor parallelism keeps "xla"). For development, CI and small
              deployments.
    "pallas": the Pallas kernels: on TPU the Mosaic ragged kernel (decodes included; the KV
              write is XLA's in-place scatter), on GPU the Triton kernels, and on the CPU
              the GPU kernels in the Pallas interpreter.
    "auto":   "pallas" on GPU/TPU; on the CPU "cpu" where the kernel builds, else "xla".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_ffi
from pallas_kernels.causal_conv1d.reference import causal_conv1d_reference
from pallas_kernels.fp4_matmul.kernel import fp4_matmul_kernel
from pallas_kernels.fp4_matmul.reference import fp4_matmul_reference
from pallas_kernels.fp8_matmul.kernel import fp8_matmul_kernel
from pallas_kernels.fp8_matmul.reference import fp8_matmul_reference
from pallas_kernels.gated_delta.kernel import gated_delta_rule_kernel
from pallas_kernels.gated_delta.xla import gated_delta_rule_xla
from pallas_kernels.invariant import invariant_attention, invariant_attention_cpu
from pallas_kernels.kv_write.kernel import write_kv_kernel
from pallas_kernels.kv_write.reference import write_kv_reference
from pallas_kernels.metadata import AttentionMetadata
from pallas_kernels.mla.kernel import mla_attention_kernel
from pallas_kernels.mla.kernel_tpu import mla_attention_tpu
from pallas_kernels.mla.reference import write_latent_reference
from pallas_kernels.mla.xla import mla_attention_expanded_xla, mla_attention_xla
from pallas_kernels.paged_decode_attention.kernel import paged_decode_attention_kernel
from pallas_kernels.quant_matmul.kernel import quant_matmul_kernel
from pallas_kernels.quant_matmul.xla import quant_matmul_xla
from pallas_kernels.ragged_paged_attention.kernel import ragged_paged_attention_kernel
from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu
from pallas_kernels.ragged_paged_attention.xla import ragged_paged_attention_xla
from pallas_kernels.sinks import check_sinks
from pallas_kernels.ssd.kernel import ssd_kernel
from pallas_kernels.ssd.xla import ssd_xla
from pallas_kernels.tuning import tuned

ATTENTION_BACKENDS = ("auto", "xla", "cpu", "pallas")


def resolve_backend(backend: str) -> str:
    """Turns "auto" into a concrete backend for the default platform.

    Raises:
        ValueError: If `backend` is not one of `ATTENTION_BACKENDS`, or is "cpu" off the
            CPU or where its kernel cannot be built (the message says why).
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {backend!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if backend == "auto":
        if jax.default_backend() != "cpu":
            return "pallas"
        return "cpu" if cpu_ffi.available() else "xla"
    if backend == "cpu" and not cpu_ffi.available():
        raise ValueError("attention backend 'cpu' is unavailable here: "
                         + cpu_ffi.unavailable_reason())
    return backend


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _on_tpu() -> bool:
    return jax.default_backend() == "tpu"


def kernel_tiles(page_size: int, max_pages_per_seq: int) -> tuple[int, int]:
    """(pages_per_block, num_splits) of the Pallas kernels: at least `min_block_keys` keys
    per inner step; contexts of `split_from_blocks` blocks or more split across programs
    (`pallas_kernels.tuning`, "pallas_tiles")."""
    t = tuned("pallas_tiles")
    pages_per_block = max(1, t["min_block_keys"] // page_size)
    num_blocks = -(-max_pages_per_seq // pages_per_block)
    return pages_per_block, max(1, min(t["max_splits"], num_blocks // t["split_from_blocks"]))


def write_kv(kv_pages: jax.Array, layer, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
             *, backend: str = "xla") -> jax.Array:
    """Scatters new K/V into layer `layer` of the pool; see `write_kv_reference`."""
    if backend == "pallas" and not _on_tpu():
        return write_kv_kernel(kv_pages, layer, k, v, slot_mapping, interpret=_interpret())
    return write_kv_reference(kv_pages, layer, k, v, slot_mapping)


def ragged_paged_attention(q: jax.Array, kv_pages: jax.Array, layer, md: AttentionMetadata, *,
                           sm_scale: float, sliding_window=0, soft_cap: float | None = None,
                           sinks: jax.Array | None = None, backend: str = "xla",
                           batch_invariant: bool = False, chunk_size=0) -> jax.Array:
    """Packed causal attention through block tables (the references in
    `pallas_kernels/*/reference.py` define the result).

    On the Pallas backend, decode-only steps (`md.decode_only`) go to the paged decode
    kernel; the XLA path needs no separate decode program (it reads decode rows once per
    row by itself) and ignores the flag. With `batch_invariant` every token is computed
    alone (its result the same whatever shares the step): on "cpu" every token is a row of
    the C++ kernel, on "xla" (and "cpu" with a pool the kernel does not read, or a chunk)
    it goes through `invariant_attention`; "pallas" has no such mode (a ValueError).

    `sinks` (f32[num_q_heads] or None) are gpt-oss's learned sink logits, one more softmax
    column per query head (`pallas_kernels.sinks`); every path takes them.

    `chunk_size` (Llama 4's chunked local attention; may be traced, 0 for none): a query at
    position p sees keys floor(p / C) * C .. p. Every path takes it: the XLA path (with the
    "cpu" backend's C++ rows), the Pallas kernels (a third kernel scalar, as the window)
    and batch-invariant mode; the literal 0 keeps every program as it is without chunks.

    Bidirectional spans (`md.q_span_end`, Gemma 3's images): every path but the TPU's
    Mosaic kernel reads them; on a TPU, steps that carry them take the XLA path.
    """
    check_sinks(sinks, q.shape[1] if q.ndim == 3 else -1)
    chunked = not (isinstance(chunk_size, int) and chunk_size == 0)
    common = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  sinks=sinks)
    if batch_invariant:
        return _invariant(q, kv_pages, layer, md, backend, common, chunk_size)
    if backend != "pallas":
        extra = dict(chunk_size=chunk_size) if chunked else {}
        return ragged_paged_attention_xla(q, kv_pages, layer, md, cpu_decode=backend == "cpu",
                                          **common, **extra)
    common["chunk_size"] = chunk_size if chunked else None  # None: the kernels' no-chunk program
    page_size, width = kv_pages.shape[4], md.block_tables.shape[1]
    if _on_tpu() and md.q_span_end is not None and not md.decode_only:
        # NOTE: the Mosaic kernel does not read spans yet: steps with them take the XLA path.
        del common["chunk_size"]
        return ragged_paged_attention_xla(q, kv_pages, layer, md, **common,
                                          **(dict(chunk_size=chunk_size) if chunked else {}))
    if _on_tpu():
        ppb, _ = kernel_tiles(page_size, width)
        if md.decode_only:  # one query per request: blocks of one token
            md = AttentionMetadata(md.slot_mapping, md.block_tables, md.kv_lens,
                                   jnp.arange(md.kv_lens.shape[0] + 1, dtype=jnp.int32))
            return ragged_paged_attention_tpu(q, kv_pages, layer, md,
                                              block_q=tuned("ragged_tpu")["decode_block_q"],
                                              pages_per_block=ppb, **common)
        return ragged_paged_attention_tpu(q, kv_pages, layer, md, pages_per_block=ppb,
                                          block_q=tuned("ragged_tpu")["block_q"], **common)
    if md.decode_only:
        if q.shape[0] != md.kv_lens.shape[0]:
            raise ValueError(f"decode_only needs one token per request: q {q.shape} vs "
                             f"kv_lens {md.kv_lens.shape}")
        ppb, splits = kernel_tiles(page_size, width)
        return paged_decode_attention_kernel(
            q, kv_pages, layer, md.block_tables, md.kv_lens, pages_per_block=ppb,
            num_splits=splits, interpret=_interpret(), **common)
    ppb, _ = kernel_tiles(page_size, width)
    return ragged_paged_attention_kernel(q, kv_pages, layer, md, pages_per_block=ppb,
                                         interpret=_interpret(), **common)


def _invariant(q, kv_pages, layer, md, backend, common, chunk_size):
    """`ragged_paged_attention` in batch-invariant mode (see there). A chunk or bidirectional
    spans keep off the C++ rows: they mask by length and window only (the XLA path's
    shifted tables need a chunk of whole pages, which a traced chunk cannot promise)."""
    if backend == "pallas":
        raise ValueError("batch_invariant attention is not built for the 'pallas' backend "
                         "(it needs kernels whose splits and tiles do not follow the step)")
    t = tuned("batch_invariant")
    chunked = not (isinstance(chunk_size, int) and chunk_size == 0)
    spans = md.q_span_end is not None  # the C++ rows see through their position only
    if backend == "cpu" and cpu_ffi.supports(kv_pages) and not chunked and not spans:
        return invariant_attention_cpu(q, kv_pages, layer, md, **common)
    extra = dict(chunk_size=chunk_size) if chunked else {}
    return invariant_attention(q, kv_pages, layer, md, block_kv=t["block_kv"],
                               token_tile=t["token_tile"], **common, **extra)


def write_latent(pool: jax.Array, slot, latent: jax.Array, slot_mapping: jax.Array, *,
                 backend: str = "xla") -> jax.Array:
    """Scatters this step's MLA latents f32/bf16[T, R + Dr] into slot `slot` of a latent
    pool (`pallas_kernels.mla.reference.write_latent_reference`: the null page's slots
    dropped, 8-bit pools quantized per token row). XLA's scatter on every backend: one
    row per token, in place under donation (the TPU's GQA write is the same scatter)."""
    del backend
    return write_latent_reference(pool, slot, latent, slot_mapping)


def mla_attention(q_latent: jax.Array, q_pe: jax.Array, pool: jax.Array, slot,
                  md: AttentionMetadata, *, sm_scale: float, backend: str = "xla") -> jax.Array:
    """Absorbed-form multi-head latent attention over latent pages: [T, H, R] outputs in
    latent space (the caller applies W_UV); `mla_attention_reference` defines the result.

    "pallas" runs the Pallas MLA kernel (Mosaic on TPU, Triton on GPU, the interpreter on
    the CPU; decode steps are query blocks of one token, so `md.decode_only` needs no
    program of its own), "xla" and "cpu" the XLA path (`mla_attention_xla`: the C++ decode
    kernel reads GQA pages only).
    """
    if backend == "pallas":
        ppb, _ = kernel_tiles(pool.shape[4], md.block_tables.shape[1])
        block_q = tuned("mla_pallas")["block_q"]
        if _on_tpu():
            return mla_attention_tpu(q_latent, q_pe, pool, slot, md, sm_scale=sm_scale,
                                     block_q=block_q, pages_per_block=ppb)
        return mla_attention_kernel(q_latent, q_pe, pool, slot, md, sm_scale=sm_scale,
                                    block_q=block_q, pages_per_block=ppb,
                                    interpret=_interpret())
    return mla_attention_xla(q_latent, q_pe, pool, slot, md, sm_scale=sm_scale)


def mla_attention_expanded(q_nope: jax.Array, q_pe: jax.Array, pool: jax.Array, slot,
                           md: AttentionMetadata, w_uk: jax.Array, w_uv: jax.Array, *,
                           sm_scale: float, absorbed_decode: bool = False,
                           backend: str = "xla") -> jax.Array:
    """Expanded-form MLA over latent pages: [T, H, Dv] outputs (W_UV applied; keys and values
    rebuilt per head from the gathered latents, `mla_expanded_reference` defines the
    result); `absorbed_decode` keeps requests of one new token in the absorbed form.

    The XLA path (`mla_attention_expanded_xla`) on every backend: no Pallas kernel of this
    form is built (on "pallas" the absorbed form runs through the MLA kernel).
    """
    del backend
    return mla_attention_expanded_xla(q_nope, q_pe, pool, slot, md, w_uk, w_uv,
                                      sm_scale=sm_scale, absorbed_decode=absorbed_decode)


def quant_matmul(x: jax.Array, w: dict, kind: str, *, backend: str = "xla") -> jax.Array:
    """x [..., K] @ a quantized weight [K, N] (see `pallas_kernels.quant_matmul`)."""
    if backend == "pallas":
        lead = x.shape[:-1]
        y = quant_matmul_kernel(x.reshape(-1, x.shape[-1]), w, kind, interpret=_interpret())
        return y.reshape(*lead, y.shape[-1])
    return quant_matmul_xla(x, w, kind)


def fp8_matmul(x: jax.Array, w: dict, block: tuple[int, int], *,
               backend: str = "xla") -> jax.Array:
    """x [..., K] @ an FP8 weight [K, N] with (bk, bn) block scales
    (`pallas_kernels.fp8_matmul`): the Pallas kernel on "pallas", else XLA's widen-and-dot."""
    if backend == "pallas":
        lead = x.shape[:-1]
        y = fp8_matmul_kernel(x.reshape(-1, x.shape[-1]), w, tuple(block),
                              interpret=_interpret())
        return y.reshape(*lead, y.shape[-1])
    return fp8_matmul_reference(x, w, tuple(block))


def fp4_matmul(x: jax.Array, w: dict, kind: str, *, backend: str = "xla") -> jax.Array:
    """x [..., K] @ an FP4 weight [K, N] of `kind` ("mxfp4", "nvfp4"; `pallas_kernels.
    fp4_matmul`): the Pallas kernel on "pallas", else XLA's decode-and-dot."""
    if backend == "pallas":
        lead = x.shape[:-1]
        y = fp4_matmul_kernel(x.reshape(-1, x.shape[-1]), w, kind, interpret=_interpret())
        return y.reshape(*lead, y.shape[-1])
    return fp4_matmul_reference(x, w, kind)


def gated_delta_rule(q, k, v, g, beta, state, slots, cu_q_lens, kv_lens, *,
                     backend: str = "xla"):
    """The gated delta rule (Gated DeltaNet's linear attention) over the ragged batch, with
    each row's state in its slot of the layer's pool: (out f32[T, Hv, dv], state).

    The contract is `pallas_kernels.gated_delta.reference.gated_delta_rule_reference`'s;
    "pallas" runs the Pallas kernel (the interpreter on the CPU), "xla" and "cpu" the
    chunked XLA form (`gated_delta_rule_xla`).
    """
    if backend == "pallas":
        t, dv = tuned("gated_delta"), v.shape[-1]
        block_v = t["block_v"] if dv % t["block_v"] == 0 else dv
        return gated_delta_rule_kernel(q, k, v, g, beta, state, slots, cu_q_lens, kv_lens,
                                       chunk=t["chunk"], block_v=block_v,
                                       interpret=_interpret())
    return gated_delta_rule_xla(q, k, v, g, beta, state, slots, cu_q_lens, kv_lens)


def ssd(x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens, *, backend: str = "xla"):
    """Mamba-2's selective state-space scan (SSD) over the ragged batch, with each row's
    state in its slot of the layer's pool: (y f32[T, H, P], state), the d skip included.

    The contract is `pallas_kernels.ssd.reference.ssd_reference`'s; "pallas" runs the
    Pallas kernel (the interpreter on the CPU), "xla" and "cpu" the chunked XLA form
    (`ssd_xla`).
    """
    if backend == "pallas":
        t, head_dim = tuned("ssd"), x.shape[-1]
        block_p = t["block_p"] if head_dim % t["block_p"] == 0 else head_dim
        return ssd_kernel(x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens,
                          chunk=t["chunk"], block_p=block_p, interpret=_interpret())
    return ssd_xla(x, dt, a, b, c, d, state, slots, cu_q_lens, kv_lens)


def causal_conv1d(x, weight, bias, conv_state, slots, cu_q_lens, kv_lens,
                  activation: str | None = "silu", *, backend: str = "xla"):
    """Causal depthwise conv1d over the ragged batch, carrying each row's last W - 1
    inputs in its slot: (y f32[T, C], conv_state). The same jnp form on every backend
    (`pallas_kernels.causal_conv1d.reference` says why no kernel)."""
    del backend
    return causal_conv1d_reference(x, weight, bias, conv_state, slots, cu_q_lens, kv_lens,
                                   activation)
