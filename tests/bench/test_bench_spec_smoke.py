"""Smoke test of `jaxserve bench spec` (speculation off/on) on the tiny model and copying trace."""

from __future__ import annotations

import pytest

from jaxserve.bench.copying import copying_trace
from jaxserve.bench.workloads import load_trace
from tests.bench.test_bench_smoke import ok, read_json

pytestmark = pytest.mark.slow

# The copying prompts are chat-formatted paragraphs, code or records (about 80-140 tokens,
# answers about 50-80): a longer max_model_len than the other smoke tests, same budget.
# NOTE: both tests share this engine shape, so the speculation-off engine's programs come
# from the compilation cache after the first.
ENGINE = ["--max-model-len", "256", "--num-kv-blocks", "80", "--max-num-batched-tokens", "16",
          "--max-num-seqs", "8"]
TRACE = ["--trace", "copying", "--num-requests", "2", "--repeats", "1"]
FIGURES = {"output_tok_s", "mean_itl_ms", "mean_tpot_ms", "duration_s", "num_steps",
           "acceptance_rate", "mean_accepted_len", "num_drafts", "load_avg"}


def check_runs(res: dict, k: int) -> None:
    """One run per engine with the figures, and the ratios of those runs."""
    assert len(res["off"]) == len(res["on"]) == 1
    off, on = res["off"][0], res["on"][0]
    for run in (off, on):
        assert set(run) == FIGURES
        assert run["output_tok_s"] > 0 and run["num_steps"] > 0 and run["mean_itl_ms"] > 0
        assert 0.0 <= run["acceptance_rate"] <= 1.0
        assert 1.0 <= run["mean_accepted_len"] <= k + 1
    assert off["num_drafts"] == 0 and off["acceptance_rate"] == 0.0  # no speculation
    assert on["num_drafts"] >= 0
    q = res["ratios"]
    assert q["output_tok_s"] == pytest.approx(on["output_tok_s"] / off["output_tok_s"])
    assert q["mean_itl_ms"] == pytest.approx(off["mean_itl_ms"] / on["mean_itl_ms"])
    assert q["mean_tpot_ms"] == pytest.approx(off["mean_tpot_ms"] / on["mean_tpot_ms"])


def test_spec_ngram_on_the_copying_trace(tiny_model_dir, smollm2_tokenizer, tmp_path):
    path, saved = str(tmp_path / "spec.json"), str(tmp_path / "trace.jsonl")
    out, _ = ok(["bench", "spec", "--model", tiny_model_dir, *ENGINE, *TRACE,
                 "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                 "--save-trace", saved, "--output-json", path])
    # The trace is the copying trace of the model's tokenizer (SmolLM2's), seed 0.
    trace = copying_trace(smollm2_tokenizer, 2, seed=0)
    assert load_trace(saved) == trace
    assert (f"trace copying: 2 requests, {sum(r.prompt_len for r in trace)} prompt + "
            f"{sum(r.output_len for r in trace)} output tokens") in out
    assert "off #1" in out and "on #1" in out
    assert "speculation {'method': 'ngram', 'num_speculative_tokens': 2}:" in out
    res = read_json(path)
    assert res["engine_args"]["max_model_len"] == 256
    assert "speculative_config" not in res["engine_args"]
    assert res["results"]["spec_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    check_runs(res["results"], k=2)


def test_spec_with_a_truncated_draft_model(tiny_model_dir, tmp_path):
    """`--draft-layers 1`: the model's first layer drafts (method draft_model), k from
    `--speculative-config`."""
    path = str(tmp_path / "spec.json")
    out, _ = ok(["bench", "spec", "--model", tiny_model_dir, *ENGINE, *TRACE,
                 "--draft-layers", "1", "--speculative-config", '{"num_speculative_tokens": 2}',
                 "--output-json", path])
    res = read_json(path)["results"]
    spec = res["spec_config"]
    assert spec["method"] == "draft_model" and spec["num_speculative_tokens"] == 2
    assert spec["model"].endswith("(first 1 layers)") and tiny_model_dir in spec["model"]
    assert "'method': 'draft_model'" in out
    check_runs(res, k=2)
    assert res["on"][0]["num_drafts"] > 0  # a draft model proposes at every decode step
