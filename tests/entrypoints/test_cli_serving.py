"""The serving subcommands of the CLI: `--help`, vLLM-style engine flags, served model names."""

from __future__ import annotations

import pytest

from jaxserve.config import EngineConfig
from jaxserve.entrypoints.cli import build_parser, engine_kwargs, main
from jaxserve.entrypoints.openai.api_server import default_model_name


@pytest.mark.parametrize("command", ["serve", "chat", "run-batch", "generate", "convert"])
def test_help_of_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert "usage: jaxserve " + command in capsys.readouterr().out


def test_serve_flags_become_engine_arguments():
    args = build_parser().parse_args([
        "serve", "m.gguf", "--max-num-seqs", "4", "--max-num-batched-tokens", "32",
        "--block-size", "8", "--max-model-len", "128", "--num-kv-blocks", "20",
        "--no-enable-prefix-caching", "--enable-chunked-prefill", "--swap-space", "1",
        "--preemption-mode", "swap", "--scheduling-policy", "priority", "--seed", "3",
        "--attention-backend", "xla", "--dtype", "bfloat16", "--port", "9000",
        "--api-key", "k", "--served-model-name", "a", "b"])
    kwargs = engine_kwargs(args)
    assert kwargs == {"model": "m.gguf", "max_num_seqs": 4, "max_num_batched_tokens": 32,
                      "block_size": 8, "max_model_len": 128, "num_kv_blocks": 20,
                      "enable_prefix_caching": False, "enable_chunked_prefill": True,
                      "swap_space": 1.0, "preemption_mode": "swap",
                      "scheduling_policy": "priority", "seed": 3, "attention_backend": "xla",
                      "dtype": "bfloat16"}
    EngineConfig.from_kwargs(**kwargs)  # every flag is a known engine argument
    assert (args.port, args.api_key, args.served_model_name) == (9000, "k", ["a", "b"])


def test_unset_flags_keep_engine_defaults():
    args = build_parser().parse_args(["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"])
    assert engine_kwargs(args) == {"model": None}
    assert (args.input_file, args.output_file) == ("in.jsonl", "out.jsonl")


def test_run_batch_needs_input_and_output(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run-batch", "-i", "in.jsonl"])
    assert e.value.code == 2 and "--output-file" in capsys.readouterr().err


@pytest.mark.parametrize("source, name", [
    ("/x/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("/x/model-f16.gguf", "model"), ("/x/plain.gguf", "plain"), ("/models/Llama-3/", "Llama-3"),
])
def test_default_model_name(source, name):
    assert default_model_name(source) == name
