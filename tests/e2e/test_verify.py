"""`jaxserve verify`: the divergence classes on hand-made records, the command's argument
errors, and the command on the tiny model (batch-invariant: every prompt identical, exit
0; two backends under --strict: their bits differ, exit 1)."""

from __future__ import annotations

import json

import pytest

from jaxserve.entrypoints import verify as v
from jaxserve.entrypoints.cli import main
from pallas_kernels import cpu_ffi
from tests.conftest import TINY_ENGINE


def rec(*rows):
    """Records from (token, {id: logprob}) rows."""
    return [(tok, tuple(sorted(lps.items()))) for tok, lps in rows]


REF = rec((5, {5: -0.5, 7: -1.5}), (7, {7: -0.70, 9: -0.7004}), (9, {9: -0.1, 2: -3.0}))


@pytest.mark.parametrize("other, kind, position", [
    (REF, "identical", None),
    # Same tokens, other bits.
    (rec((5, {5: -0.5, 7: -1.5}), (7, {7: -0.7000001, 9: -0.7004}), (9, {9: -0.1, 2: -3.0})),
     "logprobs", 1),
    # A flip where the top-2 gap is 4e-4 < epsilon 1e-3.
    (rec((5, {5: -0.5, 7: -1.5}), (9, {9: -0.70, 7: -0.7004}), (2, {2: -0.2, 9: -2.0})),
     "near-tie", 1),
    # A flip where the top-2 gap is 1.0.
    (rec((7, {7: -0.5, 5: -1.5}), (7, {7: -0.70, 9: -0.7004}), (9, {9: -0.1, 2: -3.0})),
     "real", 0),
    # One run stopped earlier.
    (REF[:2], "real", 2),
])
def test_classify(other, kind, position):
    d = v.classify(3, REF, other, 1e-3)
    assert (d.index, d.kind, d.position) == (3, kind, position)
    if kind == "logprobs":
        assert d.max_abs == pytest.approx(1e-7, abs=1e-7) and d.gap == pytest.approx(4e-4)


def test_failed_and_summary():
    ds = [v.Divergence(0, "identical"), v.Divergence(1, "near-tie", 2, 1e-4, 0.1)]
    assert not v.failed(ds, strict=False) and v.failed(ds, strict=True)
    assert v.failed(ds + [v.Divergence(2, "real", 0, 1.0, 1.0)], strict=False)
    text = v.summary(ds, 1e-3, "alone vs crowded")
    assert "prompt 1: near-tie at output token 2, top-2 logprob gap 0.0001" in text
    assert "1 identical, 1 near-tie, 0 logprobs, 0 real of 2 prompts" in text


def test_negative_epsilon_is_an_error():
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        v.classify(0, REF, REF, -1.0)


@pytest.mark.parametrize("argv, message", [
    (["--backends", "xla"], "--backends takes two of"),
    (["--backends", "xla,tpu"], "--backends takes two of"),
    (["--epsilon", "-1"], "--epsilon must be >= 0"),
    (["--max-tokens", "0"], "--max-tokens must be positive"),
    (["--crowd", "-1"], "--crowd must be >= 0"),
    (["--prompts", "/no/such/prompts.txt"], "cannot read the --prompts file"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
])
def test_argument_errors(capsys, argv, message):
    assert main(["verify", *argv]) == 2
    assert message in capsys.readouterr().err


def test_empty_prompts_file_is_an_error(capsys, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n  \n")
    assert main(["verify", "--prompts", str(path)]) == 2
    assert "holds no prompt" in capsys.readouterr().err


def sizes() -> list[str]:
    return ["--max-num-seqs", str(TINY_ENGINE["max_num_seqs"]),
            "--max-num-batched-tokens", str(TINY_ENGINE["max_num_batched_tokens"]),
            "--max-model-len", str(TINY_ENGINE["max_model_len"]),
            "--num-kv-blocks", str(TINY_ENGINE["num_kv_blocks"]), "--no-enable-prefix-caching"]


def test_batch_invariant_run_passes(capsys, tiny_model_dir):
    rc = main(["verify", "--model", tiny_model_dir, "--batch-invariant", "--attention-backend",
               "xla", "--max-tokens", "4", "--crowd", "7", "--json", *sizes()])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["strict"] and not report["failed"]
    assert [d["kind"] for d in report["prompts"]] == ["identical"] * 8
    # The served weights and the checkpoint's weight tensors (float32 both: the same bytes).
    from safetensors.numpy import load_file

    on_disk = sum(a.nbytes for a in load_file(f"{tiny_model_dir}/model.safetensors").values())
    assert report["weights"] == {"format": "none", "device_bytes": on_disk,
                                 "checkpoint_bytes": on_disk}


# NOTE: slow: two more engines; the exit-1 path is also covered by `failed` above.
@pytest.mark.slow
@pytest.mark.skipif(not cpu_ffi.available(), reason="the cpu backend's kernel does not build")
def test_two_backends_differ_under_strict(capsys, tiny_model_dir, tmp_path):
    """xla and cpu compute in other orders: strict fails on their bits (exit 1)."""
    path = tmp_path / "prompts.txt"
    path.write_text("def fibonacci(n):\nchat:Name three fruits.\n")
    rc = main(["verify", "--model", tiny_model_dir, "--batch-invariant", "--backends",
               "xla,cpu", "--prompts", str(path), "--max-tokens", "4", "--crowd", "3",
               *sizes()])
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED" in out and "backend xla vs cpu" in out, out
    assert "weights none: " in out and "MiB in the checkpoint (x1.00)" in out, out
