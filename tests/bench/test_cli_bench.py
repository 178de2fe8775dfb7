"""`jaxserve bench ...` parsing: every subcommand's help, workloads, engine argument merging."""

from __future__ import annotations

import pytest

from jaxserve.entrypoints.cli import build_parser, main
from jaxserve.entrypoints.cli.bench import make_trace
from jaxserve.entrypoints.cli.bench_common import BENCH_ENGINE_DEFAULTS, bench_engine_args

COMMANDS = ["throughput", "prefix", "latency", "serve", "roofline", "scale", "overhead",
            "quant", "structured"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_every_bench_command(command, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", command, "--help"])
    assert e.value.code == 0 and "usage: jaxserve bench" in capsys.readouterr().out


def test_flags_override_the_bench_defaults():
    args = build_parser().parse_args(["bench", "throughput", "--max-num-seqs", "4",
                                      "--no-enable-prefix-caching"])
    kw = bench_engine_args(args, warmup=False)
    assert kw["max_num_seqs"] == 4 and kw["enable_prefix_caching"] is False
    assert kw["max_model_len"] == BENCH_ENGINE_DEFAULTS["max_model_len"] and not kw["warmup"]


@pytest.mark.parametrize("trace,extra", [("mixed", []), ("shared-prefix", ["--prefix-len", "32"]),
                                         ("synthetic", ["--dist", "fixed"])])
def test_traces_from_flags(trace, extra, tmp_path):
    path = str(tmp_path / "t.jsonl")
    args = build_parser().parse_args(["bench", "throughput", "--trace", trace, "--num-requests",
                                      "6", "--request-rate", "2", "--save-trace", path, *extra])
    t = make_trace(args)
    assert len(t) == 6 and t[-1].arrival_time > 0
    args.trace, args.save_trace = path, None
    assert make_trace(args) == t  # the saved JSONL reloads to the same trace
    if trace == "shared-prefix":
        assert all(r.prefix_len == 32 for r in t)
    if trace == "synthetic":
        assert len({r.prompt_len for r in t}) == 1


def test_overhead_refuses_an_empty_context(capsys):
    with pytest.raises(SystemExit, match="--context-len must be at least 1, got 0"):
        main(["bench", "overhead", "--context-len", "0", "--num-running", "2",
              "--skip-engine", "--skip-pipeline"])


def test_overhead_refuses_an_unknown_preset_before_any_work(capsys):
    with pytest.raises(SystemExit, match="--sim-preset: unknown 'tpu-9'; choose from"):
        main(["bench", "overhead", "--sim-preset", "tpu-9", "--num-running", "2"])
    assert capsys.readouterr().out == ""  # refused before the component timings ran


def test_the_bench_loader_honours_quantization(tiny_model_dir):
    # `jaxserve bench latency --quantization ...` loaded the weights in the source's form
    # and then refused them ("differs from the loaded model's").
    from jaxserve.entrypoints.cli.bench_common import load_model_and_tokenizer

    args = build_parser().parse_args(["bench", "latency", "--model", tiny_model_dir,
                                      "--quantization", "int8"])
    model, _, path = load_model_and_tokenizer(args)
    assert path == tiny_model_dir and model.quant.name == "int8"
