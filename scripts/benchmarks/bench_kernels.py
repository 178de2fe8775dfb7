"""Times each attention backend on given shapes and reports bytes/s and FLOP/s against peak.

The device's peak matmul FLOP/s and copy bandwidth are measured with JAX in the same run,
so the figures are ratios to this machine, whatever it is (CPU, GPU or TPU). On the CPU
the Pallas kernels run in the interpreter: their timings say nothing about GPU speed.

    python -m scripts.benchmarks.bench_kernels --num-seqs 8 --context-len 512 --q-len 1
    python -m scripts.benchmarks.bench_kernels --num-seqs 2 --context-len 512 --q-len 128
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.roofline import measure_peaks
from jaxserve.bench.roofline import median_seconds as bench
from jaxserve.utils import cdiv
from pallas_kernels import AttentionMetadata, ragged_paged_attention, write_kv
from pallas_kernels.ragged_paged_attention.kernel_tpu import ragged_paged_attention_tpu


def bench_in_place(fn, pool, *args, iters: int) -> float:
    """Like `bench` for a function whose first argument is donated and returned."""
    pool = jax.block_until_ready(fn(pool, *args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        pool = jax.block_until_ready(fn(pool, *args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def peaks(dtype, iters: int) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s) of the default device (the roofline's measurement)."""
    measured = measure_peaks(dtype, iters)
    return measured["flops"], measured["bytes_per_s"]


def build(args, rng):
    """Pool, metadata and queries for `num_seqs` requests of `q_len` new tokens each."""
    ps, dtype = args.page_size, jnp.dtype(args.dtype)
    pages_per_seq = cdiv(args.context_len, ps)
    num_pages = args.num_seqs * pages_per_seq + 1
    tables = rng.permutation(np.arange(1, num_pages)).reshape(args.num_seqs, pages_per_seq)
    kv_lens = np.full(args.num_seqs, args.context_len, np.int32)
    q_lens = np.full(args.num_seqs, args.q_len, np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    pos = np.concatenate([np.arange(k - q, k) for q, k in zip(q_lens, kv_lens, strict=True)])
    seq = np.repeat(np.arange(args.num_seqs), q_lens)
    slots = (tables[seq, pos // ps] * ps + pos % ps).astype(np.int32)
    md = AttentionMetadata(jnp.asarray(slots), jnp.asarray(tables, jnp.int32),
                           jnp.asarray(kv_lens), jnp.asarray(cu), decode_only=args.q_len == 1)
    shape = (1, 2, args.num_kv_heads, num_pages, ps, args.head_dim)
    kv_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    q = jnp.asarray(rng.standard_normal((len(slots), args.num_q_heads, args.head_dim)), dtype)
    return q, kv_pages, md


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=8)
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--q-len", type=int, default=1, help="new tokens per request (1: decode)")
    p.add_argument("--num-q-heads", type=int, default=9)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--backends", default="xla,pallas",
                   help="comma list of xla, pallas, tpu-interpret")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    if args.q_len > args.context_len:
        p.error("--q-len must not exceed --context-len")

    q, kv_pages, md = build(args, np.random.default_rng(0))
    itemsize = jnp.dtype(args.dtype).itemsize
    pairs = sum(sum(min(k, k - args.q_len + i + 1) for i in range(args.q_len))
                for k in [args.context_len] * args.num_seqs)  # unmasked (query, key) pairs
    attn_flops = 4 * pairs * args.num_q_heads * args.head_dim
    attn_bytes = (args.num_seqs * args.context_len * 2 * args.num_kv_heads * args.head_dim
                  + 2 * q.size) * itemsize
    new_kv = jnp.zeros((q.shape[0], args.num_kv_heads, args.head_dim), args.dtype)
    write_bytes = 2 * new_kv.nbytes * 2  # read new K/V, write them

    flops_peak, bw_peak = peaks(args.dtype, args.iters)
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax "
          f"{jax.__version__}; peak matmul {flops_peak / 1e9:.1f} GFLOP/s, copy "
          f"{bw_peak / 1e9:.1f} GB/s")
    print(f"shape: {args.num_seqs} seqs x {args.q_len} new tokens, context {args.context_len}, "
          f"Hq={args.num_q_heads} Hkv={args.num_kv_heads} D={args.head_dim} "
          f"page={args.page_size} {args.dtype}")
    print(f"{'kernel':<26}{'backend':<9}{'ms':>9}{'GB/s':>9}{'%bw':>7}{'GFLOP/s':>10}"
          f"{'%peak':>7}")
    for backend in args.backends.split(","):
        if backend == "tpu-interpret":  # the Mosaic kernel in the TPU interpreter (CPU only)
            attn = jax.jit(lambda q, kv, md: ragged_paged_attention_tpu(
                q, kv, 0, md, sm_scale=args.head_dim ** -0.5, interpret=True))
            sec = bench(attn, q, kv_pages, md, iters=max(1, args.iters // 2))
            print(f"{'ragged_paged_attention':<26}{backend:<9}{sec * 1e3:9.3f}"
                  f"{attn_bytes / sec / 1e9:9.2f}{100 * attn_bytes / sec / bw_peak:6.1f}%"
                  f"{attn_flops / sec / 1e9:10.2f}{100 * attn_flops / sec / flops_peak:6.1f}%")
            continue
        attn = jax.jit(lambda q, kv, md, b=backend: ragged_paged_attention(
            q, kv, 0, md, sm_scale=args.head_dim ** -0.5, backend=b))
        kvw = jax.jit(lambda kv, k, s, b=backend: write_kv(kv, 0, k, k, s, backend=b),
                      donate_argnums=0)
        name = "paged_decode" if md.decode_only else "ragged_paged"
        for label, sec, nbytes, flops in (
                (f"{name}_attention", bench(attn, q, kv_pages, md, iters=args.iters),
                 attn_bytes, attn_flops),
                ("kv_write", bench_in_place(kvw, jnp.copy(kv_pages), new_kv, md.slot_mapping,
                                            iters=args.iters),
                 write_bytes, 0)):
            gbs, gfs = nbytes / sec / 1e9, flops / sec / 1e9
            print(f"{label:<26}{backend:<9}{sec * 1e3:9.3f}{gbs:9.2f}"
                  f"{100 * nbytes / sec / bw_peak:6.1f}%{gfs:10.2f}"
                  f"{100 * flops / sec / flops_peak:6.1f}%")


if __name__ == "__main__":
    main()
