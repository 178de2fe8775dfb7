"""`AsyncLLM` over a fake engine: streaming, concurrency, aborts, rejections, failures, shutdown."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from jaxserve.sampling_params import SamplingParams
from tests.entrypoints.conftest import wait_for
from tests.entrypoints.fake_engine import FakeEngine


@pytest.fixture
def llm():
    llm = AsyncLLM(FakeEngine(), log_interval=0)
    yield llm
    llm.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def collect(llm, rid, max_tokens, prompt="p"):
    return [out async for out in llm.generate(prompt, SamplingParams(max_tokens=max_tokens), rid)]


def test_streams_cumulative_outputs_until_finished(llm):
    outs = run(collect(llm, "a", 5))
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [0, 1, 2, 3, 4]
    assert outs[-1].outputs[0].text == "t0 t1 t2 t3 t4 "
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and not any(o.finished for o in outs[:-1])


def test_many_concurrent_requests_each_get_their_own_stream(llm):
    async def main():
        return await asyncio.gather(*(collect(llm, f"r{i}", 3 + i % 4) for i in range(40)))

    for i, outs in enumerate(run(main())):
        assert outs[-1].request_id == f"r{i}"
        assert len(outs[-1].outputs[0].token_ids) == 3 + i % 4


def test_consumer_leaving_aborts_the_request(llm):
    async def main():
        async for out in llm.generate("p", SamplingParams(max_tokens=1000), "leaver"):
            if len(out.outputs[0].token_ids) >= 2:
                break

    run(main())
    deadline = time.time() + 5
    while "leaver" not in llm.engine.aborted and time.time() < deadline:
        time.sleep(0.01)
    assert llm.engine.aborted == ["leaver"]
    assert not llm.engine.running


def test_cancelled_consumer_aborts_the_request(llm):
    async def main():
        task = asyncio.ensure_future(collect(llm, "slow", 1000))
        deadline = time.time() + 20  # NOTE: inside run()'s 30 s
        while "slow" not in llm.engine.running:  # NOTE: in the engine before it is cancelled
            assert time.time() < deadline
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    deadline = time.time() + 5
    while "slow" not in llm.engine.aborted and time.time() < deadline:
        time.sleep(0.01)
    assert "slow" in llm.engine.aborted


def test_rejected_request_raises_and_others_continue(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        run(collect(llm, "bad", 3, prompt=""))
    assert run(collect(llm, "good", 2))[-1].finished


def test_step_failure_fails_in_flight_requests_and_keeps_serving():
    llm = AsyncLLM(FakeEngine(fail_on="crash"), log_interval=0)
    try:
        with pytest.raises(RuntimeError, match="engine step failed"):
            run(collect(llm, "x", 5, prompt="crash"))
        assert run(collect(llm, "y", 2))[-1].finished
    finally:
        llm.shutdown()


def test_shutdown_ends_pending_streams_and_refuses_new_requests():
    llm = AsyncLLM(FakeEngine(step_seconds=0.05), log_interval=0)

    async def main():
        task = asyncio.ensure_future(collect(llm, "long", 10_000))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(llm.shutdown)
        with pytest.raises(EngineDeadError):
            await task
        with pytest.raises(EngineDeadError):
            await collect(llm, "late", 2)

    run(main())
    assert not llm.is_running


def test_metrics_snapshot_follows_the_engine(llm):
    run(collect(llm, "m", 3))
    # NOTE: the last output reaches the stream before the engine thread takes its snapshot.
    assert wait_for(lambda: (snap := llm.get_metrics())["jaxserve:num_requests_running"] == 0
                    and snap["jaxserve:generation_tokens"] >= 3, 30)
    reg, labels = llm.metrics.registry, {"model_name": "jaxserve", "engine": "0"}
    assert reg.get_sample_value("jaxserve:e2e_request_latency_seconds_count", labels) == 1
    assert reg.get_sample_value("jaxserve:time_to_first_token_seconds_count", labels) == 1
    assert reg.get_sample_value("jaxserve:inter_token_latency_seconds_count", labels) == 2
    # token-count edges up to the engine's max_model_len (64 here: 1, 2, 5, ..., 50)
    assert reg.get_sample_value("jaxserve:request_prompt_tokens_bucket",
                                {**labels, "le": "50.0"}) == 1
    assert reg.get_sample_value("jaxserve:request_prompt_tokens_bucket",
                                {**labels, "le": "100.0"}) is None


def test_abort_by_id_ends_the_consumer_with_finish_reason_abort(llm):
    # Issue 12 item 6: `AsyncLLM.abort(id)` left the consumer blocked forever.
    async def main():
        outs = []
        async for out in llm.generate("p", SamplingParams(max_tokens=10_000), "victim"):
            outs.append(out)
            if len(outs) == 2:
                llm.abort("victim")
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert llm.engine.aborted == ["victim"] and not llm.engine.running


def test_dropped_stream_aborts_its_request(llm):
    # Issue 12 item 7: AsyncLLM held streams strongly, so a dropped one ran to max_tokens.
    async def main():
        await llm.add_request("dropped", "p", SamplingParams(max_tokens=10_000))
        # the stream is dropped here, never iterated

    run(main())
    gc.collect()
    assert wait_for(lambda: "dropped" in llm.engine.aborted)
    assert not llm.engine.running


def test_closed_consumer_loop_aborts_its_request(llm):
    async def main():
        return await llm.add_request("orphan", "p", SamplingParams(max_tokens=10_000))

    stream = asyncio.run(main())  # the loop is closed; the stream itself is kept alive
    assert wait_for(lambda: "orphan" in llm.engine.aborted)
    assert stream.finished and not llm.engine.running


def test_many_prompts_enter_the_engine_together():
    # Issue 12 item 8: prompts of one request were admitted one per engine step.
    llm = AsyncLLM(FakeEngine(step_seconds=0.02), log_interval=0)
    try:
        async def main():
            streams = await llm.add_requests([(f"b-{i}", "p") for i in range(32)],
                                             SamplingParams(max_tokens=3))
            return [[out async for out in s] for s in streams]

        results = run(main())
        assert all(r[-1].finished for r in results)
        assert len(set(llm.engine.added_at_step.values())) == 1
    finally:
        llm.shutdown()


def test_batch_add_is_all_or_none(llm):
    async def main():
        await llm.add_requests([("ok-1", "p"), ("ok-2", "p"), ("bad", "")],
                               SamplingParams(max_tokens=1000))

    with pytest.raises(ValueError, match="prompt is empty"):
        run(main())
    assert wait_for(lambda: not llm.engine.running)
    assert sorted(llm.engine.aborted) == ["ok-1", "ok-2"]


class FailingEngine(FakeEngine):
    """Fails one request on its own (finish_reason "error"), as LLMEngine isolates it."""

    def step(self):
        outputs = super().step()
        for out in outputs:
            if out.prompt == "poison":
                out.finished, out.error = True, "ValueError: bad row"
                out.outputs[0].finish_reason = "error"
                self.running.pop(out.request_id, None)
        return outputs


def test_a_failed_request_raises_and_its_neighbours_finish():
    llm = AsyncLLM(FailingEngine(), log_interval=0)
    try:
        async def main():
            poison = asyncio.ensure_future(collect(llm, "x", 5, prompt="poison"))
            good = await asyncio.gather(*(collect(llm, f"g{i}", 4) for i in range(8)))
            with pytest.raises(RequestFailedError, match="bad row"):
                await poison
            return good

        for outs in run(main()):
            assert outs[-1].finished and outs[-1].outputs[0].token_ids == [0, 1, 2, 3]
    finally:
        llm.shutdown()


def test_gauges_show_a_request_before_the_step_that_takes_it_in():
    """The running/waiting gauges follow arrivals within a step (issue 13 item 9)."""
    engine = FakeEngine(step_seconds=0.05)
    llm = AsyncLLM(engine, log_interval=0)
    seen = []  # (running requests the engine holds, running gauge) at each step's start
    step = engine.step

    def recording_step():
        gauge = llm.metrics.snapshot.get("jaxserve:num_requests_running", 0)
        seen.append((len(engine.running), gauge))
        return step()

    engine.step = recording_step
    try:
        async def main():
            first = asyncio.ensure_future(collect(llm, "a", 6))
            await asyncio.sleep(0.12)
            await collect(llm, "b", 2)
            await first

        run(main())
    finally:
        llm.shutdown()
    assert len(seen) >= 6 and all(held == gauge for held, gauge in seen)
