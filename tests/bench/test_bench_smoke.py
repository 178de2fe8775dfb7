"""Smoke test: every `jaxserve bench ...` subcommand and `jaxserve diagnose` run end to end
(throughput, prefix, scale, overhead, structured and quant in the slow tier).

Each command runs through `main([...])` on the tiny random model of `tests/conftest.py` with
tiny sizes, and must exit 0, print its table and write parseable `--output-json`. The engine
flags are the same for every command (the persistent compilation cache then serves the
programs one command compiled to the next). `bench serve` loads an in-process server over
a fake engine on a free loopback port.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import io
import json
import os
import re
import sys
import tomllib
from types import SimpleNamespace

import pytest

from jaxserve.entrypoints.cli import main

# One engine shape for every command: a single token bucket (16) with chunked prefill.
# NOTE: 8 sequences and 80 pages are also what `bench scale` picks for its 8-request level
# and its context sweep below (at least 8 sequences, 64 + a few pages), so those engines'
# programs come from the compilation cache.
ENGINE = ["--max-model-len", "32", "--num-kv-blocks", "80", "--max-num-batched-tokens", "16",
          "--max-num-seqs", "8"]
TRACE = ["--trace", "synthetic", "--num-requests", "3", "--input-len", "8", "--output-len", "4"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Imported by the benchmarks but needed only by the transformers baseline, which is skipped
# with a note without them.
OPTIONAL = {"torch", "accelerate"}


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `jaxserve argv` run in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def ok(argv: list[str]) -> tuple[str, str]:
    """Runs `jaxserve argv`, asserts exit code 0 and no traceback; returns (stdout, stderr)."""
    code, out, err = run_cli(argv)
    assert code == 0, f"jaxserve {' '.join(argv)} exited {code}\n{out}\n{err}"
    assert "Traceback" not in err, err
    return out, err


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def model_flags(tiny_model_dir) -> list[str]:
    return ["--model", tiny_model_dir, *ENGINE]


@pytest.fixture(scope="module")
def throughput_run(model_flags, tmp_path_factory):
    """`bench throughput` over two scheduling modes, with plots; its JSON feeds `diagnose`."""
    pytest.importorskip("matplotlib")
    d = tmp_path_factory.mktemp("throughput")
    path, plots = str(d / "throughput.json"), str(d / "plots")
    out, err = ok(["bench", "throughput", *model_flags, *TRACE, "--modes",
                   "static,continuous+chunked", "--baseline", "none", "--output-json", path,
                   "--plot-dir", plots])
    return SimpleNamespace(out=out, err=err, json=path, plots=plots)


@pytest.mark.slow
def test_throughput(throughput_run):
    assert "| run | req/s | total tok/s | output tok/s |" in throughput_run.out
    assert "| mode | steps | prefill steps |" in throughput_run.out
    res = read_json(throughput_run.json)
    assert set(res["results"]) == {"static", "continuous+chunked"}
    assert res["engine_args"]["max_model_len"] == 32
    for r in res["results"].values():
        assert r["summary"]["completed"] == 3 and r["summary"]["output_throughput"] > 0
    assert any(f.endswith(".png") for f in os.listdir(throughput_run.plots))


@pytest.mark.slow  # transformers' static generate on the tiny model: the slowest smoke run
def test_throughput_transformers_baseline(model_flags, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    path = str(tmp_path / "t.json")
    out, _ = ok(["bench", "throughput", *model_flags, *TRACE, "--modes", "continuous+chunked",
                 "--baseline", "transformers", "--hf-batch-size", "2", "--output-json", path])
    assert "| transformers-static |" in out
    assert read_json(path)["results"]["transformers-static"]["summary"]["output_throughput"] > 0


@pytest.mark.slow  # a benchmark smoke run
def test_throughput_without_torch_skips_the_baseline(model_flags, monkeypatch, tmp_path):
    import jaxserve.bench.hf_baseline as hf_baseline

    monkeypatch.setattr(hf_baseline, "torch_missing",
                        lambda: "torch not installed (pip install torch)")
    path = str(tmp_path / "t.json")
    out, err = ok(["bench", "throughput", *model_flags, *TRACE, "--modes",
                   "continuous+chunked", "--output-json", path])
    notes = [line for line in err.splitlines() if "baseline" in line]
    assert notes == ["[jaxserve] transformers baseline skipped: torch not installed "
                     "(pip install torch)"], err
    assert "| continuous+chunked |" in out
    assert set(read_json(path)["results"]) == {"continuous+chunked"}


@pytest.mark.slow
def test_prefix(tiny_model_dir, tmp_path):
    path = str(tmp_path / "p.json")
    # NOTE: the shared-prefix trace's suffixes and outputs average 32 tokens: a longer
    # max_model_len than the other commands.
    flags = ENGINE[:]
    flags[flags.index("--max-model-len") + 1] = "128"
    out, _ = ok(["bench", "prefix", "--model", tiny_model_dir, *flags, "--num-requests", "3",
                 "--prefix-len", "16", "--output-json", path])
    assert "| run | hit rate | mean TTFT ms |" in out
    res = read_json(path)["results"]
    assert "prefix caching off" in res and len(res) == 2


@pytest.mark.slow  # a benchmark smoke run
def test_latency(model_flags, tmp_path):
    path = str(tmp_path / "l.json")
    out, _ = ok(["bench", "latency", *model_flags, "--batch-size", "2", "--input-len", "8",
                 "--output-len", "4", "--num-iters", "2", "--num-iters-warmup", "1",
                 "--output-json", path])
    assert "Avg latency:" in out and "99% percentile latency:" in out
    assert read_json(path)["engine_args"]["max_num_seqs"] == 8


@pytest.mark.slow  # a benchmark smoke run
def test_roofline(model_flags, tmp_path):
    path = str(tmp_path / "r.json")
    out, _ = ok(["bench", "roofline", *model_flags, "--batch-sizes", "1,2", "--context-len",
                 "16", "--num-steps", "2", "--output-json", path])
    assert "| batch | context | step ms |" in out and "peak matmul" in out
    assert [r["batch"] for r in read_json(path)["rows"]] == [1, 2]


@pytest.mark.slow
def test_scale(model_flags, tmp_path):
    pytest.importorskip("matplotlib")
    path, plots = str(tmp_path / "s.json"), str(tmp_path / "plots")
    # NOTE: the 8-request level and the context sweep (27 + 4 output tokens: max_model_len 32)
    # run ENGINE's shape; the 1-request level compiles its own.
    out, _ = ok(["bench", "scale", *model_flags, "--concurrency", "1,8", "--contexts", "8,27",
                 "--context-batch", "2", "--input-len", "8", "--output-len", "4",
                 "--skip-warmup", "--output-json", path, "--plot-dir", plots])
    assert "| concurrent requests | output tok/s |" in out
    assert "| context | batch | output tok/s |" in out
    res = read_json(path)
    assert [r["concurrency"] for r in res["concurrency"]] == [1, 8]
    assert [r["context"] for r in res["context"]] == [8, 27]
    assert sorted(os.listdir(plots)) == ["scale_concurrency.png", "scale_context.png"]


@pytest.mark.slow
def test_scale_warmup_probes(model_flags, tmp_path):
    """The cold/warm warm-up probes: two fresh processes, each compiling from nothing (an
    engine's own --compilation-cache-dir gives way to the probes' fresh one)."""
    path = str(tmp_path / "w.json")
    out, _ = ok(["bench", "scale", *model_flags, "--warmup-only", "--output-json", path,
                 "--compilation-cache-dir", str(tmp_path / "cache")])
    assert "| compilation cache | buckets |" in out and "warm / cold warm-up:" in out
    assert set(read_json(path)["warmup"]) == {"cold", "warm"}


@pytest.mark.slow
def test_overhead(tiny_model_dir, tmp_path):
    path = str(tmp_path / "o.json")
    out, _ = ok(["bench", "overhead", "--model", tiny_model_dir, "--num-running", "2,4",
                 "--skip-pipeline",
                 "--output-json", path])
    assert "| running | schedule | update_from_output |" in out
    assert "| outputs | running | scheduling | input prep |" in out
    res = read_json(path)
    assert [(r["output_kind"], r["num_running"]) for r in res["engine"]] == [
        ("cumulative", 2), ("cumulative", 4), ("final_only", 2), ("final_only", 4)]


@pytest.fixture(scope="module")
def fake_server_url():
    """An OpenAI-compatible server over a fake engine (no model) on a free loopback port."""
    from tests.entrypoints.conftest import fake_server

    with fake_server(step_seconds=0.002) as url:
        yield url


def test_serve(fake_server_url, tmp_path):
    pytest.importorskip("httpx")
    path = str(tmp_path / "s.json")
    out, _ = ok(["bench", "serve", "--base-url", fake_server_url, *TRACE, "--max-concurrency", "2",
                 "--goodput", "ttft:10000", "--output-json", path])
    assert "Serving Benchmark Result" in out and "Successful requests:" in out
    res = read_json(path)
    assert res["completed"] == 3 and res["failed"] == 0 and res["model_id"] == "fake"


@pytest.mark.slow
def test_diagnose_from_a_bench_result(throughput_run):
    out, _ = ok(["diagnose", "--config", throughput_run.json, "--result", throughput_run.json])
    assert all(f"\n[{m}] " in out for m in ("kv", "batch", "chunk")), out
    assert "of a 16-token budget" in out  # read from the result's engine args and steps
    out, _ = ok(["diagnose", "--config", throughput_run.json, "--result", throughput_run.json,
                 "--json"])
    d = json.loads(out)
    assert d["bottleneck"] in ("none", "kv", "batch", "chunk") and d["findings"]


def test_diagnose_with_engine_flags_only():
    out, _ = ok(["diagnose", *ENGINE])
    assert all(f"\n[{m}] " in out for m in ("kv", "batch", "chunk")), out
    assert "max_num_seqs=8" in out


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-")
            for r in reqs}


def test_bench_extra_covers_what_the_benchmarks_import():
    """`pip install -e '.[bench]'` is enough: every third-party module the benchmark code
    (jaxserve/bench and the `bench` / `diagnose` commands) imports is a core dependency or
    in the `bench` extra, torch and accelerate (the optional baseline) aside."""
    from importlib.metadata import packages_distributions

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert "bench" in project["optional-dependencies"]
    declared = _requirement_names(project["dependencies"]
                                  + project["optional-dependencies"]["bench"])
    files = glob.glob(os.path.join(ROOT, "jaxserve", "bench", "*.py")) + glob.glob(
        os.path.join(ROOT, "jaxserve", "entrypoints", "cli", "bench*.py")) + [
        os.path.join(ROOT, "jaxserve", "entrypoints", "cli", "diagnose.py")]
    modules = set()
    for path in files:
        with open(path) as f:
            for node in ast.walk(ast.parse(f.read())):
                if isinstance(node, ast.Import):
                    modules |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    modules.add(node.module.split(".")[0])
    modules -= set(sys.stdlib_module_names) | {"jaxserve", "models", "pallas_kernels"} | OPTIONAL
    dists = packages_distributions()
    missing = {m: dists.get(m) for m in modules
               if not _requirement_names(dists.get(m, [m])) & declared}
    assert not missing, f"imported by the benchmarks but not in the bench extra: {missing}"


def test_throughput_peer_row(fake_server_url):
    """`bench throughput --peer-url`: the trace streamed to another OpenAI-compatible
    server becomes a row, and the engine modes are compared with it."""
    pytest.importorskip("httpx")
    from jaxserve.bench.throughput import format_modes, run_peer
    from jaxserve.bench.workloads import mixed_trace, trace_token_ids

    trace = mixed_trace(4, short_prompt=8, long_prompt=16, short_output=3, long_output=2,
                        seed=0)
    peer = run_peer(fake_server_url, trace, trace_token_ids(trace, 1000), log=lambda *a: None)
    s = peer["summary"]
    assert s["completed"] == 4 and s["failed"] == 0
    assert s["total_output_tokens"] == sum(r.output_len for r in trace)
    engine = {"summary": {**s, "output_throughput": 2 * s["output_throughput"]}}
    text = format_modes({"continuous+chunked": engine, "llama-server": peer},
                        "continuous+chunked")
    assert "| llama-server |" in text
    assert "continuous+chunked / llama-server: 2.00x" in text


def test_throughput_peer_unreachable():
    pytest.importorskip("httpx")
    from jaxserve.bench.throughput import run_peer
    from jaxserve.bench.workloads import mixed_trace

    trace = mixed_trace(2, short_prompt=4, long_prompt=8, short_output=2, long_output=2)
    with pytest.raises(RuntimeError, match="peer http://127.0.0.1:9: cannot reach it"):
        run_peer("http://127.0.0.1:9", trace, [[5, 6, 7]] * 2, log=lambda *a: None)


@pytest.mark.slow
def test_structured(tiny_model_dir, tmp_path):
    path = str(tmp_path / "s.json")
    out, _ = ok(["bench", "structured", "--model", tiny_model_dir, "--rows", "1,3",
                 "--steps", "4", "--batch", "3", "--max-tokens", "6", "--repeats", "1",
                 "--output-json", path])
    assert "| constrained rows | engine ms/step |" in out and "| rep | batch |" in out
    res = read_json(path)
    assert [r["rows"] for r in res["masks"]] == [1, 3]
    assert all(r["batched_ms"] > 0 and r["single_ms"] > 0 for r in res["masks"])
    assert [r["batch"] for r in res["throughput"]] == ["none", "all constrained"]
    assert all(r["tokens"] > 0 and r["compiles"] == 0 for r in res["throughput"])


@pytest.mark.slow
def test_quant_speed_only(tiny_model_dir, tmp_path):
    path = str(tmp_path / "q.json")
    out, _ = ok(["bench", "quant", "--model", tiny_model_dir, "--modes",
                 "float32,kv int8,float32", "--speed-only", "--batch-sizes", "1,2",
                 "--context-len", "16", "--output-json", path])
    assert "| mode | weights MiB | KV B/token |" in out
    rows = read_json(path)["rows"]
    assert [r["mode"] for r in rows] == ["float32", "kv int8", "float32"]  # as asked
    assert rows[1]["kv_bytes_per_token"] < rows[0]["kv_bytes_per_token"] / 3
    assert all(r["tok_s_b1"] > 0 and r["tok_s_b2"] > 0 for r in rows)
