"""The `jaxserve` command line: `serve`, `chat`, `run-batch`, `generate`, `convert`, `bench`
and `diagnose`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

# (flag, type or "bool" for --x/--no-x, help): vLLM's spellings of the engine arguments.
ENGINE_FLAGS = [
    ("--dtype", str, "parameter and activation dtype: float32 or bfloat16"),
    ("--max-model-len", int, "longest prompt + output (default: min(model, 2048))"),
    ("--max-num-seqs", int, "most requests in one step (default 64)"),
    ("--max-num-batched-tokens", int, "token budget of one step"),
    ("--block-size", int, "tokens per KV page (default 16)"),
    ("--num-kv-blocks", int, "fix the KV page count (default: sized from memory)"),
    ("--gpu-memory-utilization", float, "fraction of accelerator memory to use (default 0.9)"),
    ("--kv-cache-memory-gib", float, "KV budget where the device reports no memory (CPU)"),
    ("--swap-space", float, "host swap space in GiB for preemption-mode swap (default 4)"),
    ("--enable-prefix-caching", "bool", "reuse KV pages of shared prefixes (default on)"),
    ("--enable-chunked-prefill", "bool", "split long prompts across steps (default on)"),
    ("--long-prefill-token-threshold", int, "cap on one request's prefill chunk (0: none)"),
    ("--preemption-mode", str, "recompute or swap (default recompute)"),
    ("--scheduling-policy", str, "fcfs or priority (default fcfs)"),
    ("--scheduling-mode", str, "continuous+chunked (default), continuous, static or naive"),
    ("--attention-backend", str, "auto, xla or pallas (default auto)"),
    ("--seed", int, "seed of the engine's random stream (default 0)"),
    ("--tensor-parallel-size", int, "devices one model is split over (default 1)"),
    ("--data-parallel-size", int, "engine replicas on disjoint devices (default 1)"),
    ("--warmup", "bool", "precompile every bucket at start-up (default on)"),
    ("--compilation-cache-dir", str, "JAX persistent compilation cache directory"),
]


def add_engine_args(p: argparse.ArgumentParser, positional_model: bool = True) -> None:
    """Adds MODEL (positional and `--model`) and the engine flags; unset flags keep defaults."""
    if positional_model:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", default=None,
                       help="GGUF file, Hugging Face directory or jaxserve checkpoint "
                            "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--model", default=None, help="the same as MODEL")
    group = p.add_argument_group("engine arguments")
    for flag, kind, text in ENGINE_FLAGS:
        if kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=text)
        else:
            group.add_argument(flag, type=kind, default=None, help=text)


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    """Flags of a multi-host start (one process per host; see the README)."""
    group = p.add_argument_group("multi-host (jax.distributed)")
    group.add_argument("--coordinator-address", default=None,
                       help="host:port of process 0, the same on every host")
    group.add_argument("--num-processes", type=int, default=None, help="processes in all")
    group.add_argument("--process-id", type=int, default=None, help="this process's index")


def init_distributed(args) -> None:
    """Calls `jax.distributed.initialize` when a coordinator address was given."""
    if getattr(args, "coordinator_address", None):
        from jaxserve.parallel.multihost import initialize

        initialize(args.coordinator_address, args.num_processes, args.process_id)


def engine_kwargs(args) -> dict:
    """`EngineConfig.from_kwargs` arguments from parsed flags (only those given)."""
    kwargs = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
              for flag, _, _ in ENGINE_FLAGS}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    model = getattr(args, "model_pos", None) or args.model
    return {"model": model, **kwargs}


def _add_serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: from the model file)")
    p.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between throughput/KV usage log lines (0: off)")


def _start_engine(args):
    """(AsyncLLM, served names) from the parsed engine and serving flags."""
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.engine.llm import LLM
    from jaxserve.entrypoints.openai.serving_engine import default_model_name
    from jaxserve.metrics import ServerMetrics

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    init_distributed(args)
    engine = LLM(**engine_kwargs(args)).engine
    names = args.served_model_name or [default_model_name(engine.model.source)]
    return AsyncLLM(engine, ServerMetrics(names[0]), args.log_interval), names


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="GGUF file, Hugging Face directory or jaxserve checkpoint "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="parameter and activation dtype (default: float32)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="greedy continuation of one prompt")
    gen.add_argument("prompt", help="text to continue")
    _add_model_args(gen)
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the model's chat template")
    gen.add_argument("--block-size", type=int, default=16, help="KV page size in tokens")
    gen.add_argument("--max-model-len", type=int, default=2048,
                     help="longest prompt + generation accepted")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    add_distributed_args(serve)
    _add_serving_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument("--api-key", default=os.environ.get("JAXSERVE_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and "
                            "/detokenize (default: the JAXSERVE_API_KEY environment variable, "
                            "which keeps the key out of the process list)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may take to finish after SIGTERM "
                            "(default 30); the rest end with an error")
    serve.add_argument("--max-request-body-bytes", type=int, default=8 * 1024 * 1024,
                       help="largest request body accepted; larger ones get a 413 "
                            "(default 8 MiB)")
    serve.add_argument("--max-prompts-per-request", type=int, default=256,
                       help="most prompts one completion request may carry (default 256)")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])

    chat = sub.add_parser("chat", help="interactive chat on stdin/stdout")
    add_engine_args(chat)
    chat.add_argument("--system-prompt", default=None, help="system message")
    chat.add_argument("--max-tokens", type=int, default=512, help="longest reply in tokens")
    chat.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    chat.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass")

    batch = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline")
    batch.add_argument("-i", "--input-file", required=True, help="batch input JSONL (- = stdin)")
    batch.add_argument("-o", "--output-file", required=True,
                       help="results JSONL, one line per non-blank input line: appended as "
                            "lines finish, rewritten in input order at the end (- = stdout, "
                            "streamed in input order)")
    batch.add_argument("--resume", action="store_true",
                       help="continue an interrupted run: keep the output file's finished "
                            "records, run only the other lines (without it the output file "
                            "is truncated first)")
    add_engine_args(batch)
    _add_serving_args(batch)
    batch.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    conv = sub.add_parser("convert", help="convert a model to a jaxserve (orbax) checkpoint")
    conv.add_argument("src", nargs="?", default=None,
                      help="GGUF file or Hugging Face directory (default: embedded model)")
    conv.add_argument("dst", help="new directory to write")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])

    from jaxserve.bench.cli import build_bench_parser

    build_bench_parser(sub)
    return parser


def cmd_generate(args) -> int:
    from jaxserve.compilation_cache import enable_compilation_cache
    from jaxserve.engine.greedy import GreedyGenerator
    from models.loaders import load_model, load_tokenizer

    enable_compilation_cache()
    t0 = time.perf_counter()
    model = load_model(args.model, args.dtype)
    tokenizer = load_tokenizer(args.model)
    t_load = time.perf_counter() - t0
    if args.chat:
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
    else:
        prompt_ids = tokenizer(args.prompt).input_ids
    gen = GreedyGenerator(model, page_size=args.block_size, max_model_len=args.max_model_len)
    stops = list(model.cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        stops.append(tokenizer.eos_token_id)
    out = gen.generate(prompt_ids, args.max_tokens, stop_token_ids=stops)
    text = tokenizer.decode([t for t in out if t not in stops], skip_special_tokens=False)
    print(text if args.chat else args.prompt + text)
    s = gen.stats
    rate = s["decode_tokens"] / s["decode_s"] if s["decode_s"] else float("nan")
    print(f"[jaxserve] load {t_load:.1f}s, prompt {len(prompt_ids)} tok, "
          f"first token {s['ttft_s'] * 1000:.0f} ms, {len(out)} tokens, "
          f"decode {rate:.1f} tok/s", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.engine.llm import LLM
    from jaxserve.entrypoints.openai.api_server import (
        build_app,
        make_server,
        start_in_background,
    )
    from jaxserve.entrypoints.openai.serving_engine import ServingLimits, default_model_name
    from jaxserve.metrics import ServerMetrics
    from models.default_model import default_model_path

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(message)s")
    init_distributed(args)
    kwargs = engine_kwargs(args)
    names = args.served_model_name or [default_model_name(kwargs["model"]
                                                          or default_model_path())]
    limits = ServingLimits(max_prompts_per_request=args.max_prompts_per_request)
    app = build_app(None, names, api_key=args.api_key, limits=limits,
                    max_body_bytes=args.max_request_body_bytes)
    server = make_server(app, args.host, args.port, args.shutdown_timeout,
                         args.uvicorn_log_level)

    def build(startup):
        # NOTE: the server listens while the model loads and warms up: /health answers
        # 503 with the progress, /v1/* a 503 error, until the engine is attached.
        warmup = kwargs.pop("warmup", True)
        engine = LLM(**kwargs, warmup=False).engine
        startup.engine = engine
        if warmup:
            startup.phase = "warm-up"
            engine.warmup()
        return AsyncLLM(engine, ServerMetrics(names[0]), args.log_interval)

    def failed(_):
        server.should_exit = True

    start_in_background(app, build, on_error=failed)
    logging.getLogger("jaxserve").info("jaxserve: serving %s on http://%s:%d (starting)",
                                       names[0], args.host, args.port)
    server.run()
    if app.state.llm is not None:
        app.state.llm.shutdown()
    return 1 if app.state.startup.error else 0


def cmd_chat(args) -> int:
    import asyncio

    from jaxserve.entrypoints.chat_cli import chat_loop
    from jaxserve.sampling_params import SamplingParams

    args.served_model_name, args.log_interval = None, 0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed)
    llm, _ = _start_engine(args)
    try:
        asyncio.run(chat_loop(llm, params, system_prompt=args.system_prompt))
    finally:
        llm.shutdown()
    return 0


def cmd_run_batch(args) -> int:
    import signal

    from jaxserve.entrypoints.run_batch import check_paths, run_batch_file

    check_paths(args.input_file, args.output_file, args.resume)  # before the slow model load
    llm, names = _start_engine(args)
    caught = []

    def on_sigterm(signum, frame):
        caught.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        counts = run_batch_file(llm, names, args.input_file, args.output_file,
                                use_tqdm=not args.no_progress, resume=args.resume)
    except KeyboardInterrupt:
        where = "" if args.output_file == "-" else \
            f"; the finished lines are in {args.output_file}: rerun with --resume to complete it"
        print(f"[jaxserve] run-batch interrupted{where}", file=sys.stderr)
        return 128 + (caught[0] if caught else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
        llm.shutdown()
    print(f"[jaxserve] {counts['total']} requests: {counts['succeeded']} succeeded, "
          f"{counts['failed']} failed, {counts['skipped']} skipped (done by an earlier run); "
          f"wrote {args.output_file}", file=sys.stderr)
    return 0


def cmd_convert(args) -> int:
    from models.loaders import convert

    t0 = time.perf_counter()
    model = convert(args.src, args.dst, args.dtype)
    print(f"wrote {args.dst} ({model.cfg.architecture}, {args.dtype}) in "
          f"{time.perf_counter() - t0:.1f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxserve` console script."""
    args = build_parser().parse_args(argv)
    handlers = {"generate": cmd_generate, "convert": cmd_convert, "serve": cmd_serve,
                "chat": cmd_chat, "run-batch": cmd_run_batch}
    try:
        if args.command in ("bench", "diagnose"):
            from jaxserve.bench.cli import main as bench_main

            return bench_main(args)
        return handlers[args.command](args)
    except ValueError as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
