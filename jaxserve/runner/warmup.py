"""Warm-up of a `ModelRunner`: every program a step can run, compiled on a thread per core.

A step runs one of a few programs per token bucket (the model step, the decode-only step
on Pallas, prompt logprobs, three sampler variants; with a `max_logprobs` above 20, a wide
prompt-logprobs and "full" sampler program too), and three KV plan programs run page
copies and swaps (two more move a linear-attention model's state rows). Compiled one after
another, they leave the other cores of a many-core host idle. So warm-up first *lowers*
every program on this thread (tracing holds the GIL) and hands each lowered program to a
thread pool that compiles it (compiling releases the GIL); a program compiles while the
next one is traced. (On this project's 2-vCPU machine the gain is small: two compiles side
by side each take ~2x as long.) `jit(f).lower(args).compile()` fills the cache that
`jit(f)(args)` reads, so the second pass, which runs every program once on dummy inputs
(as warm-up always did), compiles nothing it does not have to.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
from tqdm import tqdm

from jaxserve.core.plans import CopyPlan, KVPlans, StatePlans, SwapPlan
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxserve.runner.buckets import rows_for_bucket
from jaxserve.runner.kv_ops import PLAN_PAIRS, copy_pages, gather_pages, scatter_pages
from jaxserve.runner.sampler_variants import VARIANTS
from jaxserve.runner.state_pool import STATE_PAIRS, gather_rows, scatter_rows, state_arrays
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


def lower_bucket(runner, num_tokens: int, make_dummy_sampling) -> list:
    """The lowered programs of one token bucket."""
    lowered, steps, programs = [], [], runner.programs
    for out, decode_only in dummy_steps(runner, num_tokens):
        step = runner.prepare_model_step(out, decode_only)
        lowered.append(step.lower(runner.params, runner.kv_pages))
        steps.append(step)
    _, logits, hidden, *_ = lowered[0].out_info
    if runner.pooling_type is not None:  # a pooling runner's program, per step layout
        lowered += [programs.pool(step.layout, runner.pooling_type).lower(hidden, step.buf)
                    for step in steps]
    # NOTE: the step's tokens: the bucket, or every rank's block of it (data-parallel
    # attention).
    total = steps[0].num_tokens
    targets = runner.to_device(np.zeros(total, np.int32))
    lowered += [programs.prompt_logprobs(width).lower(runner.params, hidden, targets)
                for width in prompt_logprobs_widths(runner)]
    dummy = make_dummy_sampling(runner.sample_rows(total))
    for md, variant in sampler_variants(runner, dummy):
        buf, layout = runner.sampling_inputs(md, variant)
        lowered.append(programs.sampler(layout).lower(logits, runner.to_device(buf)))
    return lowered


def prompt_logprobs_widths(runner) -> tuple[int, ...]:
    """The prompt-logprobs programs' widths to compile: none for a pooling runner (its
    requests ask for no logprobs; the wide width's top-k took minutes of XLA's constant
    folding to compile), else every width the engine serves."""
    return () if runner.pooling_type is not None else tuple(runner.logprobs_widths)


def sampler_variants(runner, dummy) -> list[tuple]:
    """(sampling metadata, variant) pairs covering every sampler program of a bucket: each
    variant on `dummy` (all-padding rows), and "full" at the wide top-logprobs width too
    when the engine has one (its `max_logprobs` is above MAX_LOGPROBS)."""
    if runner.pooling_type is not None:  # pooling steps sample nothing: the cheapest
        return [(dummy, VARIANTS[0])]
    pairs = [(dummy, variant) for variant in VARIANTS]
    if runner.wide_logprobs is not None:
        pairs.append((dataclasses.replace(dummy, max_num_logprobs=runner.wide_logprobs),
                      "full"))
    return pairs


def _lower_plans(runner) -> list:
    pages = runner.page_pool
    lowered = [copy_pages.lower(pages, jax.device_put(NULL_PAIRS))]
    if runner.swap.num_slots:
        ids = jax.device_put(NULL_PAIRS[:, 0])  # i32[PLAN_PAIRS]
        gather = gather_pages.lower(pages, ids)
        lowered += [gather, scatter_pages.lower(pages, ids, gather.out_info)]
    states = state_arrays(runner.kv_pages)
    if states:  # the state plans' two programs (copies and swaps share them)
        rows = jax.device_put(np.zeros(STATE_PAIRS, np.int32))  # i32[STATE_PAIRS]
        gather = gather_rows.lower(states, rows)
        lowered += [gather, scatter_rows.lower(states, rows, gather.out_info)]
    return lowered


def compile_ahead(runner, make_dummy_sampling, threads: int,
                  progress: Callable[[int, int], None]) -> None:
    """Lowers every warm-up program here and compiles them on `threads` threads.

    `progress(done, total)` counts a bucket once all its programs are compiled (they
    may finish in any order); it is called on the compiler threads.
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
                progress(done[0], total)

    with ThreadPoolExecutor(threads, thread_name_prefix="jaxserve-compile") as pool:
        futures = []
        for num_tokens in runner.buckets:
            lowered = lower_bucket(runner, num_tokens, make_dummy_sampling)
            left[num_tokens] = len(lowered)
            for program in lowered:
                futures.append(pool.submit(program.compile))
                futures[-1].add_done_callback(lambda _, n=num_tokens: finished(n))
        futures += [pool.submit(lowered.compile) for lowered in _lower_plans(runner)]
        for f in futures:
            f.result()  # re-raises a compile error here


def plan_warmup(num_swap_slots: int, state_slots: bool = False) -> KVPlans:
    """KV plans that run every plan program once on the null page: a copy of it onto
    itself and, with swap slots, the real swap path out to scratch slots -1..-n and back
    in; with `state_slots` (a state group) the same on the null state slot."""
    copy = CopyPlan([(0, 0)] * PLAN_PAIRS)
    state = StatePlans(copy=CopyPlan([(0, 0)] * STATE_PAIRS)) if state_slots else StatePlans()
    if not num_swap_slots:
        return KVPlans(copy=copy, state=state)
    scratch = [(0, -1 - i) for i in range(PLAN_PAIRS)]
    if state_slots:
        rows = [(0, -1 - i) for i in range(STATE_PAIRS)]
        state = StatePlans(swap_out=SwapPlan(rows, to_host=True), copy=state.copy,
                           swap_in=SwapPlan([(h, s) for s, h in rows], to_host=False))
    return KVPlans(swap_out=SwapPlan(scratch, to_host=True),
                   swap_in=SwapPlan([(slot, page) for page, slot in scratch], to_host=False),
                   copy=copy, state=state)


def run_warmup(runner, make_dummy_sampling, threads: int | None = None,
               progress: Callable[[int, int], None] | None = None) -> float:
    """Compiles (ahead, on threads) and runs once every program of `runner`.

    Args:
        runner: The `ModelRunner` (through its public members: its buckets and sizes,
            `prepare_model_step`, `run_model_step`, `programs`, `execute_plans`).
        make_dummy_sampling: `num_rows -> SamplingMetadata` of all-padding rows.
        threads: Compiler threads; None: `compile_threads()`.
        progress: `(buckets compiled, buckets in all)`, called as buckets finish.

    Returns:
        Seconds spent.
    """
    start = time.perf_counter()
    progress = progress or (lambda done, total: None)
    total = len(runner.buckets)
    progress(0, total)
    threads = compile_threads() if threads is None else threads
    if threads > 1:
        compile_ahead(runner, make_dummy_sampling, threads, progress)
    for done, num_tokens in enumerate(tqdm(runner.buckets, desc="jaxserve warm-up",
                                           unit="bucket")):
        if threads == 1:
            progress(done, total)
        run_bucket(runner, num_tokens, make_dummy_sampling)
    runner.execute_plans(plan_warmup(runner.swap.num_slots, runner.num_state_slots > 0))
    if runner.lora is not None:  # the slot-writing program, on an empty slot
        runner.lora.write(0, None)
    progress(total, total)
    return time.perf_counter() - start


def run_bucket(runner, num_tokens: int, make_dummy_sampling) -> None:
    """Runs bucket `num_tokens`'s programs once on dummy inputs: one model step; the
    prompt-logprobs program and every sampler variant on its outputs (running the model
    once per variant cost ~7 s more cold); the bucket's decode program, if it has one."""
    (out, decode_only), *decodes = dummy_steps(runner, num_tokens)
    programs = runner.programs
    step = runner.prepare_model_step(out, decode_only)
    num_tokens = step.num_tokens  # every rank's block under data-parallel attention
    num_sample_rows = runner.sample_rows(num_tokens)
    logits, hidden = runner.run_model_step(step)
    if runner.pooling_type is not None:
        jax.block_until_ready(programs.pool(step.layout, runner.pooling_type)(hidden,
                                                                               step.buf))
    for width in prompt_logprobs_widths(runner):
        jax.block_until_ready(programs.prompt_logprobs(width)(
            runner.params, hidden, runner.to_device(np.zeros(num_tokens, np.int32))))
    for md, variant in sampler_variants(runner, make_dummy_sampling(num_sample_rows)):
        buf, layout = runner.sampling_inputs(md, variant)
        jax.block_until_ready(programs.sampler(layout)(logits, runner.to_device(buf)))
    for decode, _ in decodes:  # its own program (`execute` runs its pooling program too)
        runner.execute(decode, make_dummy_sampling(num_sample_rows), VARIANTS[0])
