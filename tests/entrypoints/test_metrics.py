"""`jaxserve.metrics`: Prometheus text from engine snapshots, latency histograms, the stat line."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.metrics import ServerMetrics, StatLogger, buckets_1_2_5, split_name
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput

SNAPSHOT = {
    "jaxserve:num_requests_running": 2, "jaxserve:num_requests_waiting": 1,
    "jaxserve:num_requests_swapped": 0, "jaxserve:kv_cache_usage_perc": 0.25,
    "jaxserve:prefix_cache_queries": 40, "jaxserve:prefix_cache_hits": 10,
    "jaxserve:num_preemptions": 3, "jaxserve:prompt_tokens": 100,
    "jaxserve:generation_tokens": 50, "jaxserve:num_compilations": 0,
    "jaxserve:padding_waste_ratio": 0.125,
    "jaxserve:request_success{finished_reason=stop}": 4,
    "jaxserve:request_success{finished_reason=length}": 5,
}


LABELS = {"model_name": "tiny", "engine": "0"}


def families(metrics: ServerMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_split_name():
    assert split_name("a:b") == ("a:b", {})
    assert split_name("a{finished_reason=stop}") == ("a", {"finished_reason": "stop"})


def test_snapshot_exports_counters_and_gauges_with_vllm_names():
    m = ServerMetrics("tiny")
    m.update_snapshot(SNAPSHOT)
    fams = families(m)
    for name in ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions",
                 "prompt_tokens", "generation_tokens", "request_success"):
        assert fams[f"jaxserve:{name}"].type == "counter", name
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
                 "kv_cache_usage_perc", "num_compilations", "padding_waste_ratio"):
        assert fams[f"jaxserve:{name}"].type == "gauge", name
    success = {s.labels["finished_reason"]: s.value
               for s in fams["jaxserve:request_success"].samples if s.name.endswith("_total")}
    assert success == {"stop": 4, "length": 5}
    sample = fams["jaxserve:kv_cache_usage_perc"].samples[0]
    assert sample.value == 0.25 and sample.labels == {"model_name": "tiny", "engine": "0"}
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert fams[f"jaxserve:{name}"].type == "histogram", name


def test_observe_records_ttft_itl_e2e_and_queue_time():
    m = ServerMetrics("tiny")
    t0 = 1000.0
    metrics = RequestMetrics(arrival_time=t0, first_scheduled_time=t0 + 0.5,
                             first_token_time=t0 + 1.0, last_token_time=t0 + 1.0)

    def out(finished):
        return RequestOutput("r", "p", [1], [CompletionOutput(0)], finished, metrics)

    m.observe(out(False))
    metrics.last_token_time = t0 + 1.25
    m.observe(out(False))
    metrics.last_token_time = metrics.finished_time = t0 + 1.5
    m.observe(out(True))
    get = lambda name: m.registry.get_sample_value(f"jaxserve:{name}", LABELS)
    assert get("time_to_first_token_seconds_sum") == 1.0
    assert get("request_queue_time_seconds_sum") == 0.5
    assert get("inter_token_latency_seconds_count") == 2
    assert get("inter_token_latency_seconds_sum") == 0.5
    assert get("e2e_request_latency_seconds_sum") == 1.5
    assert m._last_token_time == {}


def test_each_server_has_its_own_registry():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.update_snapshot({"jaxserve:prompt_tokens": 7})
    assert "jaxserve:prompt_tokens" not in families(b)


def test_stat_logger_reports_throughput_only_when_busy(caplog):
    log = StatLogger(interval=0.0)
    log.maybe_log({})
    line = log.maybe_log(SNAPSHOT)
    assert "generation throughput" in line and "KV cache usage 25.0%" in line
    assert "prefix cache hit rate 25.0%" in line
    idle = {**SNAPSHOT, "jaxserve:num_requests_running": 0, "jaxserve:num_requests_waiting": 0}
    assert log.maybe_log(idle) is None


def test_vllm_prefix_exports_vllms_own_names():
    m = ServerMetrics("tiny", prefix="vllm")
    m.update_snapshot(SNAPSHOT)
    fams = families(m)
    assert not [name for name in fams if name.startswith("jaxserve")]
    assert fams["vllm:num_requests_running"].type == "gauge"
    assert fams["vllm:prompt_tokens"].type == "counter"
    assert fams["vllm:time_to_first_token_seconds"].type == "histogram"
    success = {s.labels["finished_reason"]: s.value
               for s in fams["vllm:request_success"].samples if s.name.endswith("_total")}
    assert success == {"stop": 4, "length": 5}


def test_bad_prefix_is_a_clear_error():
    import pytest

    with pytest.raises(ValueError, match="prefix must be one of"):
        ServerMetrics("tiny", prefix="prom")


def test_request_and_step_histograms_and_cache_config():
    from jaxserve.sampling_params import SamplingParams

    m = ServerMetrics("tiny")
    m.cache_config = {"block_size": 16, "num_gpu_blocks": 64, "enable_prefix_caching": True}
    t0 = 1000.0
    metrics = RequestMetrics(arrival_time=t0, first_scheduled_time=t0 + 0.5,
                             first_token_time=t0 + 1.0, last_token_time=t0 + 3.0,
                             finished_time=t0 + 3.0)
    m.on_added("r", SamplingParams(n=2, max_tokens=9))
    m.observe_step(40)
    m.observe_step(2)
    m.observe_step(0)  # a step that computed nothing is not an iteration
    m.observe(RequestOutput("r", "p", [1, 2, 3], [CompletionOutput(0, token_ids=[5, 6]),
                                                  CompletionOutput(1, token_ids=[7])],
                            True, metrics))
    get = lambda name: m.registry.get_sample_value(f"jaxserve:{name}", LABELS)
    assert get("iteration_tokens_total_count") == 2 and get("iteration_tokens_total_sum") == 42
    # vLLM observes each completion of an n > 1 request: the prompt twice, 2 and 1 tokens
    assert get("request_prompt_tokens_count") == 2 and get("request_prompt_tokens_sum") == 6
    assert get("request_generation_tokens_count") == 2
    assert get("request_generation_tokens_sum") == 3
    assert get("request_max_num_generation_tokens_sum") == 2
    # decode time 2.0 s over the 3 - 2 tokens after each completion's first
    assert get("request_time_per_output_token_seconds_sum") == 2.0
    assert get("request_params_n_sum") == 2 and get("request_params_max_tokens_sum") == 9
    assert get("request_inference_time_seconds_sum") == 2.5
    assert get("request_prefill_time_seconds_sum") == 0.5
    assert get("request_decode_time_seconds_sum") == 2.0
    info = families(m)["jaxserve:cache_config_info"].samples[0]
    assert info.value == 1 and info.labels == {"block_size": "16", "num_gpu_blocks": "64",
                                               "enable_prefix_caching": "True", "engine": "0"}
    assert m._params == {}


def test_token_buckets_follow_the_context_length_and_iterations_vllms_edges():
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    m = ServerMetrics("tiny")
    m.configure(2048)
    edges = lambda name: [s.labels["le"] for s in families(m)[f"jaxserve:{name}"].samples
                          if s.name.endswith("_bucket")]
    for name in ("request_prompt_tokens", "request_generation_tokens",
                 "request_params_max_tokens", "request_max_num_generation_tokens"):
        assert edges(name)[-2:] == ["2000.0", "+Inf"], name
    assert edges("iteration_tokens_total") == [
        *(f"{float(e)}" for e in (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                   16384)), "+Inf"]


def test_engine_sleep_state_and_every_finish_reason_from_zero():
    m = ServerMetrics("tiny")
    m.update_snapshot({"jaxserve:engine_sleep_state{sleep_state=awake}": 1,
                       "jaxserve:engine_sleep_state{sleep_state=discard_all}": 0})
    fam = families(m)["jaxserve:engine_sleep_state"]
    assert fam.type == "gauge"
    assert {s.labels["sleep_state"]: s.value for s in fam.samples} == {
        "awake": 1, "discard_all": 0}


def test_encoder_cache_figures_under_vllms_names():
    """`--metric-name-prefix vllm`: the encoder cache's lookups and hits are vLLM's
    `mm_cache_queries` / `mm_cache_hits` counters; its row figures are gauges."""
    m = ServerMetrics("tiny", prefix="vllm")
    m.update_snapshot({"jaxserve:mm_cache_queries": 5, "jaxserve:mm_cache_hits": 2,
                       "jaxserve:encoder_cache_misses": 3, "jaxserve:encoder_cache_evictions": 1,
                       "jaxserve:encoder_cache_capacity_rows": 64,
                       "jaxserve:encoder_cache_usage_perc": 0.5})
    fams = families(m)
    for name, value in (("mm_cache_queries", 5), ("mm_cache_hits", 2),
                        ("encoder_cache_misses", 3), ("encoder_cache_evictions", 1)):
        assert fams[f"vllm:{name}"].type == "counter", name
        assert m.registry.get_sample_value(f"vllm:{name}_total", LABELS) == value, name
    for name in ("encoder_cache_capacity_rows", "encoder_cache_usage_perc"):
        assert fams[f"vllm:{name}"].type == "gauge", name
