"""`/metrics` of a speculating server: vLLM's spec_decode counters, equal to the engine's own."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.metrics import ServerMetrics
from tests.conftest import TINY_ENGINE
from tests.entrypoints.conftest import API_KEY, MODEL_NAME, ServerThread

SPEC = {"method": "ngram", "num_speculative_tokens": 2}
# The shared tiny-engine sizes (the programs of the server without speculation come from
# the persistent compilation cache).
TINY_LIMITS = {**TINY_ENGINE, "warmup": False}
# The tiny random model's greedy continuation of it soon repeats one token, so the n-gram
# lookup finds the history's suffix earlier and proposes (and the target accepts) drafts.
PROMPT = "one two three one two three one two three one two"
SPEC_NAMES = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
              "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos")


@contextlib.contextmanager
def tiny_server(tiny_model_dir, **engine_args):
    """The tiny model behind uvicorn; one greedy completion of `PROMPT` done, engine idle."""
    from models.loaders import load_model, load_tokenizer

    srv = ServerThread(load_model(tiny_model_dir, "float32"), load_tokenizer(tiny_model_dir),
                       api_key=API_KEY, **TINY_LIMITS, **engine_args)
    try:
        r = httpx.post(f"{srv.url}/v1/completions", timeout=120,
                       headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 16,
                             "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        srv.wait_idle()
        yield srv
    finally:
        srv.stop()


def scrape(srv: ServerThread) -> tuple[str, dict]:
    """`/metrics`: its text and its families by name."""
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def test_speculating_server_exports_the_engines_spec_counters(tiny_model_dir):
    with tiny_server(tiny_model_dir, speculative_config=SPEC) as srv:
        text, families = scrape(srv)
        engine = srv.llm.engine.get_metrics()
    assert engine["jaxserve:spec_decode_num_drafts"] > 0  # the prompt made drafts
    assert engine["jaxserve:spec_decode_num_accepted_tokens"] > 0
    for name in SPEC_NAMES[:3]:
        family = families[f"jaxserve:{name}"]
        assert family.type == "counter", name
        (sample,) = [s for s in family.samples if s.name == f"jaxserve:{name}_total"]
        assert sample.labels == {"model_name": MODEL_NAME, "engine": "0"}
        assert sample.value == engine[f"jaxserve:{name}"], name
    family = families["jaxserve:spec_decode_num_accepted_tokens_per_pos"]
    assert family.type == "counter"
    per_pos = {s.labels["position"]: s.value for s in family.samples
               if s.name.endswith("_total")}
    assert per_pos == {str(i): engine[
        f"jaxserve:spec_decode_num_accepted_tokens_per_pos{{position={i}}}"]
        for i in range(SPEC["num_speculative_tokens"])}
    assert ('jaxserve:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="'
            f'{MODEL_NAME}",position="0"}} {float(per_pos["0"])}') in text


def test_server_without_speculation_exports_no_spec_counters(tiny_model_dir):
    with tiny_server(tiny_model_dir) as srv:
        _, families = scrape(srv)
        assert not [k for k in srv.llm.engine.get_metrics() if "spec_decode" in k]
    assert families["jaxserve:generation_tokens"].samples[0].value == 16  # it did generate
    assert not [name for name in families if "spec_decode" in name]


@pytest.mark.parametrize("prefix", ["jaxserve", "vllm"])
def test_spec_counters_follow_the_metric_name_prefix(prefix):
    m = ServerMetrics("tiny", prefix=prefix)
    m.update_snapshot({"jaxserve:spec_decode_num_drafts": 5,
                       "jaxserve:spec_decode_num_draft_tokens": 9,
                       "jaxserve:spec_decode_num_accepted_tokens": 6,
                       "jaxserve:spec_decode_num_accepted_tokens_per_pos{position=0}": 4,
                       "jaxserve:spec_decode_num_accepted_tokens_per_pos{position=1}": 2})
    text = generate_latest(m.registry).decode()
    assert f"# TYPE {prefix}:spec_decode_num_drafts_total counter" in text
    labels = '{engine="0",model_name="tiny"}'
    assert f"{prefix}:spec_decode_num_drafts_total{labels} 5.0" in text
    assert f"{prefix}:spec_decode_num_draft_tokens_total{labels} 9.0" in text
    assert f"{prefix}:spec_decode_num_accepted_tokens_total{labels} 6.0" in text
    for pos, n in ((0, 4.0), (1, 2.0)):
        assert (f'{prefix}:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",'
                f'model_name="tiny",position="{pos}"}} {n}') in text
