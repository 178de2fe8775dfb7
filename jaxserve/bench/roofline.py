"""Roofline of the decode step: this device's measured peaks vs the engine's decode steps.

Peak matmul FLOP/s and memory bandwidth are measured with JAX in the same run (so the
figures are ratios to this machine, CPU, GPU or TPU alike). For each batch size the
engine is brought to a steady decode state (every request past its prompt) and whole
decode steps are timed; model FLOPs and bytes per step come from the architecture:

    FLOPs = B * (2 * matmul params per token + 4 * context * Hq * D * layers)
    bytes = weights (read once per step) + B * context * KV bytes per token + KV written

MFU = FLOPs / step time / peak FLOP/s; bandwidth utilisation = bytes / step / peak bytes/s.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.engine_run import StepProbe
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.sampling_params import SamplingParams


def _times(fn, *args, iters: int) -> list[float]:
    """Seconds of `iters` calls of `fn(*args)` after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return times


def median_seconds(fn, *args, iters: int) -> float:
    """The median of `iters` calls of `fn(*args)` (after one that compiles), seconds."""
    return float(np.median(_times(fn, *args, iters=iters)))


def best_seconds(fn, *args, iters: int) -> float:
    """The shortest of `iters` calls of `fn(*args)` (after one that compiles), seconds."""
    return min(_times(fn, *args, iters=iters))


def measure_peaks(dtype: str = "float32", iters: int = 10) -> dict:
    """{"flops": matmul FLOP/s, "bytes_per_s": streaming read bytes/s, "device": ...}.

    Each is the best of `iters` runs: a peak is the most the machine does, and on a
    shared VM the median of 5 moved 2.5x within an hour (2026-12-03: matmul 202-500
    GFLOP/s, read 33-77 GB/s), taking every roofline ratio with it.

    NOTE: bandwidth is a read-only reduction over a resident array larger than the
    caches, which is what a decode step does with its weights. An elementwise op
    (`x * 1.5`, used until 2026-12-02) timed writing a fresh output buffer, page faults
    included: 1.3-6 GB/s on a VM that reads 44-60 GB/s, which made every roofline
    ratio look 7-10x better than it was.
    """
    on_cpu = jax.default_backend() == "cpu"
    n = 1024 if on_cpu else 8192
    a = jnp.ones((n, n), dtype)
    flops = 2 * n**3 / best_seconds(jax.jit(lambda x: x @ x), a, iters=iters)
    size = (512 if on_cpu else 2048) * 2**20 // jnp.dtype(dtype).itemsize
    big = jnp.ones((size,), dtype)
    sec = best_seconds(jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), big, iters=iters)
    return {"device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
            "jax": jax.__version__, "flops": flops, "bytes_per_s": big.nbytes / sec}


def model_costs(model, kv_dtype=None) -> dict:
    """Per-token matmul FLOPs and per-step byte terms of `model`'s decode, its KV pages of
    `kv_dtype` (default: what "auto" gives it, `Model.kv_dtype`; 8-bit pages count their
    codes alone)."""
    cfg = model.cfg
    h, d, layers = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    attn = h * cfg.num_heads * d * 2 + h * cfg.num_kv_heads * d * 2  # q, o, k, v
    mlp = 3 * h * cfg.intermediate_size
    matmul_params = layers * (attn + mlp) + h * cfg.vocab_size  # + LM head
    itemsize = np.dtype(model.kv_dtype if kv_dtype is None else kv_dtype).itemsize
    weight_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                       for x in jax.tree_util.tree_leaves(model.params))
    return {"matmul_flops_per_token": 2 * matmul_params,
            "attn_flops_per_ctx_token": 4 * cfg.num_heads * d * layers,
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": layers * 2 * cfg.num_kv_heads * d * itemsize}


def decode_step_figures(costs: dict, batch: int, context: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step of `batch` requests at `context` tokens."""
    flops = batch * (costs["matmul_flops_per_token"]
                     + costs["attn_flops_per_ctx_token"] * context)
    nbytes = (costs["weight_bytes"] + batch * context * costs["kv_bytes_per_token"]
              + batch * costs["kv_bytes_per_token"])
    return flops, nbytes


def decode_pages(context: int, page_size: int) -> int:
    """Pages one request of `decode_output` holds: its context and the new token."""
    return -(-(context + 1) // page_size)


def decode_output(batch: int, context: int, page_size: int) -> SchedulerOutput:
    """A synthetic decode step for the model program alone (profiles, A/B timings): `batch`
    requests, each one new token after `context` computed, on pages of its own from 1 up
    (`batch * decode_pages(context, page_size)` pages)."""
    pages = decode_pages(context, page_size)
    return SchedulerOutput(scheduled=[
        ScheduledRequest(f"r{i}", [5], context, list(range(1 + pages * i, 1 + pages * (i + 1))), 1)
        for i in range(batch)])


def prefill_output(chunk: int, context: int, page_size: int) -> SchedulerOutput:
    """A synthetic prefill step for the model program alone: one request's chunk of `chunk`
    tokens after `context` computed, on pages 1 up (`(chunk + context) // page_size + 1`)."""
    pages = list(range(1, (chunk + context) // page_size + 2))
    return SchedulerOutput(scheduled=[ScheduledRequest("r0", [5] * chunk, context, pages, 1)])


def measure_decode(engine, batch: int, context: int, num_steps: int = 5) -> dict:
    """Median decode-step seconds (whole step and the runner's part) at `batch` requests."""
    rng = np.random.default_rng(batch)
    ids = [f"roof{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": rng.integers(3, 30000, context).tolist()},
                           # NOTE: long enough that none ends while the last prompts fill
                           SamplingParams(max_tokens=engine.limits.max_model_len - context - 1,
                                          ignore_eos=True, temperature=0.0))
    sched = engine.scheduler
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        engine.step()
    steps = []
    with StepProbe(engine) as probe:
        for _ in range(num_steps):
            _, rec = probe.step(time.perf_counter())
            if rec is not None and rec.num_seqs == batch and rec.num_tokens == batch:
                steps.append(rec)
    engine.abort_request(ids)
    if not steps:
        raise RuntimeError(f"no pure decode step of batch {batch} was observed")
    return {"step_s": float(np.median([s.seconds for s in steps])),
            "execute_s": float(np.median([s.execute_s for s in steps]))}


def roofline_rows(engine, batches: list[int], context: int, peaks: dict,
                  num_steps: int = 5) -> list[dict]:
    """One row per batch size: step ms, tok/s, MFU, bandwidth use, and the roofline bound."""
    costs = model_costs(engine.model, engine.runner.kv_pages.dtype)
    rows = []
    for b in batches:
        m = measure_decode(engine, b, context, num_steps)
        flops, nbytes = decode_step_figures(costs, b, context + num_steps // 2)
        sec = m["execute_s"]
        bound = max(flops / peaks["flops"], nbytes / peaks["bytes_per_s"])
        rows.append({"batch": b, "context": context, "step_ms": 1000 * m["step_s"],
                     "execute_ms": 1000 * sec, "tok_per_s": b / m["step_s"],
                     "gflop_per_step": flops / 1e9, "mb_per_step": nbytes / 1e6,
                     "intensity": flops / nbytes,
                     "mfu": flops / sec / peaks["flops"],
                     "bw_util": nbytes / sec / peaks["bytes_per_s"],
                     "roofline_ms": 1000 * bound,
                     "bound": "compute" if flops / peaks["flops"] > nbytes / peaks["bytes_per_s"]
                     else "memory"})
    return rows
