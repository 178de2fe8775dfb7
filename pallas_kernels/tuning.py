"""Tuned block sizes and thresholds of the kernels, one table per platform (the figures behind
each value are in BENCHMARKS.md, never in the code).

Values are read through `tuned(kernel, platform)`; a platform without its own entry takes
the defaults (`"*"`). Only the CPU has been measured so far: the GPU and TPU rows are the
defaults until a device session tunes them (`scripts/device_check.sh`).
"""

from __future__ import annotations

import jax

# {kernel: {platform: {setting: value}}}; "*" is the default for every platform.
TUNED: dict[str, dict[str, dict[str, int]]] = {
    # The XLA attention path (`ragged_paged_attention_xla`, backends "xla" and "cpu"):
    # tile sizes of its context and decode parts, and when the C++ decode kernel takes rows.
    # BENCHMARKS.md: "decode rows in groups, 64-key blocks", "decode rows in a C++ kernel
    # that reads the pool in place", "short prompts' tokens on the decode kernel".
    "ragged_xla": {
        "*": dict(block_kv=128, block_q=64, block_q_short=8, decode_block_kv=64,
                  decode_rows=32, cpu_decode_min_rows=1, cpu_context_max_len=768),
    },
    # The MLA XLA path (`mla_attention_xla`): the context pass's key blocks and query tiles,
    # the decode pass's key blocks and rows per iteration. Not yet measured (the GQA path's
    # sizes, its decode rows halved: a latent row is 576 values, a GQA head's 128).
    "mla_xla": {
        "*": dict(block_kv=128, block_q=32, decode_block_kv=64, decode_rows=16),
    },
    # The Pallas MLA kernels (`mla_attention_kernel`, `mla_attention_tpu`): query tokens per
    # program (its rows are these x the heads). Not yet measured on a device.
    "mla_pallas": {
        "*": dict(block_q=8),
    },
    # Batch-invariant mode (`pallas_kernels.invariant`): rows per matmul tile, and the
    # per-token attention's key block and token tile (BENCHMARKS.md, "batch-invariant mode").
    "batch_invariant": {
        "*": dict(row_tile=16, block_kv=64, token_tile=16),
    },
    # The Pallas kernels' key blocks (`kernel_tiles`): at least this many keys per inner
    # step, and a context split across programs from this many blocks on.
    "pallas_tiles": {
        "*": dict(min_block_keys=32, split_from_blocks=8, max_splits=4),
    },
    # The TPU ragged kernel's query tiles (mixed steps, and decode-only steps).
    "ragged_tpu": {
        "*": dict(block_q=16, decode_block_q=8),
    },
    # The Pallas gated delta rule (`gated_delta_rule_kernel`): tokens per chunk, and state
    # value columns per program (TPU: a whole 128-lane tile). Not yet measured on a device.
    "gated_delta": {
        "*": dict(chunk=64, block_v=64),
        "tpu": dict(block_v=128),
    },
    # The Pallas Mamba-2 scan (`ssd_kernel`): tokens per chunk, and state head-dim rows per
    # program (TPU: a whole 128-lane x tile, else the whole head). Not yet measured on a device.
    "ssd": {
        "*": dict(chunk=64, block_p=64),
        "tpu": dict(block_p=128),
    },
    # Smallest token bucket by attention backend: padded rows cost compute on the XLA
    # path, so decode batches of 1-8 get their own buckets there (BENCHMARKS.md, "decode
    # buckets of 4 and 8 tokens on the XLA path"); a Pallas step of 1 or 16 rows costs the
    # same on an accelerator.
    "min_bucket": {
        "*": dict(xla=4, cpu=4, pallas=16),
    },
    # The MoE layer's expert loop on the CPU (`models.moe._expert_loop`): rows per chunk,
    # about one expert's share of the step's (token, expert) pairs, rounded up to
    # `chunk_multiple`, at most `max_chunk` (BENCHMARKS.md, "MoE decode step").
    "moe_loop": {
        "*": dict(chunk_multiple=8, max_chunk=64),
    },
}


def tuned(kernel: str, platform: str | None = None) -> dict[str, int]:
    """The tuned settings of `kernel` on `platform` (default: JAX's default backend).

    Raises:
        KeyError: An unknown kernel name.
    """
    table = TUNED[kernel]
    platform = platform or jax.default_backend()
    return {**table["*"], **table.get(platform, {})}
