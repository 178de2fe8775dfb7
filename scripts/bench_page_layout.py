"""What the place of a request's pages in the pool costs a decode step: one backend's model
step on the same batch with its block tables laid out contiguously, interleaved, in runs,
or shuffled.

The cpu backend's decode kernel reads each row's pages where they lie, so how they are
spread decides how well the CPU's prefetchers and TLB serve it. Layouts (each row holds
`ceil((context + 1) / 16)` pages out of the same set of page ids):

* contig: row i holds one contiguous range (what a prompt allocated in one go gets);
* interleaved: page j of row i is `j * batch + i` (rows that grew one page at a time in
  lockstep, as decoding rows do when all take their next page from the free list);
* runsK: runs of K contiguous pages in a random order;
* shuffled: every page id at random (a pool churned for a long time).

All layouts run in one process on one runner, interleaved (A B C D, D C B A, ...), so a
drifting VM hits them alike; the medians and minimums over `--rounds` are printed.

    python scripts/bench_page_layout.py --cases 32/128,32/512
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from jaxserve.bench.engine_run import make_llm
from jaxserve.bench.roofline import decode_pages
from jaxserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from models.default_model import default_model_path
from models.loaders import load_model, load_tokenizer

MAX_SEQS, MAX_TOKENS, NUM_PAGES = 32, 256, 2048


def page_ids(layout: str, batch: int, pages: int, seed: int = 0) -> np.ndarray:
    """i64[batch, pages]: each row's page ids under `layout` (ids 1 .. batch * pages)."""
    ids = np.arange(1, 1 + batch * pages)
    rng = np.random.default_rng(seed)
    if layout == "contig":
        return ids.reshape(batch, pages)
    if layout == "interleaved":
        return ids.reshape(pages, batch).T
    if layout == "shuffled":
        return rng.permutation(ids).reshape(batch, pages)
    if layout.startswith("runs") and layout[4:].isdigit() and int(layout[4:]) > 0:
        k = int(layout[4:])
        if ids.size % k:
            raise ValueError(f"layout {layout}: {ids.size} pages are not runs of {k}")
        runs = ids.reshape(-1, k)
        return runs[rng.permutation(len(runs))].reshape(batch, pages)
    raise ValueError(f"unknown layout {layout!r} (contig, interleaved, shuffled, runsK)")


def decode_step(batch: int, context: int, page_size: int, layout: str) -> SchedulerOutput:
    """A decode step of `batch` requests at `context` tokens with pages laid out by `layout`."""
    tables = page_ids(layout, batch, decode_pages(context, page_size))
    return SchedulerOutput(scheduled=[ScheduledRequest(f"r{i}", [5], context, t.tolist(), 1)
                                      for i, t in enumerate(tables)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="32/128,32/512", help="batch/context decode steps")
    ap.add_argument("--layouts", default="contig,interleaved,runs4,shuffled")
    ap.add_argument("--attention-backend", default="cpu")
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    path = default_model_path()
    model = load_model(path, "float32", backend=args.attention_backend)
    llm = make_llm(model, load_tokenizer(path), max_model_len=1024, max_num_seqs=MAX_SEQS,
                   max_num_batched_tokens=MAX_TOKENS, num_kv_blocks=NUM_PAGES, warmup=False)
    runner = llm.engine.runner
    layouts = args.layouts.split(",")
    pool = runner.kv_pages
    print("| case | load avg | " + " | ".join(f"{name} ms (min)" for name in layouts)
          + " | " + " | ".join(f"{name} / {layouts[0]}" for name in layouts[1:]) + " |")
    for case in args.cases.split(","):
        batch, context = (int(x) for x in case.split("/"))
        if batch > MAX_SEQS or batch * decode_pages(context, runner.page_size) >= NUM_PAGES:
            raise ValueError(f"case {case}: at most {MAX_SEQS} requests and "
                             f"{NUM_PAGES - 1} pages")
        steps = {}
        for name in layouts:
            step = runner.prepare_model_step(
                decode_step(batch, context, runner.page_size, name), decode_only=False)
            steps[name] = (step.program, step.buf)
        times = {name: [] for name in layouts}
        for i in range(args.rounds + 2):  # two untimed rounds first
            for name in layouts if i % 2 == 0 else layouts[::-1]:
                fn, dbuf = steps[name]
                t = time.perf_counter()
                pool, logits, _ = fn(runner.params, pool, dbuf, runner.no_prev_ids)
                logits.block_until_ready()
                if i >= 2:
                    times[name].append(1e3 * (time.perf_counter() - t))
        med = {name: float(np.median(v)) for name, v in times.items()}
        cells = [f"{med[n]:.1f} ({min(times[n]):.1f})" for n in layouts]
        ratios = [f"{med[n] / med[layouts[0]]:.2f}" for n in layouts[1:]]
        print(f"| {case} | {os.getloadavg()[0]:.2f} | " + " | ".join(cells + ratios) + " |",
              flush=True)


if __name__ == "__main__":
    main()
