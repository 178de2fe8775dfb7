"""`jaxserve bench ...` and `jaxserve diagnose`: argument parsing and the command handlers.

Each benchmark command prints its table(s) and can save the full results as JSON
(`--output-json`) and plots (`--plot-dir`, needs the `bench` extra: matplotlib).
"""

from __future__ import annotations

import argparse
import logging
import sys

from jaxserve.config import SCHEDULING_MODES

# Engine settings the benchmarks use unless a flag overrides them: sized for a 2-core CPU
# and SmolLM2-135M (see BENCHMARKS.md). On the CPU the attention backend is "pallas" (the
# interpreted kernels beat the "xla" reference on whole steps there); elsewhere "auto".
BENCH_ENGINE_DEFAULTS = {"max_model_len": 1024, "max_num_seqs": 32,
                         "max_num_batched_tokens": 256, "num_kv_blocks": 1024}


def _add_trace_args(p: argparse.ArgumentParser, default: str = "mixed",
                    num: int = 32) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default=default,
                   help="mixed, synthetic, shared-prefix, or a JSONL file from save_trace "
                        f"(default {default})")
    g.add_argument("--num-requests", type=int, default=num)
    g.add_argument("--input-len", type=int, default=128, help="synthetic: mean prompt length")
    g.add_argument("--output-len", type=int, default=64, help="synthetic: mean output length")
    g.add_argument("--dist", default="uniform",
                   help="synthetic: fixed, uniform, normal or lognormal lengths")
    g.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals/s (default: all at once)")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: prefix tokens")
    g.add_argument("--save-trace", default=None, help="also write the trace as JSONL here")


def make_trace(args):
    """The trace the workload flags describe."""
    from jaxserve.bench import workloads as w

    n, rate = args.num_requests, args.request_rate
    seed = getattr(args, "seed", None) or 0  # --seed (an engine flag) also seeds the trace
    if args.trace == "mixed":
        trace = w.mixed_trace(n, rate=rate, seed=seed)
    elif args.trace == "synthetic":
        spread = 0 if args.dist == "fixed" else 0.5
        trace = w.synthetic_trace(n, prompt_dist=args.dist, prompt_mean=args.input_len,
                                  prompt_spread=args.input_len * spread,
                                  output_dist=args.dist, output_mean=args.output_len,
                                  output_spread=args.output_len * spread, rate=rate,
                                  seed=seed)
    elif args.trace == "shared-prefix":
        trace = w.shared_prefix_trace(n, prefix_len=args.prefix_len, rate=rate, seed=seed)
    else:
        trace = w.load_trace(args.trace)
    if args.save_trace:
        w.save_trace(args.save_trace, trace)
    return trace


def _add_engine_group(p: argparse.ArgumentParser) -> None:
    from jaxserve.entrypoints.cli import add_engine_args

    add_engine_args(p, positional_model=False)
    p.add_argument("--output-json", default=None, help="write the full results here")


def bench_engine_args(args, **overrides) -> dict:
    """Engine kwargs: the benchmark defaults, then the flags given, then `overrides`."""
    import jax

    from jaxserve.entrypoints.cli import engine_kwargs

    kw = engine_kwargs(args)
    kw.pop("model")
    backend = "pallas" if jax.default_backend() == "cpu" else "auto"
    return {**BENCH_ENGINE_DEFAULTS, "attention_backend": backend, **kw, **overrides}


def load_model_and_tokenizer(args):
    """(model, tokenizer, path of the weights) from `--model` / `--dtype`."""
    from models.default_model import default_model_path
    from models.loaders import load_model, load_tokenizer

    path = args.model or default_model_path()
    return load_model(path, args.dtype or "float32"), load_tokenizer(path), path


def _plot(args, fn, *a) -> None:
    if getattr(args, "plot_dir", None):
        try:
            for path in fn(*a, args.plot_dir):
                print(f"wrote {path}")
        except ImportError:
            print("plots need matplotlib: pip install -e '.[bench]'", file=sys.stderr)


# ------------------------------------------------------------------ handlers
def cmd_throughput(args) -> int:
    from jaxserve.bench.report import dump_json
    from jaxserve.bench.throughput import compare_modes, format_modes

    trace = make_trace(args)
    model, tok, path = load_model_and_tokenizer(args)
    hf = None
    if args.baseline == "transformers":
        from jaxserve.bench.hf_baseline import load_hf_model

        hf = load_hf_model(path, args.dtype or "float32")
    modes = args.modes.split(",")
    eargs = bench_engine_args(args)
    print(f"trace {args.trace}: {len(trace)} requests, {sum(r.prompt_len for r in trace)} "
          f"prompt + {sum(r.output_len for r in trace)} output tokens; engine {eargs}")
    res = compare_modes(model, tok, trace, modes, eargs, hf_model=hf,
                        hf_batch_size=args.hf_batch_size)
    ref = "static" if "static" in res else modes[0]
    print()
    print(format_modes(res, ref))
    dump_json(args.output_json, {"engine_args": eargs, "results": res})
    from jaxserve.bench import plots

    _plot(args, plots.plot_modes, res)
    return 0


def cmd_prefix(args) -> int:
    from jaxserve.bench.report import dump_json
    from jaxserve.bench.throughput import compare_prefix_caching, format_prefix

    trace = make_trace(args)
    model, tok, _ = load_model_and_tokenizer(args)
    eargs = bench_engine_args(args)
    res = compare_prefix_caching(model, tok, trace, eargs)
    print()
    print(format_prefix(res))
    dump_json(args.output_json, {"engine_args": eargs, "results": res})
    return 0


def build_bench_parser(sub) -> None:
    """Adds `bench` (with its subcommands) and `diagnose` to the `jaxserve` parser."""
    bench = sub.add_parser("bench", help="benchmarks (throughput, latency, serve, ...)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    tp = bsub.add_parser("throughput", help="offline throughput: modes and transformers")
    _add_trace_args(tp)
    _add_engine_group(tp)
    tp.add_argument("--modes", default=",".join(SCHEDULING_MODES),
                    help="comma list of scheduling modes to run")
    tp.add_argument("--baseline", default="transformers", choices=["transformers", "none"])
    tp.add_argument("--hf-batch-size", type=int, default=16,
                    help="static batch size of the transformers baseline")
    tp.add_argument("--plot-dir", default=None, help="write PNG plots here")
    tp.set_defaults(handler=cmd_throughput)

    px = bsub.add_parser("prefix", help="prefix caching on/off on a shared-prompt trace")
    _add_trace_args(px, default="shared-prefix")
    _add_engine_group(px)
    px.set_defaults(handler=cmd_prefix)

    from jaxserve.bench import cli_more

    cli_more.add_commands(bsub, sub)


def main(args) -> int:
    """Runs the parsed `bench`/`diagnose` command."""
    logging.basicConfig(level=logging.WARNING)
    return args.handler(args)


if __name__ == "__main__":
    from jaxserve.entrypoints.cli import main as cli_main

    sys.exit(cli_main(["bench", *sys.argv[1:]]))
