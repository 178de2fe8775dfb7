"""`--speculative-config`: vLLM's JSON object on every engine command, validated before loading."""

from __future__ import annotations

import pytest

from jaxserve.config import EngineConfig, SpeculativeConfig
from jaxserve.entrypoints.cli import build_parser, engine_kwargs, main
from tests.entrypoints.test_cli_serving import command_parser

NGRAM = '{"method":"ngram","num_speculative_tokens":2}'
# Commands with the engine flags, and the arguments each needs besides them.
COMMANDS = {"serve": [], "generate": ["hi"], "chat": [], "run-batch": ["-i", "-", "-o", "-"],
            "bench throughput": [], "bench latency": [], "bench prefix": [], "bench scale": [],
            "diagnose": []}
# A path that does not exist: without the check a command fails on it (or on loading) instead.
NO_MODEL = "/nonexistent/jaxserve-test-model"


@pytest.mark.parametrize("command", COMMANDS)
def test_flag_becomes_vllms_dict_on_every_engine_command(command):
    args = build_parser().parse_args([*command.split(), *COMMANDS[command],
                                      "--speculative-config", NGRAM])
    kwargs = engine_kwargs(args)
    assert kwargs["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    config = EngineConfig.from_kwargs(**{k: v for k, v in kwargs.items() if k != "model"})
    assert config.speculative_config == SpeculativeConfig("ngram", 2, 2, 5)
    unset = build_parser().parse_args([*command.split(), *COMMANDS[command]])
    assert "speculative_config" not in engine_kwargs(unset)  # default: off


def test_text_that_is_not_json_names_the_argument():
    # The bench commands take engine_kwargs without check_engine_args: no text leaks through.
    args = build_parser().parse_args(["bench", "latency", "--speculative-config", "ngram"])
    with pytest.raises(ValueError, match=r"^speculative_config: not valid JSON \(Expecting"):
        engine_kwargs(args)


@pytest.mark.parametrize("command", ["serve", "generate", "bench latency"])
def test_help_shows_the_flag_and_its_default(command):
    action = next(a for a in command_parser(command)._actions
                  if "--speculative-config" in a.option_strings)
    assert action.default is None and action.metavar == "JSON"
    assert "(default: off)" in action.help and "num_speculative_tokens" in action.help


@pytest.mark.parametrize("value, message", [
    ("{method: ngram}", "speculative_config: not valid JSON"),
    ("[1, 2]", "speculative_config: expected a dict"),
    ('{"method":"ngram"}', "speculative_config.num_speculative_tokens: must be an integer"),
    ('{"method":"ngram","num_speculative_tokens":0}',
     "speculative_config.num_speculative_tokens: must be an integer >= 1, got 0"),
    ('{"method":"eagle","num_speculative_tokens":2}', "speculative_config.method: 'eagle'"),
    ('{"method":"ngram","num_speculative_tokens":2,"k":3}',
     "speculative_config: unknown field(s) ['k']"),
    ('{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_min":4,'
     '"prompt_lookup_max":3}', "speculative_config.prompt_lookup_min: 4 exceeds"),
    ('{"method":"draft_model","num_speculative_tokens":2,"model":"/x"}',
     "speculative_config.model: path /x does not exist"),
    ('{"method":"eagle3","num_speculative_tokens":2,"model":"/x"}',
     "speculative_config.model: path /x does not exist"),
    ('{"method":"eagle3","num_speculative_tokens":2,"model":"/x",'
     '"eagle_aux_hidden_state_layer_ids":3}',
     "speculative_config.eagle_aux_hidden_state_layer_ids: must be a list"),
])
def test_bad_value_exits_2_naming_the_field(value, message, capsys):
    code = main(["generate", "hi", "--model", NO_MODEL, "--speculative-config", value])
    err = capsys.readouterr().err
    assert code == 2 and f"jaxserve: error: {message}" in err, err


@pytest.mark.parametrize("command", ["serve", "chat", "run-batch"])
def test_serving_commands_refuse_a_bad_value_before_loading(command, capsys):
    args = [NO_MODEL] if command == "serve" else ["--model", NO_MODEL]
    code = main([command, *COMMANDS[command], *args, "--speculative-config",
                 '{"method":"ngram","num_speculative_tokens":"3"}'])
    err = capsys.readouterr().err
    assert code == 2 and "jaxserve: error: speculative_config.num_speculative_tokens" in err, err
