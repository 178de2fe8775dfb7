"""`bench serve`'s client against an in-process server over a fake engine (loopback only)."""

from __future__ import annotations

import asyncio

import pytest

from jaxserve.bench.report import serve_block
from jaxserve.bench.serve_client import parse_goodput, run_serve_benchmark
from jaxserve.bench.workloads import synthetic_trace, trace_token_ids
from tests.entrypoints.conftest import fake_server


@pytest.fixture(scope="module")
def server():
    with fake_server() as url:
        yield url


def test_poisson_streaming_run_reports_vllm_fields(server):
    trace = synthetic_trace(12, prompt_mean=8, prompt_spread=2, output_mean=6,
                            output_spread=2, rate=200.0, seed=1)
    ids = trace_token_ids(trace, 1000)
    res = asyncio.run(run_serve_benchmark(server, trace, ids, max_concurrency=4,
                                          goodput=parse_goodput(["ttft:10000"])))
    assert res["completed"] == 12 and res["failed"] == 0 and res["model_id"] == "fake"
    assert res["total_output_tokens"] == sum(r.output_len for r in trace)
    assert res["total_input_tokens"] == sum(r.prompt_len for r in trace)
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p99"):
            assert res[f"{stat}_{name}_ms"] >= 0
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    text = serve_block(res)
    assert "Successful requests:" in text and "Mean TTFT (ms):" in text
    assert "P99 ITL (ms):" in text and "Output token throughput (tok/s):" in text


def test_goodput_spec_is_checked():
    assert parse_goodput(["ttft:500", "e2el:2000"]) == {"slo_ttft_ms": 500.0,
                                                        "slo_e2el_ms": 2000.0}
    with pytest.raises(ValueError, match="ttft, tpot or e2el"):
        parse_goodput(["itl:5"])
    with pytest.raises(ValueError, match="positive"):
        parse_goodput(["ttft:x"])
