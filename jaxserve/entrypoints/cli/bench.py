"""`jaxserve bench ...`: the benchmark commands' arguments and handlers over the `jaxserve.bench`
library (throughput, prefix, latency and serve here; roofline, scale and overhead in
`bench_sweeps`). Each prints its table(s) and can save the results as JSON (`--output-json`)
and plots (`--plot-dir`, needs the `bench` extra)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import numpy as np

from jaxserve.bench.report import dump_json, serve_block
from jaxserve.config import SCHEDULING_MODES
from jaxserve.entrypoints.cli.bench_common import (
    add_engine_group,
    bench_engine_args,
    load_model_and_tokenizer,
    plot,
)


def add_trace_args(p: argparse.ArgumentParser, default: str = "mixed",
                    num: int = 32) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--trace", default=default,
                   help="mixed, synthetic, shared-prefix, copying (tasks whose answers "
                        "copy the prompt: n-gram speculation's case), or a JSONL file from "
                        f"save_trace (default {default})")
    g.add_argument("--num-requests", type=int, default=num,
                   help=f"requests in the trace (default: {num})")
    g.add_argument("--input-len", type=int, default=128,
                   help="synthetic: mean prompt length (default: 128)")
    g.add_argument("--output-len", type=int, default=64,
                   help="synthetic: mean output length (default: 64)")
    g.add_argument("--dist", default="uniform",
                   choices=["fixed", "uniform", "normal", "lognormal"],
                   help="synthetic: length distribution (default: uniform)")
    g.add_argument("--request-rate", type=float, default=None,
                   help="Poisson arrivals/s (default: all at once)")
    g.add_argument("--prefix-len", type=int, default=256,
                   help="shared-prefix: prefix tokens (default: 256)")
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
    elif args.trace == "copying":
        from jaxserve.bench.copying import copying_trace
        from models.default_model import default_model_path
        from models.loaders import load_tokenizer

        tokenizer = load_tokenizer(getattr(args, "model", None) or default_model_path())
        trace = copying_trace(tokenizer, n, rate=rate, seed=seed)
    else:
        trace = w.load_trace(args.trace)
    if args.save_trace:
        w.save_trace(args.save_trace, trace)
    return trace


# ------------------------------------------------------------------ handlers
def cmd_throughput(args) -> int:
    from jaxserve.bench.report import dump_json
    from jaxserve.bench.throughput import compare_modes, format_modes

    trace = make_trace(args)
    model, tok, path = load_model_and_tokenizer(args)
    hf = None
    if args.baseline == "transformers":
        from jaxserve.bench.hf_baseline import load_hf_model, torch_missing

        missing = torch_missing()
        if missing:
            print(f"[jaxserve] transformers baseline skipped: {missing}", file=sys.stderr)
        else:
            hf = load_hf_model(path, np.dtype(model.dtype).name)  # "auto" resolved
    modes = args.modes.split(",")
    eargs = bench_engine_args(args)
    print(f"trace {args.trace}: {len(trace)} requests, {sum(r.prompt_len for r in trace)} "
          f"prompt + {sum(r.output_len for r in trace)} output tokens; engine {eargs}")
    peer = (args.peer_name, args.peer_url) if args.peer_url else None
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    res = compare_modes(model, tok, trace, modes, eargs, hf_model=hf,
                        hf_batch_size=args.hf_batch_size, peer=peer, sampling=sampling)
    ref = "static" if "static" in res else modes[0]
    print()
    print(format_modes(res, ref))
    dump_json(args.output_json, {"engine_args": eargs, "results": res})
    from jaxserve.bench import plots

    plot(args, plots.plot_modes, res)
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


def cmd_latency(args) -> int:
    from jaxserve.bench.engine_run import make_llm
    from jaxserve.bench.latency import bench_latency, format_latency

    model, tok, _ = load_model_and_tokenizer(args)
    eargs = bench_engine_args(args)
    eargs["max_num_seqs"] = max(eargs["max_num_seqs"], args.batch_size)
    eargs["max_num_batched_tokens"] = max(eargs["max_num_batched_tokens"], args.batch_size)
    llm = make_llm(model, tok, **eargs)
    res = bench_latency(llm.engine, batch_size=args.batch_size, input_len=args.input_len,
                        output_len=args.output_len, num_iters=args.num_iters,
                        num_iters_warmup=args.num_iters_warmup)
    print(format_latency(res))
    dump_json(args.output_json, {"engine_args": eargs, **res})
    return 0


def cmd_serve(args) -> int:
    from jaxserve.bench.serve_client import parse_goodput, run_serve_benchmark
    from jaxserve.bench.workloads import trace_token_ids

    trace = make_trace(args)
    ids = trace_token_ids(trace, args.vocab_size, avoid=(0, 1, 2))
    res = asyncio.run(run_serve_benchmark(
        args.base_url, trace, ids, model=args.served_model, max_concurrency=args.max_concurrency,
        api_key=args.api_key, goodput=parse_goodput(args.goodput)))
    print(serve_block(res))
    if res["errors"]:
        print(f"{res['failed']} failed; first errors: {res['errors'][:3]}", file=sys.stderr)
    dump_json(args.output_json, {"request_rate": args.request_rate or "inf",
                                 "trace": args.trace, **res})
    return 0 if not res["failed"] else 1


def cmd_spec(args) -> int:
    from jaxserve.bench.report import dump_json
    from jaxserve.bench.speculation import compare_speculation, format_speculation

    trace = make_trace(args)
    model, tok, _ = load_model_and_tokenizer(args)
    eargs = bench_engine_args(args)
    spec = eargs.pop("speculative_config", None)
    if args.draft_layers is not None:
        from jaxserve.spec_decode.draft import truncate_layers

        spec = {"num_speculative_tokens": 3, **(spec or {}), "method": "draft_model",
                "model": truncate_layers(model, args.draft_layers)}
    print(f"trace {args.trace}: {len(trace)} requests, {sum(r.prompt_len for r in trace)} "
          f"prompt + {sum(r.output_len for r in trace)} output tokens; engine {eargs}")
    res = compare_speculation(model, tok, trace, eargs, spec, repeats=args.repeats)
    print()
    print(format_speculation(res))
    dump_json(args.output_json, {"engine_args": eargs, "results": res})
    return 0


def add_parser(sub) -> None:
    """Adds `bench` with its subcommands."""
    from jaxserve.entrypoints.cli import bench_sweeps

    bench = sub.add_parser("bench", help="benchmarks (throughput, latency, serve, ...)",
                           description="Benchmarks; each prints its figures beside a baseline "
                                       "measured in the same run.")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    tp = bsub.add_parser("throughput", help="offline throughput: modes and transformers")
    add_trace_args(tp)
    add_engine_group(tp)
    tp.add_argument("--modes", default=",".join(SCHEDULING_MODES),
                    help="comma list of scheduling modes to run (default: all)")
    tp.add_argument("--baseline", default="transformers", choices=["transformers", "none"],
                    help="also time transformers' static generate; needs torch, skipped "
                         "with a note without it (default: transformers)")
    tp.add_argument("--hf-batch-size", type=int, default=16,
                    help="static batch size of the transformers baseline (default: 16)")
    tp.add_argument("--peer-url", default=None,
                    help="also stream the trace to this OpenAI-compatible server serving "
                         "the same model (e.g. llama.cpp's llama-server: "
                         "http://127.0.0.1:8080), after the engine modes")
    tp.add_argument("--peer-name", default="llama-server",
                    help="the peer's row name (default: llama-server)")
    tp.add_argument("--plot-dir", default=None, help="write PNG plots here (needs matplotlib)")
    tp.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every request, each seeded with its "
                         "index (default: 0, greedy)")
    tp.add_argument("--top-p", type=float, default=1.0, help="top-p (default: 1, off)")
    tp.add_argument("--top-k", type=int, default=0, help="top-k (default: 0, off)")
    tp.set_defaults(handler=cmd_throughput)

    sp = bsub.add_parser("spec", help="speculative decoding on/off on one trace, interleaved")
    add_trace_args(sp, default="copying", num=8)
    add_engine_group(sp)
    sp.add_argument("--repeats", type=int, default=2,
                    help="runs per engine, interleaved off/on (default: 2)")
    sp.add_argument("--draft-layers", type=int, default=None,
                    help="speculate with a draft made of the model's first N layers "
                         "(method draft_model; k from --speculative-config, default 3)")
    sp.set_defaults(handler=cmd_spec)

    px = bsub.add_parser("prefix", help="prefix caching on/off on a shared-prompt trace")
    add_trace_args(px, default="shared-prefix")
    add_engine_group(px)
    px.set_defaults(handler=cmd_prefix)

    lat = bsub.add_parser("latency", help="latency of one batch (like vllm bench latency)")
    add_engine_group(lat)
    lat.add_argument("--batch-size", type=int, default=8,
                     help="requests in the batch (default: 8)")
    lat.add_argument("--input-len", type=int, default=128,
                     help="prompt tokens per request (default: 128)")
    lat.add_argument("--output-len", type=int, default=32,
                     help="output tokens per request (default: 32)")
    lat.add_argument("--num-iters", type=int, default=3, help="timed runs (default: 3)")
    lat.add_argument("--num-iters-warmup", type=int, default=1,
                     help="untimed runs first (default: 1)")
    lat.set_defaults(handler=cmd_latency)

    srv = bsub.add_parser("serve", help="online benchmark against a running server")
    add_trace_args(srv)
    srv.add_argument("--base-url", default="http://127.0.0.1:8000",
                     help="the server to load (default: http://127.0.0.1:8000)")
    srv.add_argument("--served-model", default=None,
                     help="model name to request (default: the server's first)")
    srv.add_argument("--max-concurrency", type=int, default=None,
                     help="most requests in flight at once (default: no limit)")
    srv.add_argument("--goodput", nargs="*", default=None,
                     help="SLOs in ms for goodput, e.g. ttft:2000 tpot:500 e2el:10000")
    srv.add_argument("--api-key", default=None,
                     help="Bearer key of the server (default: none)")
    srv.add_argument("--vocab-size", type=int, default=49152,
                     help="prompt ids are drawn below min(this, 32000) (default: 49152)")
    srv.add_argument("--output-json", default=None, help="write the full results here as JSON")
    srv.set_defaults(handler=cmd_serve)

    bench_sweeps.add_parsers(bsub)
