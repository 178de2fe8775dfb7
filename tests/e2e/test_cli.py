"""The `jaxserve` command line: generate on the default model (slow tier), convert, errors."""

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


@pytest.mark.parametrize("argv, message", [
    (["generate", ""], "prompt is empty"),
    (["generate", "  "], "prompt is empty"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens must be at least 1"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--max-num-seqs", "0"], "max_num_seqs"),
    (["serve", "--max-num-seqs", "0"], "max_num_seqs"),
    (["chat", "--swap-space", "-1"], "swap_space"),
    (["run-batch", "-i", "/no/such/file.jsonl", "-o", "out.jsonl"], "/no/such/file.jsonl"),
    (["diagnose", "--max-num-seqs", "0"], "max_num_seqs"),
    (["diagnose", "--metrics", "/no/such/metrics.json"], "/no/such/metrics.json"),
])
def test_argument_errors_come_before_any_loading(argv, message, capsys, monkeypatch):
    # Issue 19 item 6: these used to load the model first (a minute on this machine).
    import time

    import models.loaders

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models.loaders, "load_model", no_loading)
    start = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - start < 5
    assert message in capsys.readouterr().err


def test_diagnose_names_a_bad_config_file(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert main(["diagnose", "--config", str(bad)]) == 2
    assert str(bad) in capsys.readouterr().err


@pytest.mark.slow
def test_generate_prints_no_alarming_noise(smollm2_path):
    # Issue 19 item 7: "PyTorch was not found" and "Unable to initialize backend 'tpu'"
    # suggested breakage; one line names the backend instead.
    import os
    import subprocess
    import sys

    # NOTE: the serving tests' engine sizes and the suite's compilation cache: the steps it
    # runs come from the cache, not compiled again in a fresh process.
    cache = os.environ.get("JAXSERVE_TEST_CACHE", os.path.join(
        os.path.dirname(__file__), "..", "..", ".jax_cache"))
    argv = ["generate", "Hello", "--max-tokens", "2", "--max-model-len", "256",
            "--num-kv-blocks", "64", "--max-num-batched-tokens", "64", "--max-num-seqs", "8",
            "--compilation-cache-dir", os.path.abspath(cache)]
    code = ("import sys; sys.modules['torch'] = None; "
            "from jaxserve.entrypoints.cli import main; "
            f"sys.exit(main({argv!r}))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "PyTorch was not found" not in res.stderr
    assert "libtpu" not in res.stderr and "Unable to initialize backend" not in res.stderr
    assert "[jaxserve] JAX" in res.stderr and " on cpu" in res.stderr
    assert res.stdout.startswith("Hello")
