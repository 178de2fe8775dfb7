"""The `jaxserve` command line: one module per command (`generate`, `serve`, `chat`,
`run-batch`, `convert`, `bench`, `diagnose`, `verify`), one dispatch: each module's
`add_parser` sets the `handler` its command runs."""

from __future__ import annotations

import sys

from jaxserve.entrypoints.cli import (
    bench,
    chat,
    convert,
    diagnose,
    generate,
    run_batch,
    serve,
    verify,
)
from jaxserve.entrypoints.cli.args import (  # noqa: F401 - engine_kwargs re-exported
    Parser,
    engine_kwargs,
    quiet_start,
)

COMMANDS = (generate, serve, chat, run_batch, convert, bench, diagnose, verify)


def build_parser() -> Parser:
    """The argument parser of every command."""
    parser = Parser(prog="jaxserve", description="A JAX/XLA LLM serving engine (vLLM's design).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser,
                                metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxserve` console script.

    Returns:
        0 on success, 2 for a bad argument (the message names it), else the command's code.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # NOTE: the command's own usage, not the top-level one
        parser.command_parser(args).error(f"unrecognized arguments: {' '.join(extra)}")
    quiet_start()  # before transformers or JAX is imported
    try:
        return args.handler(args)
    except ValueError as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2
