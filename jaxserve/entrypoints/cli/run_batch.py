"""`jaxserve run-batch`: an OpenAI batch file (JSONL) offline, resumable after a kill."""

from __future__ import annotations

import signal
import sys

from jaxserve.entrypoints.cli.args import add_engine_args, add_lora_args, engine_kwargs
from jaxserve.entrypoints.cli.engine import (
    add_serving_args,
    served_names,
    serving_models,
    start_engine,
)


def add_parser(sub) -> None:
    p = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline")
    p.add_argument("-i", "--input-file", required=True, help="batch input JSONL (- = stdin)")
    p.add_argument("-o", "--output-file", required=True,
                   help="results JSONL, one line per non-blank input line: appended as lines "
                        "finish, rewritten in input order at the end (- = stdout, streamed "
                        "in input order)")
    p.add_argument("--resume", action="store_true",
                   help="continue an interrupted run: keep the output file's finished records, "
                        "run only the other lines (without it the output file is truncated "
                        "first)")
    add_engine_args(p, positional_model=False)
    add_lora_args(p)
    add_serving_args(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    ray = p.add_argument_group("Ray cluster (pip install 'jaxserve[ray]')")
    ray.add_argument("--ray", metavar="ADDRESS", default=None,
                     help="run on a Ray cluster through a pool of actors, one engine each: "
                          "the head's host:port (or ray://host:port), or 'local' to start "
                          "one here")
    ray.add_argument("--num-actors", type=int, default=2, help="actors (default: 2)")
    ray.add_argument("--actor-cpus", type=float, default=1.0,
                     help="CPUs each actor reserves (default: 1)")
    ray.add_argument("--actor-gpus", type=float, default=0.0,
                     help="GPUs each actor reserves (default: 0)")
    ray.add_argument("--ray-batch-size", type=int, default=32,
                     help="lines per batch an actor answers, and reruns if it dies "
                          "(default: 32)")
    ray.add_argument("--ray-timeout", type=float, default=30.0,
                     help="seconds to wait for the cluster to answer (default: 30)")
    p.set_defaults(handler=run)


def run(args) -> int:
    from jaxserve.entrypoints.run_batch import check_paths, run_batch_file

    check_paths(args.input_file, args.output_file, args.resume)  # before the slow model load
    if args.ray is not None:
        if args.lora_modules:
            raise ValueError("--lora-modules is not supported with --ray (the actors would "
                             "each need the adapters); run without --ray")
        return _run_on_ray(args)
    models = serving_models(args, served_names(args, engine_kwargs(args)))
    llm, names = start_engine(args, verbose=False, models=models)
    try:
        counts, code = _interruptible(lambda: run_batch_file(
            llm, names, args.input_file, args.output_file, use_tqdm=not args.no_progress,
            resume=args.resume, models=models), args.output_file)
    finally:
        llm.shutdown()
    if code is not None:
        return code
    print(f"[jaxserve] {counts['total']} requests: {counts['succeeded']} succeeded, "
          f"{counts['failed']} failed, {counts['skipped']} skipped (done by an earlier run); "
          f"wrote {args.output_file}", file=sys.stderr)
    return 0


def _run_on_ray(args) -> int:
    from jaxserve.entrypoints.ray_batch import print_report, run_batch_file

    kwargs = engine_kwargs(args)  # checked by run_batch_file (paths only on a local cluster)
    report, code = _interruptible(lambda: run_batch_file(
        args.input_file, args.output_file, kwargs, args.served_model_name,
        address=args.ray, num_actors=args.num_actors, batch_size=args.ray_batch_size,
        num_cpus=args.actor_cpus, num_gpus=args.actor_gpus, resume=args.resume,
        use_tqdm=not args.no_progress, timeout=args.ray_timeout), args.output_file)
    if code is not None:
        return code
    print_report(report)
    return 0


def _interruptible(job, output_file: str):
    """Runs `job()` with SIGTERM handled like Ctrl-C: (its result, None), or (None, the
    exit status) when interrupted, after saying where the finished lines are."""
    caught = []

    def on_sigterm(signum, frame):
        caught.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        return job(), None
    except KeyboardInterrupt:
        where = "" if output_file == "-" else \
            f"; the finished lines are in {output_file}: rerun with --resume to complete it"
        print(f"[jaxserve] run-batch interrupted{where}", file=sys.stderr)
        return None, 128 + (caught[0] if caught else signal.SIGINT)
    finally:
        signal.signal(signal.SIGTERM, previous)
