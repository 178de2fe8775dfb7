"""Starting an engine for the commands that serve requests (`serve`, `chat`, `run-batch`),
with the LoRA adapters of `--lora-modules` loaded."""

from __future__ import annotations

import os

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


def serving_models(args, names: list[str]):
    """The served names and the `--lora-modules` adapters (`OpenAIServingModels`),
    checked before the model loads.

    Raises:
        ValueError: An entry that is neither `name=path` nor vLLM's JSON object, a name
            given twice or equal to a served name, a path that is not a directory, or
            adapters without `--enable-lora` (each message names the entry).
    """
    from jaxserve.entrypoints.openai.serving_models import (
        OpenAIServingModels,
        parse_lora_module,
    )

    modules = [parse_lora_module(text) for text in getattr(args, "lora_modules", None) or ()]
    if modules and not getattr(args, "enable_lora", None):
        raise ValueError("--lora-modules needs --enable-lora")
    for module in modules:
        if not os.path.isdir(module.path):
            raise ValueError(f"--lora-modules: adapter {module.name!r}: {module.path} is not "
                             "a directory")
    try:
        return OpenAIServingModels(names, modules)
    except ValueError as e:
        raise ValueError(f"--lora-modules: {e}") from None


def start_engine(args, verbose: bool = True, models=None):
    """(AsyncLLM, served names) from the parsed engine and serving flags.

    Args:
        args: The parsed flags.
        verbose: Log at INFO.
        models: An `OpenAIServingModels` whose adapters are loaded before the engine
            serves (`serving_models`).

    Raises:
        ValueError: A bad engine argument (checked before the model loads), or an adapter
            of `models` that does not load (named).
    """
    kwargs = engine_kwargs(args)
    check_engine_args(kwargs)
    names = served_names(args, kwargs)
    quiet_start(verbose)
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.engine.llm import LLM
    from jaxserve.entrypoints.openai.serving_models import load_static_loras
    from jaxserve.metrics import ServerMetrics

    init_distributed(args)
    print_backend()
    engine = LLM(**kwargs).engine
    if models is not None:
        load_static_loras(engine, models)
    return AsyncLLM(engine, ServerMetrics(names[0]), getattr(args, "log_interval", 0)), names
