"""Interleaved A/B of model steps: another checkout's XLA attention against this one's, or
two attention backends of this tree (`--backends xla,cpu`).

On a shared VM whose speed drifts by 20-50% within minutes, two processes run one after the
other do not compare: this script builds two runners in one process over the same weights,
one tracing the XLA attention of `--before` (a checkout, e.g. a `git worktree` of the base
revision), the other this tree's, checks that both give the same logits, and times their
model steps alternately (A B, B A, ...) on the same step, so drift hits both alike. A case
is `batch/context` (a decode step of `batch` requests at `context` tokens) or
`chunk+context` (one request's prefill chunk of `chunk` tokens after `context` computed);
batch <= 32, chunk <= 256, pages (ceil((context + 1) / 16) per request) <= 2047. The pool holds no
real context and every token is the same id, so the logits check is a sanity check that A
and B run the same model, not a test of either attention (the kernel tests are).

    git worktree add /tmp/before HEAD~1
    python scripts/ab_decode_step.py --before /tmp/before --cases 32/128,32/512,256+0,128+384
    python scripts/ab_decode_step.py --backends xla,cpu --cases 1/128,32/128,32/512
    python scripts/ab_decode_step.py --before /tmp/before --backend cpu --cases 256+384
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import numpy as np

import pallas_kernels.ops as ops
from jaxserve.bench.engine_run import make_llm
from jaxserve.bench.roofline import decode_output, decode_pages, prefill_output
from jaxserve.core.scheduler_output import SchedulerOutput
from models.default_model import default_model_path
from models.loaders import load_model, load_tokenizer
from models.model import Model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import interleaved_ms  # noqa: E402

XLA_FILE = "pallas_kernels/ragged_paged_attention/xla.py"
MAX_SEQS, MAX_TOKENS, NUM_PAGES = 32, 256, 2048  # the engine both runners get


def load_before(checkout: str):
    """The `ragged_paged_attention_xla` of another checkout (its other modules are ours)."""
    spec = importlib.util.spec_from_file_location("xla_before", os.path.join(checkout, XLA_FILE))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ragged_paged_attention_xla


def scheduled(case: str, page_size: int) -> SchedulerOutput:
    """The step of a case: `batch/context` decodes or a `chunk+context` prefill chunk."""
    if "+" in case:
        chunk, context = (int(x) for x in case.split("+"))
        out = prefill_output(chunk, context, page_size)
        if chunk > MAX_TOKENS or len(out.scheduled[0].page_ids) >= NUM_PAGES:
            raise ValueError(f"case {case}: a chunk of at most {MAX_TOKENS} tokens and "
                             f"{NUM_PAGES - 1} pages")
        return out
    batch, context = (int(x) for x in case.split("/"))
    if batch > MAX_SEQS or batch * decode_pages(context, page_size) >= NUM_PAGES:
        raise ValueError(f"case {case}: at most {MAX_SEQS} requests and {NUM_PAGES - 1} pages")
    return decode_output(batch, context, page_size)


def compiled_step(model, tok, attention, case: str):
    """[step fn, runner, device buffer, pool, logits] of one case's step, traced with
    `attention` as the XLA attention (None: the model's own backend)."""
    llm = make_llm(model, tok, max_model_len=1024, max_num_seqs=MAX_SEQS,
                   max_num_batched_tokens=MAX_TOKENS, num_kv_blocks=NUM_PAGES, warmup=False)
    runner = llm.engine.runner
    out = scheduled(case, runner.page_size)
    step = runner.prepare_model_step(out, decode_only=False)
    mine = ops.ragged_paged_attention_xla
    if attention is not None:  # read when the step is traced (first call)
        ops.ragged_paged_attention_xla = attention
    try:
        fn, dbuf = step.program, step.buf
        pool, logits, _ = step.run(runner.params, runner.kv_pages)
    finally:
        ops.ragged_paged_attention_xla = mine
    return [fn, runner, dbuf, pool, logits]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--before", help="checkout whose XLA attention is A")
    which.add_argument("--backends", help="A,B: two attention backends of this tree")
    ap.add_argument("--cases", default="32/128,32/512",
                    help="batch/context decode steps, chunk+context prefill chunks")
    ap.add_argument("--backend", default="xla", choices=("xla", "cpu"),
                    help="with --before: the backend A and B both run (cpu: decode rows "
                         "and short contexts on the C++ kernel, through either checkout's "
                         "XLA attention)")
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    path = default_model_path()
    tok = load_tokenizer(path)
    if args.backends:
        a, b = args.backends.split(",")
        models = {"A": load_model(path, "float32", backend=a)}
        models["B"] = Model(models["A"].cfg, models["A"].params, backend=b)
        attention = {"A": None, "B": None}
    else:
        # NOTE: the XLA backend (or the CPU one, which calls the same function) forced: on
        # a GPU/TPU "auto" is Pallas, which never calls the patched attention, so A and B
        # would be the same program.
        model = load_model(path, "float32", backend=args.backend)
        models = {"A": model, "B": model}
        attention = {"A": load_before(args.before), "B": ops.ragged_paged_attention_xla}
    for case in args.cases.split(","):
        steps = {k: compiled_step(models[k], tok, attention[k], case) for k in ("A", "B")}
        # NOTE: 2e-3 where the cpu backend runs: its prompt tokens' attention may take
        # another route in A than in B (kernel or tiles), which sums in another order, and
        # 30 layers take that to ~6e-4 on logits of magnitude ~10 (the kernel tests are the
        # exact check).
        tol = 2e-4 if args.before and args.backend == "xla" else 2e-3
        np.testing.assert_allclose(np.asarray(steps["A"][4]), np.asarray(steps["B"][4]),
                                   rtol=tol, atol=tol)
        times = interleaved_ms(steps, ["A", "B"], args.rounds)
        a, b = np.array(times["A"]), np.array(times["B"])
        print(f"{case}: A median {np.median(a):.1f} ms (min "
              f"{a.min():.1f}), B median {np.median(b):.1f} ms (min {b.min():.1f}); B / A "
              f"median {np.median(b) / np.median(a):.3f}, min {b.min() / a.min():.3f}; load "
              f"{os.getloadavg()[0]:.2f}", flush=True)
        del steps


if __name__ == "__main__":
    main()
