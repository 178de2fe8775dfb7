"""Where a decode step's time goes: a thunk-level profile of the model program, by kind.

Builds the benchmark engine on the default model, runs one decode step of `--batch`
requests at `--context-len` tokens a few times under `jax.profiler`, and sums each XLA
kernel's self time (its time minus the kernels nested in it) over every thread, then
groups the kernels by kind: matmuls (YNNPACK/oneDNN/XNNPACK fusions), slices copied out
of the stacked layer weights (`dynamic-slice` fusions), gathers, other copies and
transposes, the rest. Thread time over XLA's worker threads adds up to more than the
wall time; the wall time is printed beside it, with the kernel count per step and how
much of the wall time at least one (two) kernels run.

    python scripts/profile_step.py --batch 32 --context-len 128

`--chunk N` profiles a prefill step instead: one request's chunk of N tokens after
`--context-len` tokens already computed.

    python scripts/profile_step.py --chunk 256 --context-len 0
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import tempfile
import time

import jax
import numpy as np

from jaxserve.bench.engine_run import make_llm
from jaxserve.bench.roofline import decode_output, prefill_output
from models.default_model import default_model_path
from models.loaders import load_model, load_tokenizer

KINDS = (("matmul", ("ynn_", "xnn_", "onednn")), ("layer weight slices", ("dynamic-slice",)),
         ("gathers", ("gather",)), ("copies / transposes", ("copy", "transpose")))


def kind_of(name: str) -> str | None:
    """The kind of an XLA kernel name, "rest" for other kernels, None for non-kernels."""
    if name.startswith(("$", "end:")) or "::" in name or name[:1].isupper():
        return None  # Python frames, runtime spans and the profiler's end markers
    for kind, marks in KINDS:
        if any(m in name for m in marks):
            return kind
    return "rest"


def trace_events(trace_dir: str) -> list[dict]:
    """The complete ("X") events of the trace under `trace_dir`."""
    path = sorted(glob.glob(f"{trace_dir}/plugins/profile/*/perfetto_trace.json.gz"))[-1]
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def busy_times(events: list[dict]) -> tuple[float, float, int]:
    """(us with at least one leaf kernel running, us with two or more, leaf kernel count):
    how much of the wall time XLA's threads spend in kernels at all, and in parallel
    (a leaf kernel has no kernel nested in it on its thread, unlike a while loop's span;
    a loop whose body ran on other threads counts as a leaf, so both figures are upper
    bounds)."""
    kernels = [e for e in events if kind_of(e["name"]) is not None]
    by_thread = collections.defaultdict(list)
    for e in kernels:
        by_thread[(e["pid"], e["tid"])].append(e)
    leaves = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        for e, nxt in zip(evs, evs[1:] + [None], strict=True):
            if nxt is None or nxt["ts"] >= e["ts"] + e["dur"]:
                leaves.append(e)  # the next event starts after this one ends: no child
    edges = sorted([(e["ts"], 1) for e in leaves] + [(e["ts"] + e["dur"], -1) for e in leaves])
    any_us = two_us = 0.0
    depth, last = 0, None
    for ts, d in edges:
        if last is not None:
            any_us += (ts - last) * (depth >= 1)
            two_us += (ts - last) * (depth >= 2)
        depth += d
        last = ts
    return any_us, two_us, len(leaves)


def self_times(events: list[dict]) -> collections.Counter:
    """Microseconds of self time per event name."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e["pid"], e["tid"])].append(e)
    out = collections.Counter()
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                out[stack[-1]["name"]] -= e["dur"]
            out[e["name"]] += e["dur"]
            stack.append(e)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context-len", type=int, default=128)
    p.add_argument("--chunk", type=int, default=0,
                   help="profile a prefill chunk of this many tokens (<= 256) instead")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=12, help="kernels listed by self time")
    p.add_argument("--attention-backend", default="auto", help="auto, xla, cpu or pallas")
    p.add_argument("--quantization", default="none",
                   help="weights: none (float32) or gguf (the GGUF's blocks in place)")
    args = p.parse_args()
    if args.chunk and (not 0 < args.chunk <= 256 or args.context_len + args.chunk > 1024):
        p.error("--chunk takes 1-256 tokens, with --context-len, at most 1024 in all")
    path = default_model_path()
    llm = make_llm(load_model(path, "float32", backend=args.attention_backend,
                              quantization=args.quantization),
                   load_tokenizer(path), max_model_len=1024,
                   max_num_seqs=max(32, args.batch), max_num_batched_tokens=256,
                   num_kv_blocks=2048)
    runner = llm.engine.runner
    if args.chunk:
        out = prefill_output(args.chunk, args.context_len, runner.page_size)
    else:
        out = decode_output(args.batch, args.context_len, runner.page_size)
    step = runner.prepare_model_step(out)

    def run():
        logits, _ = runner.run_model_step(step)
        jax.block_until_ready(logits)

    run()
    walls = []
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        for _ in range(args.steps):
            t = time.perf_counter()
            run()
            walls.append(time.perf_counter() - t)
        jax.profiler.stop_trace()
        events = trace_events(trace_dir)
    times = self_times(events)
    any_us, two_us, count = busy_times(events)
    per_step = {n: us / args.steps / 1000 for n, us in times.items()}
    kinds = collections.Counter()
    for name, ms in per_step.items():
        if (k := kind_of(name)) is not None:
            kinds[k] += ms
    what = f"chunk {args.chunk}" if args.chunk else f"batch {args.batch}"
    print(f"{what}, context {args.context_len}, bucket {step.num_tokens}: wall "
          f"{1000 * float(np.median(walls)):.1f} ms per step (median of {args.steps}, load "
          f"{os.getloadavg()[0]:.2f}); {count / args.steps:.0f} kernels per step, some kernel "
          f"running {any_us / args.steps / 1000:.1f} ms of it, two or more "
          f"{two_us / args.steps / 1000:.1f} ms; kernel self time summed over threads:\n")
    print("| kind | ms per step |\n|---|---:|")
    for k, ms in kinds.most_common():
        print(f"| {k} | {ms:.1f} |")
    print("\n| kernel | kind | ms per step |\n|---|---|---:|")
    kernels = [(n, ms) for n, ms in per_step.items() if kind_of(n) is not None]
    for name, ms in sorted(kernels, key=lambda x: -x[1])[:args.top]:
        print(f"| {name} | {kind_of(name)} | {ms:.2f} |")


if __name__ == "__main__":
    main()
