"""Warm-up of a `ModelRunner`: every program a step can run, compiled on a thread per core.

A step runs one of a few programs per token bucket (the model step, the decode-only step
on Pallas, prompt logprobs, three sampler variants), and three KV plan programs run
page copies and swaps. Compiled one after another, they leave the other cores of a
many-core host idle. So warm-up first *lowers* every program on this thread (tracing holds
the GIL) and hands each lowered program to a thread pool that compiles it (compiling
releases the GIL); a program compiles while the next one is traced. (On this project's
2-vCPU machine the gain is small: two compiles side by side each take ~2x as long.)
`jit(f).lower(args).compile()` fills the cache that `jit(f)(args)` reads, so the second
pass, which runs every program once on dummy inputs (as warm-up always did), compiles
nothing it does not have to.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from tqdm import tqdm

from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.runner.buckets import rows_for_bucket
from jaxserve.runner.kv_ops import (
    PLAN_PAIRS,
    copy_page_pairs,
    copy_pages,
    gather_pages,
    scatter_pages,
)
from jaxserve.runner.sampler_variants import VARIANTS
from jaxserve.utils import cdiv

# Most compiler threads: beyond a few, programs wait on memory bandwidth and each other.
MAX_COMPILE_THREADS = 8
# i32[PLAN_PAIRS, 2]: the null page onto itself, a no-op plan piece for warm-up.
NULL_PAIRS = np.zeros((PLAN_PAIRS, 2), np.int32)


def compile_threads() -> int:
    """Threads warm-up compiles on: the cores this process may use, at most 8
    (`JAXSERVE_COMPILE_THREADS` overrides; 1 compiles in the warm-up pass itself)."""
    env = os.environ.get("JAXSERVE_COMPILE_THREADS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"JAXSERVE_COMPILE_THREADS={env!r}: expected a positive integer")
        return int(env)
    return max(1, min(MAX_COMPILE_THREADS, len(os.sched_getaffinity(0))))


def dummy_steps(runner, num_tokens: int) -> list[tuple[SchedulerOutput, bool]]:
    """(step, runs the decode program) pairs that warm bucket `num_tokens` up: one step
    of dummy requests of at most max_model_len tokens each (a bucket may be larger than
    one block table), all in the null page, and a step of one-token requests where the
    bucket runs its own decode program."""
    num_rows = rows_for_bucket(num_tokens, runner.max_num_seqs)
    cap = runner.max_pages_per_seq * runner.page_size
    sizes = [min(cap, num_tokens - start) for start in range(0, num_tokens, cap)]
    others = runner.num_kv_groups - 1  # a hybrid KV cache: null tables of groups 1.. too

    def entry(request_id: str, n: int, num_samples: int) -> ScheduledRequest:
        pages = [0] * cdiv(n, runner.page_size)
        return ScheduledRequest(request_id, [0] * n, 0, pages, num_samples,
                                group_pages=((0, pages),) * others)

    out = SchedulerOutput(scheduled=[entry(f"warmup-{i}", n, int(i == 0))
                                     for i, n in enumerate(sizes[:num_rows])])
    decodes = SchedulerOutput(scheduled=[entry(f"warmup-d{i}", 1, 1)
                                         for i in range(num_rows)])
    steps = [(out, runner.is_decode_step(out, num_tokens, num_rows))]
    if runner.is_decode_step(decodes, num_tokens, num_rows):
        steps.append((decodes, True))
    return steps


def _lower_bucket(runner, num_tokens: int, make_dummy_sampling) -> list:
    """The lowered programs of one token bucket."""
    lowered, pools = [], []
    for step, decode_only in dummy_steps(runner, num_tokens):
        _, buf, layout, _, _ = runner._model_inputs(step, None)
        lowered.append(runner._step_fn(layout, decode_only).lower(
            runner.params, runner.kv_pages, runner._to_device(buf), runner._no_prev_ids,
            runner.lora_stacks))
        pools.append((layout, runner._to_device(buf)))
    _, logits, hidden = lowered[0].out_info
    if runner.pooling_type is not None:  # a pooling runner's program, per step layout
        lowered += [runner._pool_fn(layout).lower(hidden, buf) for layout, buf in pools]
    lowered.append(runner._prompt_fn().lower(
        runner.params, hidden, runner._to_device(np.zeros(num_tokens, np.int32))))
    dummy = make_dummy_sampling(runner.sample_rows(num_tokens))
    for variant in VARIANTS:
        buf, layout = runner._sample_inputs(dummy, variant)
        lowered.append(runner._sampler_fn(layout).lower(logits, runner._to_device(buf)))
    return lowered


def _lower_plans(runner) -> list:
    lowered = [copy_pages.lower(runner.kv_pages, jax.device_put(NULL_PAIRS))]
    if runner.swap.num_slots:
        ids = jax.device_put(NULL_PAIRS[:, 0])  # i32[PLAN_PAIRS]
        gather = gather_pages.lower(runner.kv_pages, ids)
        lowered += [gather, scatter_pages.lower(runner.kv_pages, ids, gather.out_info)]
    return lowered


def compile_ahead(runner, make_dummy_sampling, threads: int) -> None:
    """Lowers every warm-up program here and compiles them on `threads` threads.

    `runner.warmup_progress` counts a bucket once all its programs are compiled (they
    may finish in any order).
    """
    total = len(runner.buckets)
    lock = threading.Lock()
    left: dict[int, int] = {}  # bucket -> its programs not compiled yet
    done = [0]

    def finished(num_tokens: int) -> None:
        with lock:  # callbacks run on the compiler threads
            left[num_tokens] -= 1
            if left[num_tokens] == 0:
                done[0] += 1
                runner.warmup_progress = (done[0], total)

    with ThreadPoolExecutor(threads, thread_name_prefix="jaxserve-compile") as pool:
        futures = []
        for num_tokens in runner.buckets:
            lowered = _lower_bucket(runner, num_tokens, make_dummy_sampling)
            left[num_tokens] = len(lowered)
            for program in lowered:
                futures.append(pool.submit(program.compile))
                futures[-1].add_done_callback(lambda _, n=num_tokens: finished(n))
        futures += [pool.submit(lowered.compile) for lowered in _lower_plans(runner)]
        for f in futures:
            f.result()  # re-raises a compile error here


def run_warmup(runner, make_dummy_sampling, threads: int | None = None) -> float:
    """Compiles (ahead, on threads) and runs once every program of `runner`.

    Args:
        runner: The `ModelRunner`.
        make_dummy_sampling: `num_rows -> SamplingMetadata` of all-padding rows.
        threads: Compiler threads; None: `compile_threads()`.

    Returns:
        Seconds spent.
    """
    start = time.perf_counter()
    total = len(runner.buckets)
    runner.warmup_progress = (0, total)
    threads = compile_threads() if threads is None else threads
    if threads > 1:
        compile_ahead(runner, make_dummy_sampling, threads)
    for done, num_tokens in enumerate(tqdm(runner.buckets, desc="jaxserve warm-up",
                                           unit="bucket")):
        if threads == 1:
            runner.warmup_progress = (done, total)
        _run_bucket(runner, num_tokens, make_dummy_sampling)
    runner.kv_pages = copy_page_pairs(runner.kv_pages, NULL_PAIRS)
    if runner.lora is not None:  # the slot-writing program, on an empty slot
        runner.lora.write(0, None)
    if runner.swap.num_slots:
        # The real swap path, on the null page: out to scratch slots -1..-n, back in.
        scratch = NULL_PAIRS.copy()
        scratch[:, 1] = -1 - np.arange(PLAN_PAIRS)
        runner.swap.swap_out(runner.kv_pages, scratch)
        runner.kv_pages = runner.swap.swap_in(runner.kv_pages, scratch[:, ::-1])
    runner.warmup_progress = (total, total)
    return time.perf_counter() - start


def _run_bucket(runner, num_tokens: int, make_dummy_sampling) -> None:
    """One model step; the prompt-logprobs program and every sampler variant on its
    outputs (running the model once per variant cost ~7 s more cold)."""
    (out, decode_only), *decodes = dummy_steps(runner, num_tokens)
    num_sample_rows = runner.sample_rows(num_tokens)
    _, model_buf, model_layout, _, _ = runner._model_inputs(out, None)
    model_buf = runner._to_device(model_buf)
    runner.kv_pages, logits, hidden = runner._step_fn(model_layout, decode_only)(
        runner.params, runner.kv_pages, model_buf, runner._no_prev_ids, runner.lora_stacks)
    if runner.pooling_type is not None:
        jax.block_until_ready(runner._pool_fn(model_layout)(hidden, model_buf))
    jax.block_until_ready(runner._prompt_fn()(
        runner.params, hidden, runner._to_device(np.zeros(num_tokens, np.int32))))
    for variant in VARIANTS:
        buf, layout = runner._sample_inputs(make_dummy_sampling(num_sample_rows), variant)
        jax.block_until_ready(runner._sampler_fn(layout)(logits, runner._to_device(buf)))
    for step, _ in decodes:  # its own program (`execute` runs its pooling program too)
        runner.execute(step, make_dummy_sampling(num_sample_rows), VARIANTS[0])
