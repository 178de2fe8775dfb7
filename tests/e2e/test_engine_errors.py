"""Engine errors: invalid sampling parameters and engine arguments raise ValueError naming
the field; bad prompts are refused without disturbing the engine; aborted requests free
their pages (device and host) while the other requests finish unaffected.
"""

from __future__ import annotations

import pytest

from jaxserve import LLM, SamplingParams

ENGINE_ARGS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                   num_kv_blocks=9, preemption_mode="swap", enable_prefix_caching=False,
                   attention_backend="xla", warmup=False)
VOCAB = 49152


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    """A small engine: 8 usable pages (one max_model_len sequence), swap preemption. The tiny
    random model: these tests compare the engine with itself (pages, isolation), never
    with another implementation."""
    return LLM(tiny_model_dir, **ENGINE_ARGS)


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.5), ("n", 0), ("max_tokens", 0), ("min_tokens", -1),
    ("logprobs", -2), ("prompt_logprobs", -2), ("presence_penalty", 3.0),
    ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("seed", "x"), ("stop", [""]),
    ("stop_token_ids", [-1]), ("ignore_eos", "yes"), ("n", 1.5),
])
def test_invalid_sampling_params(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_over_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=8, max_tokens=4)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128),
     "max_num_batched_tokens"),
    (dict(preemption_mode="x"), "preemption_mode"),
    (dict(scheduling_policy="lifo"), "scheduling_policy"),
    (dict(scheduling_mode="x"), "scheduling_mode"),
    (dict(block_size=7), "block_size"),
    (dict(dtype="float16"), "dtype"),
    (dict(dtype="bfloat16"), "dtype"),  # differs from the loaded float32 model
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(swap_space=-1), "swap_space"),
    (dict(num_kv_blocks=1), "num_kv_blocks"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(max_model_len=10**6), "max_model_len"),
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(attention_backend="cuda"), "attention backend"),
    (dict(max_logprobs=-2), "max_logprobs"),
    (dict(max_logprobs=1.5), "max_logprobs"),
    (dict(logprobs_mode="processed"), "logprobs_mode"),
    (dict(foo_bar=1), "foo_bar"),
])
def test_invalid_engine_args(smollm2, smollm2_tokenizer, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(smollm2, tokenizer=smollm2_tokenizer, warmup=False, **kwargs)


def _ids(n: int, start: int = 1000) -> dict:
    return {"prompt_token_ids": list(range(start, start + n))}


def _run(engine) -> dict[str, list[int]]:
    """Steps until every request finished; returns the finished outputs' tokens."""
    done = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    raise AssertionError("requests did not finish")


def _used(engine) -> int:
    return engine.kv.stats().num_used_pages


def test_abort_frees_pages_others_unaffected(llm):
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("a", _ids(20), greedy)
    engine.add_request("b", _ids(9, 3000), greedy)
    want = _run(engine)
    assert _used(engine) == 0

    engine.add_request("a", _ids(20), greedy)
    engine.add_request("x", _ids(40, 5000), SamplingParams(n=2, temperature=1.0, max_tokens=10))
    engine.add_request("b", _ids(9, 3000), greedy)
    engine.add_request("w", _ids(30, 7000), greedy)  # waits: the budget is spent
    engine.step()
    engine.step()
    assert engine.kv.has_request("x") and not engine.kv.has_request("w")
    used = _used(engine)
    engine.abort_request(["x", "w", "no-such-request"])
    # Only a's and b's pages are left.
    assert _used(engine) == sum(len(engine.kv.page_ids(r)) for r in "ab") < used
    assert engine.get_num_unfinished_requests() == 2
    got = _run(engine)
    assert got == want  # same tokens as without the aborted requests
    assert _used(engine) == 0
    assert llm.get_metrics()["jaxserve:request_success{finished_reason=abort}"] >= 2


def test_abort_forked_and_swapped_requests(llm):
    """Aborts free fan-out children's pages and a swapped-out request's host slots."""
    engine = llm.engine
    host_total = engine.kv.stats().num_total_host_slots
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"s{i}", _ids(30, 1000 * (i + 1)), long)
    engine.add_request("fan", _ids(10, 9000), SamplingParams(n=3, temperature=1.0, seed=0,
                                                             max_tokens=60))
    got = {}
    for _ in range(60):
        got.update((o.request_id, [c.token_ids for c in o.outputs]) for o in engine.step()
                   if o.finished)
        if engine.scheduler.swapped and engine.kv.has_request("fan#2"):
            break
    swapped = [r.request_id for r in engine.scheduler.swapped]
    assert swapped and engine.kv.stats().num_free_host_slots < host_total
    victims = {engine.scheduler.requests[r].user_request_id for r in swapped} | {"fan"}
    engine.abort_request(sorted(victims))
    assert not any(engine.kv.has_request(r) for r in [*swapped, "fan", "fan#1", "fan#2"])
    assert engine.kv.stats().num_free_host_slots == host_total
    got.update(_run(engine))
    assert set(got) == {f"s{i}" for i in range(3)} - victims and got
    assert all(len(t[0]) == 60 for t in got.values())
    assert _used(engine) == 0 and engine.kv.stats().num_free_host_slots == host_total
    assert llm.get_metrics()["jaxserve:num_swap_outs"] > 0


def test_prompt_over_max_model_len(llm, smollm2_tokenizer):
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    (before,) = llm.generate("Once upon a time", greedy, use_tqdm=False)
    for too_long in (_ids(129), _ids(128), " ".join(["word"] * 200)):
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate(["The three primary colors are", too_long], greedy, use_tqdm=False)
        # No request of the failed call is left queued.
        assert not llm.engine.has_unfinished_requests() and _used(llm.engine) == 0
    (after,) = llm.generate("Once upon a time", greedy, use_tqdm=False)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


@pytest.mark.parametrize("prompt, match", [
    (_ids(2, VOCAB - 1), "outside"), ({"prompt_token_ids": [5, -1]}, "outside"),
    ({"prompt_token_ids": []}, "empty"), ({"text": "hi"}, "prompt"), (3.5, "prompt"),
])
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["ok", prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_bad_requests(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="n=5"):
        llm.generate("hi", SamplingParams(n=5), use_tqdm=False)  # max_num_seqs is 4
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    engine.add_request("dup", "hi", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    assert list(_run(engine)) == ["dup"]


@pytest.mark.parametrize("field, value, words", [
    ("logprobs", 21, "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ("logprobs", -1, f"Requested sample logprobs of {VOCAB}, which is greater than max "
                     "allowed: 20"),
    ("prompt_logprobs", 21, "Requested prompt logprobs of 21, which is greater than max "
                            "allowed: 20"),
    ("prompt_logprobs", -1, f"Requested prompt logprobs of {VOCAB}, which is greater than max "
                            "allowed: 20"),
])
def test_logprobs_over_max_logprobs(llm, field, value, words):
    """The default max_logprobs (20) with vLLM's words (-1 counts as the vocabulary); nothing
    is queued, and the error names the field for the server (`ParameterError.parameter`)."""
    with pytest.raises(ValueError) as info:
        llm.generate(["ok", "hi"], SamplingParams(max_tokens=2, **{field: value}),
                     use_tqdm=False)
    assert str(info.value) == words and info.value.parameter == field
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate(["ok"], SamplingParams(max_tokens=1, **{field: 20}), use_tqdm=False)
    assert out.outputs[0].token_ids


def test_failed_step_leaves_nothing_queued(llm, monkeypatch):
    """A step that raises ends the generate call's requests: pages freed, engine usable."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    (before,) = llm.generate("Once upon a time", greedy, use_tqdm=False)
    runner = llm.engine.runner
    calls = []

    def failing_dispatch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return type(runner).dispatch(runner, *args, **kwargs)

    monkeypatch.setattr(runner, "dispatch", failing_dispatch)
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(["Once upon a time", "Hello"], greedy, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests() and _used(llm.engine) == 0
    (after,) = llm.generate("Once upon a time", greedy, use_tqdm=False)
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


def test_a_step_that_fails_before_the_device_is_taken_back(llm, monkeypatch):
    """A step whose inputs fail to build (scheduled, never dispatched) is taken back whole:
    the page copies the scheduler planned still run, its table deltas are sent again, and
    its requests compute the step's tokens later, ending with the tokens of a run without
    the failure. Here the failing step is the one after an n=2 fork (copy-on-write of the
    shared page) and later ones."""
    engine = llm.engine
    fork = SamplingParams(temperature=0.0, max_tokens=8, n=2, ignore_eos=True)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def submit():
        engine.add_request("a", _ids(20), fork)
        engine.add_request("b", _ids(9, 3000), plain)

    submit()
    want = _run(engine)
    build = engine.sampling_inputs.gather
    for fail_at in (2, 3, 5):
        def failing(*args, calls=[], fail_at=fail_at, **kwargs):  # noqa: B006 - a counter
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError("inputs lost")
            return build(*args, **kwargs)

        monkeypatch.setattr(engine.sampling_inputs, "gather", failing)
        submit()
        with pytest.raises(RuntimeError, match="inputs lost"):
            _run(engine)
        assert _run(engine) == want, fail_at
        monkeypatch.undo()
        assert _used(engine) == 0
        assert engine.step() == []  # an empty step releases the last finished rows
        rows = engine.runner.block_tables
        assert rows.num_kept == 0 and rows.num_free == len(rows.table)
        kept = engine.runner.sampling_rows  # sampling rows go with the tables
        assert kept.num_kept == 0 and kept.num_free == len(kept.floats) - 1
