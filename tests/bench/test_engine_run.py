"""The engine-driving harness, the mode table and the overhead probe on a tiny random model."""

from __future__ import annotations

import os

import pytest

from jaxserve.bench.engine_run import make_llm, run_trace
from jaxserve.bench.overhead import component_overhead, engine_overhead, tiny_model
from jaxserve.bench.simulator import PRESETS, simulate
from jaxserve.bench.throughput import breakdown, format_modes
from jaxserve.bench.workloads import TraceRequest, mixed_trace
from jaxserve.config import SchedulerConfig

# NOTE: a 16-token budget: warm-up compiles three token buckets (4, 8, 16) where 32 made four
# (the file 41 -> 29 s of CPU from an empty cache); the 40-token prompts are chunked in three.
ARGS = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=64)
TRACE = mixed_trace(10, short_prompt=8, long_prompt=40, short_output=6, long_output=3, seed=0)


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer):
    return tiny_model(max_position_embeddings=256), smollm2_tokenizer


# NOTE: one warmed-up chunked engine for the module (the trace, the sampled run, the
# overhead, roofline and pipeline probes): each probe leaves it idle (asserted), and a
# warm-up per test, even from the compilation cache, traced and ran every bucket again.
@pytest.fixture(scope="module")
def llm(tiny):
    model, tok = tiny
    return make_llm(model, tok, **ARGS)


def _run(llm, mode: str) -> dict:
    """The trace through a warmed-up engine in `mode`."""
    res = run_trace(llm.engine, TRACE, prefix=mode)
    return {"summary": res.summary, "breakdown": breakdown(res.steps), "run": res.to_json(),
            "steps": res.steps}


@pytest.fixture(scope="module")
def chunked(llm):
    return _run(llm, "continuous+chunked")


# NOTE: the static mode is a second warmed-up engine (its budget adds a bucket): the tests
# that compare it with the chunked mode run in the slow tier (the default tier checks the
# static mode's admission in tests/core/test_baseline_schedulers.py).
@pytest.fixture(scope="module")
def runs(tiny, chunked):
    model, tok = tiny
    return {"static": _run(make_llm(model, tok, "static", **ARGS), "static"),
            "continuous+chunked": chunked}


@pytest.mark.parametrize("mode", ["continuous+chunked",
                                  pytest.param("static", marks=pytest.mark.slow)])
def test_every_request_gets_its_tokens_and_steps_add_up(request, mode):
    r = request.getfixturevalue("runs")[mode] if mode == "static" else \
        request.getfixturevalue("chunked")
    s = r["summary"]
    assert s["completed"] == len(TRACE)
    assert s["total_output_tokens"] == sum(t.output_len for t in TRACE)
    steps = r["steps"]
    assert sum(st.num_prefill_tokens for st in steps) == sum(t.prompt_len for t in TRACE)
    assert all(st.schedule_s + st.execute_s + st.update_s <= st.seconds for st in steps)
    assert 0 < s["max_kv_usage"] <= 1 and s["num_compilations"] == 0


def test_a_sampled_run_seeds_each_request(llm, chunked, monkeypatch):
    engine, seen = llm.engine, []
    add = engine.add_request

    def recording(request_id, prompt, params, *a, **kw):
        seen.append(params)
        return add(request_id, prompt, params, *a, **kw)

    monkeypatch.setattr(engine, "add_request", recording)
    res = run_trace(engine, TRACE, prefix="sampled",
                    sampling={"temperature": 0.8, "top_p": 0.9, "top_k": 20})
    assert res.summary["completed"] == len(TRACE)
    assert res.summary["total_output_tokens"] == sum(t.output_len for t in TRACE)
    assert {(p.temperature, p.top_p, p.top_k) for p in seen} == {(0.8, 0.9, 20)}
    assert sorted(p.seed for p in seen) == list(range(len(TRACE)))


@pytest.mark.slow
def test_static_waits_for_its_batch_and_chunked_does_not(runs):
    static, chunked = runs["static"]["summary"], runs["continuous+chunked"]["summary"]
    assert chunked["mean_batch_size"] > static["mean_batch_size"]
    assert chunked["num_steps"] < static["num_steps"]


def test_real_runs_report_the_simulator_fields(chunked):
    sim = simulate([TraceRequest(8, 4)] * 3, PRESETS["gpu-8b"], SchedulerConfig(),
                   num_pages=64, max_model_len=64, max_num_batched_tokens=32).summary
    missing = set(sim) - set(chunked["summary"]) - {"host_ms_per_step"}
    assert not missing


@pytest.mark.slow
def test_mode_table_has_ratios_and_breakdown(runs):
    text = format_modes({k: {kk: v for kk, v in r.items() if kk != "steps"}
                         for k, r in runs.items()})
    assert "x static" in text and "decode tok/s" in text
    assert "| continuous+chunked |" in text


def test_plots_are_written(chunked, tmp_path):
    pytest.importorskip("matplotlib")
    from jaxserve.bench.plots import plot_modes

    paths = plot_modes({"continuous+chunked": {k: v for k, v in chunked.items()
                                               if k != "steps"}}, str(tmp_path))
    assert len(paths) == 3 and all(os.path.getsize(p) > 1000 for p in paths)


def test_overhead_probes(llm):
    comp = component_overhead(16, num_steps=3)
    assert comp["total"] > 0 and comp["scheduling"] > 0
    # long block tables: each request's table is sent whole once, then as deltas
    assert component_overhead(4, prompt_len=300, num_steps=3)["step_arrays"] > 0
    res = engine_overhead(llm, 4, prompt_len=8, num_steps=3)
    assert res["host"] > 0 and res["device"] > 0 and 0 < res["host_share"] < 1
    assert not llm.engine.has_unfinished_requests()


def test_roofline_rows(tiny, llm):
    from jaxserve.bench.roofline import decode_step_figures, model_costs, roofline_rows

    model, _ = tiny
    costs = model_costs(model)
    cfg = model.cfg
    per_token = 2 * (cfg.hidden_size * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
                     * cfg.head_dim + 3 * cfg.hidden_size * cfg.intermediate_size
                     + cfg.hidden_size * cfg.vocab_size)
    assert costs["matmul_flops_per_token"] == per_token
    flops, nbytes = decode_step_figures(costs, 4, 100)
    assert flops == 4 * (per_token + 4 * cfg.num_heads * cfg.head_dim * 100)
    assert nbytes > costs["weight_bytes"]
    peaks = {"flops": 1e11, "bytes_per_s": 1e10}
    rows = roofline_rows(llm.engine, [1, 4], 8, peaks, num_steps=3)
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["mfu"] > 0 and r["bw_util"] > 0 and r["step_ms"] > 0 for r in rows)


def test_simulated_device_idle_between_steps(llm):
    """The pipeline probe: with a slow simulated device (200 ms a step) the host's work
    between synchronous steps leaves the device idle, and async scheduling dispatches each
    step before the one before it ends, so the device never waits."""
    from jaxserve.bench.pipeline import pipeline_run

    seconds = []

    def cost(out):
        seconds.append(0.2)
        return 0.2

    sync = pipeline_run(llm, 4, cost, overlap=False, prompt_len=8, num_steps=3)
    overlapped = pipeline_run(llm, 4, cost, overlap=True, prompt_len=8, num_steps=3)
    assert sync["idle_ms"] > 0 and 0 < sync["idle_share"] < 1
    assert overlapped["idle_ms"] == 0.0 and overlapped["idle_share"] == 0.0
    for row in (sync, overlapped):
        assert row["device_ms"] == pytest.approx(200.0)
        assert row["step_ms"] >= 200.0 * 0.99
    assert len(seconds) >= 2 * (3 + 3)  # every dispatched step was costed
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.usage == 0.0


def test_measured_device_stamps_when_each_step_really_ends():
    """The real-device probe over real async XLA work: a step dispatched while the one
    before it runs starts when that one ends (no idle time), a step dispatched after a
    pause leaves the device idle for about that pause."""
    import sys
    import time
    import types

    import jax
    import jax.numpy as jnp

    from jaxserve.bench.pipeline import MeasuredDevice

    # NOTE: ~130 ms on a Zen 4 (15 ms at 800 x 800): long enough that a stalled test thread
    # on a loaded machine still dispatches the second step before the first one ends.
    slow = jax.jit(lambda x: jnp.tanh(x @ x @ x @ x) + x)
    x = jnp.ones((1600, 1600), jnp.float32) * 1e-3
    slow(x).block_until_ready()
    state = {"x": x}

    class Runner:
        def dispatch(self, out):
            state["x"] = slow(state["x"])  # each step reads the one before (as KV does)
            return types.SimpleNamespace(next_input_ids=state["x"])

    runner = Runner()
    switch = sys.getswitchinterval()
    device = MeasuredDevice(types.SimpleNamespace(runner=runner))
    runner.dispatch(None)
    runner.dispatch(None)  # queued behind the first: starts when it ends
    jax.block_until_ready(state["x"])
    before = time.perf_counter()
    time.sleep(0.15)
    pause = time.perf_counter() - before  # NOTE: a loaded machine may oversleep
    runner.dispatch(None)
    idle, span = device.idle()
    spans = device.spans
    device.close()
    assert len(spans) == device.num_dispatched == 3
    for (sent, start, end), nxt in zip(spans, spans[1:] + [None], strict=True):
        assert sent <= start < end
        if nxt is not None:
            assert nxt[1] >= end
    assert spans[0][2] - spans[0][1] > 0.005  # stamped when the work ended, not at once
    assert spans[1][0] < spans[0][2]  # dispatched while the first step ran...
    assert spans[1][1] == spans[0][2]  # ...so it starts when that one ends: no gap
    assert pause - 0.02 <= idle <= pause + 0.05  # the pause (the stamps late by ~0.1 ms)
    assert span == pytest.approx(spans[-1][2] - spans[0][1])
    assert sys.getswitchinterval() == switch and "dispatch" not in vars(runner)


def test_pipeline_on_the_measured_device(llm):
    """`pipeline_run` without a cost model times the engine's real steps: every step is
    stamped, the synchronous engine leaves the device idle while the host works, and the
    runner and the interpreter are left as they were."""
    import sys

    from jaxserve.bench.pipeline import pipeline_run

    dispatch = llm.engine.runner.dispatch
    switch = sys.getswitchinterval()
    rows = [pipeline_run(llm, 4, None, overlap=overlap, prompt_len=8, num_steps=4)
            for overlap in (False, True)]
    for row in rows:
        assert row["device_ms"] > 0 and row["step_ms"] > 0
        assert 0 <= row["idle_share"] < 1 and row["idle_ms"] >= 0
    assert rows[0]["idle_ms"] > 0  # sync: fetch, host work, then the next dispatch
    assert llm.engine.runner.dispatch == dispatch and sys.getswitchinterval() == switch
    assert not llm.engine.has_unfinished_requests() and llm.engine.kv.usage == 0.0


def test_synthetic_steps_hold_the_pages_their_tokens_need():
    from jaxserve.bench.roofline import decode_output, decode_pages, prefill_output

    out = decode_output(3, 31, 16)  # 32 tokens after the new one: two pages each
    assert decode_pages(31, 16) == 2
    assert [r.page_ids for r in out.scheduled] == [[1, 2], [3, 4], [5, 6]]
    assert all(r.token_ids == [5] and r.start_pos == 31 for r in out.scheduled)
    (chunk,) = prefill_output(20, 30, 16).scheduled  # 50 tokens: pages 1-4
    assert chunk.page_ids == [1, 2, 3, 4] and chunk.start_pos == 30
    assert len(chunk.token_ids) == 20 and chunk.num_samples == 1
