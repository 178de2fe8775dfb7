"""What `bench` and `bench_sweeps` share: benchmark engine defaults and flags, loading, plots."""

from __future__ import annotations

import argparse
import sys

from jaxserve.entrypoints.cli.args import add_engine_args, engine_kwargs

# Engine settings the benchmarks use unless a flag overrides them: sized for a 2-core CPU
# and SmolLM2-135M (see BENCHMARKS.md). The attention backend is the engine's own "auto"
# unless --attention-backend says otherwise.
BENCH_ENGINE_DEFAULTS = {"max_model_len": 1024, "max_num_seqs": 32,
                         "max_num_batched_tokens": 256, "num_kv_blocks": 1024}


def add_engine_group(p: argparse.ArgumentParser) -> None:
    """The engine flags (benchmark defaults shown) and `--output-json`."""
    add_engine_args(p, positional_model=False,
                    defaults={k: str(v) for k, v in BENCH_ENGINE_DEFAULTS.items()})
    p.add_argument("--output-json", default=None, help="write the full results here as JSON")


def bench_engine_args(args, **overrides) -> dict:
    """Engine kwargs: the benchmark defaults, then the flags given, then `overrides`."""
    kw = engine_kwargs(args)
    kw.pop("model")
    return {**BENCH_ENGINE_DEFAULTS, **kw, **overrides}


def load_model_and_tokenizer(args):
    """(model, tokenizer, path of the weights) from `--model` / `--dtype` /
    `--quantization` / `--attention-backend` (the engine built over it checks that its
    own settings agree)."""
    from models.default_model import default_model_path
    from models.linear import ServingChoice
    from models.loaders import load_model, load_tokenizer

    path = args.model or default_model_path()
    backend = getattr(args, "attention_backend", None) or "auto"
    model = load_model(path, args.dtype or "auto", serving=ServingChoice(backend),
                       quantization=getattr(args, "quantization", None))
    return model, load_tokenizer(path), path


def plot(args, fn, *a) -> None:
    """Writes the plots `fn(*a, plot_dir)` makes when `--plot-dir` is given (a note
    without matplotlib)."""
    if getattr(args, "plot_dir", None):
        try:
            for path in fn(*a, args.plot_dir):
                print(f"wrote {path}")
        except ImportError:
            print("plots need matplotlib: pip install -e '.[bench]'", file=sys.stderr)
