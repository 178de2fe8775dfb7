"""The serving subcommands of the CLI: `--help`, vLLM-style engine flags, served model names."""

from __future__ import annotations

import argparse

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


COMMANDS = ["serve", "chat", "run-batch", "generate", "convert", "diagnose",
            *[f"bench {c}" for c in ("throughput", "prefix", "latency", "serve", "roofline",
                                     "scale", "overhead")]]


def command_parser(command: str):
    parser = build_parser()
    for word in command.split():
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    return parser


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_has_help_and_engine_flags_show_defaults(command, capsys):
    # Issue 19 item 10: one shared definition of the engine arguments, defaults shown.
    parser = command_parser(command)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = action.option_strings[0] if action.option_strings else action.dest
        assert action.help and "the same as MODEL" not in action.help, f"{command} {name}"
        if name in ("--max-num-seqs", "--dtype", "--block-size", "--warmup"):
            assert "(default: " in action.help, f"{command} {name}"
    with pytest.raises(SystemExit) as e:
        main([*command.split(), "--help"])
    assert e.value.code == 0 and f"usage: jaxserve {command}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["serve", "generate hi", "diagnose", "bench latency"])
def test_dtype_has_the_same_choices_everywhere(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([*command.split(), "--dtype", "float16"])
    assert e.value.code == 2 and "invalid choice: 'float16'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, usage", [
    (["generate", "hi", "--max-token", "3"], "usage: jaxserve generate"),  # no abbreviations
    (["generate", "hi", "--no-such-flag"], "usage: jaxserve generate"),
    (["bench", "latency", "--batch", "4"], "usage: jaxserve bench latency"),
    (["serve", "--prot", "1"], "usage: jaxserve serve"),
])
def test_mistyped_flags_show_the_commands_own_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and usage in err and "unrecognized arguments" in err


def test_enable_prompt_tokens_details_is_a_server_flag_not_an_engine_argument():
    args = build_parser().parse_args(["serve", "m.gguf", "--enable-prompt-tokens-details"])
    assert args.enable_prompt_tokens_details and engine_kwargs(args) == {"model": "m.gguf"}
    assert not build_parser().parse_args(["serve", "m.gguf"]).enable_prompt_tokens_details


def test_return_tokens_as_token_ids_is_a_server_flag():
    from jaxserve.entrypoints.cli.serve import serving_limits

    args = build_parser().parse_args(["serve", "m.gguf", "--return-tokens-as-token-ids"])
    assert serving_limits(args).return_tokens_as_token_ids
    assert engine_kwargs(args) == {"model": "m.gguf"}
    assert not serving_limits(build_parser().parse_args(["serve", "m.gguf"])) \
        .return_tokens_as_token_ids
