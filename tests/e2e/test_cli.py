"""The `jaxserve` command line: generate on the default model, convert, and its errors."""

from __future__ import annotations

import pytest

from jaxserve.entrypoints.cli import main


@pytest.mark.slow
def test_generate_default_model(capsys, smollm2_path):
    assert main(["generate", "Once upon a time", "--max-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("Once upon a time, the city of")
    assert "decode" in out.err


def test_generate_missing_model_is_an_error(capsys, tmp_path):
    missing = tmp_path / "nope.gguf"
    assert main(["generate", "hi", "--model", str(missing)]) == 2
    assert f"model path {missing} does not exist" in capsys.readouterr().err


def test_bad_arguments_exit_with_usage(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--dtype", "float16"])
    assert e.value.code == 2
    assert "invalid choice: 'float16'" in capsys.readouterr().err
