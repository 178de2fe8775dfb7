"""`jaxserve diagnose` names the right mechanism on simulator runs built to show each one."""

from __future__ import annotations

import json

import pytest

from jaxserve.bench.diagnose import diagnose, format_diagnosis, load_observations
from jaxserve.bench.simulator import PRESETS, simulate
from jaxserve.bench.workloads import mixed_trace, synthetic_trace
from jaxserve.config import SchedulerConfig
from jaxserve.entrypoints.cli import main


def sim(trace, *, max_num_seqs, num_pages, budget, mode="continuous+chunked",
        max_model_len=2048):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, scheduling_mode=mode,
                          max_num_batched_tokens=budget)
    res = simulate(trace, PRESETS["gpu-8b"], cfg, num_pages=num_pages,
                   max_model_len=max_model_len, max_num_batched_tokens=budget)
    config = {"max_num_seqs": max_num_seqs, "num_kv_blocks": num_pages,
              "max_num_batched_tokens": budget, "scheduling_mode": mode,
              "max_model_len": max_model_len}
    return config, res.summary


CASES = {
    # 48 requests of ~400 tokens into 80 pages (1,280 tokens): preemptions.
    "kv": lambda: sim(synthetic_trace(48, prompt_mean=256, output_mean=160, seed=1),
                      max_num_seqs=32, num_pages=80, budget=512),
    # Plenty of pages, 2 sequence slots: the queue builds behind a full batch.
    "batch": lambda: sim(synthetic_trace(48, prompt_mean=64, output_mean=64, seed=2),
                         max_num_seqs=2, num_pages=4000, budget=512),
    # No chunking, long prompts between decodes: inter-token latency spikes.
    "chunk": lambda: sim(mixed_trace(48, long_prompt=1536, short_output=96, seed=3),
                         max_num_seqs=64, num_pages=8000, budget=2048, mode="continuous"),
}


@pytest.mark.parametrize("mechanism", sorted(CASES))
def test_names_the_built_bottleneck(mechanism):
    config, summary = CASES[mechanism]()
    d = diagnose(config, load_observations(result=summary))
    assert d["bottleneck"] == mechanism, format_diagnosis(d)
    top = d["findings"][0]
    assert top["figures"] and top["advice"]


def test_healthy_config_names_none():
    config, summary = sim(synthetic_trace(16, prompt_mean=64, output_mean=32, seed=4),
                          max_num_seqs=32, num_pages=4000, budget=512)
    assert diagnose(config, load_observations(result=summary))["bottleneck"] == "none"


def test_config_alone_flags_an_undersized_pool():
    d = diagnose({"max_num_seqs": 256, "num_kv_blocks": 512, "max_model_len": 4096},
                 mean_prompt_len=1000, mean_output_len=500)
    assert d["bottleneck"] == "kv" and "holds ~5 requests" in d["findings"][0]["figures"][0]


@pytest.mark.parametrize("kv,pages", [(None, 2912), ("float32", 1456), ("int8", 5482)])
def test_pool_from_memory_follows_the_kv_cache_dtype(kv, pages):
    # 1 GiB of SmolLM2's pages: float16 under "auto" (its GGUF's blocks on the CPU),
    # float32 half as many, int8 (+ scales) ~3.8x float32's.
    config = {"max_num_seqs": 64, "max_model_len": 4096, **({"kv_cache_dtype": kv} if kv else {})}
    d = diagnose(config, mean_prompt_len=1000, mean_output_len=500)
    kv_figures = next(f for f in d["findings"] if f["mechanism"] == "kv")["figures"]
    assert kv_figures[0].startswith(f"pool {pages} pages x 16")


def test_prometheus_snapshot_is_read():
    text = ("# TYPE jaxserve:num_preemptions counter\n"
            'jaxserve:num_preemptions_total{model_name="m"} 40.0\n'
            "# TYPE jaxserve:kv_cache_usage_perc gauge\n"
            'jaxserve:kv_cache_usage_perc{model_name="m"} 0.99\n')
    obs = load_observations(text)
    assert obs["num_preemptions"] == 40 and obs["kv_cache_usage_perc"] == 0.99
    assert diagnose({"max_num_seqs": 8, "num_kv_blocks": 4096}, obs)["bottleneck"] == "kv"


def test_cli_reads_config_and_result(tmp_path, capsys):
    config, summary = CASES["chunk"]()
    (tmp_path / "c.json").write_text(json.dumps(config))
    (tmp_path / "r.json").write_text(json.dumps(summary))
    assert main(["diagnose", "--config", str(tmp_path / "c.json"), "--result",
                 str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Bottleneck: chunk") and "P99 ITL" in out


def test_advice_never_points_the_wrong_way():
    # Issue 19 item 9: with nothing limiting, the advice asked for a pool smaller than the
    # one in use and a max_num_seqs above the current one.
    import re

    from jaxserve.bench.diagnose import diagnose, format_diagnosis

    for seqs in (1, 4, 16, 64, 256):
        for blocks in (64, 512, 4096):
            d = diagnose({"max_num_seqs": seqs, "num_kv_blocks": blocks})
            for finding in d["findings"]:
                for advice in finding["advice"]:
                    m = re.search(r"~(\d+) pages \(now (\d+)\)", advice)
                    if m:
                        assert int(m[1]) > int(m[2]), advice
                    m = re.search(r"lower max_num_seqs to ~(\d+) \(now (\d+)\)", advice)
                    if m:
                        assert int(m[1]) < int(m[2]), advice
                    m = re.search(r"raise max_num_seqs \(now (\d+); the pool holds ~(\d+)", advice)
                    if m:
                        assert int(m[2]) > int(m[1]), advice
    text = format_diagnosis(diagnose({"max_num_seqs": 4}))
    assert "Assumed: mean prompt of 512 tokens" in text and "no observations" in text
