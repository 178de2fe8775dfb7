"""`jaxserve run-batch`: an OpenAI batch file (JSONL) offline, resumable after a kill."""

from __future__ import annotations

import signal
import sys

from jaxserve.entrypoints.cli.args import add_engine_args
from jaxserve.entrypoints.cli.engine import add_serving_args, start_engine


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
    add_serving_args(p)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(handler=run)


def run(args) -> int:
    from jaxserve.entrypoints.run_batch import check_paths, run_batch_file

    check_paths(args.input_file, args.output_file, args.resume)  # before the slow model load
    llm, names = start_engine(args, verbose=False)
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
