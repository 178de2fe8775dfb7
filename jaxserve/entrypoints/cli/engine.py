"""Starting an engine for the commands that serve requests (`serve`, `chat`, `run-batch`)."""

from __future__ import annotations

from jaxserve.entrypoints.cli.args import (
    check_engine_args,
    engine_kwargs,
    init_distributed,
    print_backend,
    quiet_start,
)


def add_serving_args(p) -> None:
    """Flags shared by the commands that serve through `AsyncLLM`."""
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model (default: from the model file)")
    p.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between throughput/KV usage log lines, 0: off (default: 10)")


def served_names(args, kwargs: dict) -> list[str]:
    """The names clients may use: `--served-model-name`, else one from the model path."""
    from jaxserve.entrypoints.openai.serving_base import default_model_name
    from models.default_model import default_model_path

    return args.served_model_name or [default_model_name(kwargs["model"]
                                                         or default_model_path())]


def start_engine(args, verbose: bool = True):
    """(AsyncLLM, served names) from the parsed engine and serving flags.

    Raises:
        ValueError: A bad engine argument (checked before the model loads).
    """
    kwargs = engine_kwargs(args)
    check_engine_args(kwargs)
    names = served_names(args, kwargs)
    quiet_start(verbose)
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.engine.llm import LLM
    from jaxserve.metrics import ServerMetrics

    init_distributed(args)
    print_backend()
    engine = LLM(**kwargs).engine
    return AsyncLLM(engine, ServerMetrics(names[0]), getattr(args, "log_interval", 0)), names
