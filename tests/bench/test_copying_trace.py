"""The copying trace: seeded chat prompts holding the copied span; prompt ids in traces."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jaxserve.bench.copying import copying_task, copying_trace
from jaxserve.bench.workloads import (
    load_trace,
    save_trace,
    shared_prefix_trace,
    synthetic_trace,
    trace_token_ids,
)

N = 12


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def trace(tok):
    return copying_trace(tok, N, seed=3)


def test_same_seed_same_trace_other_seed_differs(tok, trace):
    assert copying_trace(tok, N, seed=3) == trace
    other = copying_trace(tok, N, seed=4)
    assert [r.prompt_ids for r in other] != [r.prompt_ids for r in trace]
    assert len(trace) == N and all(r.arrival_time == 0.0 for r in trace)  # no rate: all at 0


def test_prompt_ids_are_concrete_and_match_the_length(trace):
    for r in trace:
        assert isinstance(r.prompt_ids, tuple) and all(type(t) is int for t in r.prompt_ids)
        assert r.prompt_len == len(r.prompt_ids) > 0
        assert r.prefix_id is None and r.prefix_len == 0


@pytest.mark.parametrize("extra", [8, 0])
def test_each_prompt_is_a_chat_user_message_holding_the_copied_span(tok, trace, extra):
    """The trace's tasks are `copying_task`'s, drawn in order from the same seed (no rate:
    the arrivals take nothing from the generator); each prompt decodes to SmolLM2's chat
    format around the instruction, and the output is the span's tokens plus `extra`."""
    reqs = trace if extra == 8 else copying_trace(tok, N, seed=3, extra_output=0)
    rng = np.random.default_rng(3)
    kinds = set()
    for r in reqs:
        instruction, span = copying_task(rng)
        assert span and span in instruction
        text = tok.decode(list(r.prompt_ids))
        assert f"<|im_start|>user\n{instruction}<|im_end|>\n" in text
        assert text.startswith("<|im_start|>") and text.endswith("<|im_start|>assistant\n")
        assert r.output_len == len(tok(span).input_ids) + extra
        kinds.add(instruction.splitlines()[-1].split()[0])
    assert kinds == {"Quote", "Rewrite", "Each"}  # all three task kinds in 12 draws


def test_a_rate_gives_increasing_arrival_times(tok):
    t = copying_trace(tok, 6, rate=4.0, seed=1)
    times = [r.arrival_time for r in t]
    assert times[0] > 0 and all(b > a for a, b in zip(times, times[1:], strict=False))
    assert all(r.prompt_len == len(r.prompt_ids) for r in t)
    with pytest.raises(ValueError, match="rate must be positive"):
        copying_trace(tok, 2, rate=0.0)


def test_trace_token_ids_returns_the_prompt_ids(trace):
    ids = trace_token_ids(trace, 49152, avoid=(0, 1, 2))
    assert ids == [list(r.prompt_ids) for r in trace]
    assert all(type(i) is list for i in ids)


def test_requests_without_prompt_ids_keep_their_random_ids(trace):
    """A request with prompt ids draws nothing from the generator, so the random ids of the
    others (shared prefixes included) are those of the same trace without it."""
    others = (synthetic_trace(3, prompt_mean=10, prompt_spread=4, seed=0)
              + shared_prefix_trace(3, prefix_len=6, suffix_mean=4, seed=0))
    mixed = [trace[0], others[0], others[1], trace[1], *others[2:], trace[2]]
    avoid = (0, 1, 2)
    ids = trace_token_ids(mixed, 1000, seed=7, avoid=avoid)
    assert [ids[0], ids[3], ids[-1]] == [list(r.prompt_ids) for r in trace[:3]]
    random_ids = [x for x, r in zip(ids, mixed, strict=True) if r.prompt_ids is None]
    assert random_ids == trace_token_ids(others, 1000, seed=7, avoid=avoid)
    for x, r in zip(random_ids, others, strict=True):
        assert len(x) == r.prompt_len and all(3 <= t < 1000 for t in x)
    assert random_ids[3][:6] == random_ids[4][:6] == random_ids[5][:6]  # one shared prefix
    assert trace_token_ids(others, 1000, seed=8, avoid=avoid) != random_ids  # they are seeded


def test_save_and_load_round_trip_with_and_without_prompt_ids(trace, tmp_path):
    plain = synthetic_trace(4, rate=2.0, seed=0) + shared_prefix_trace(2, prefix_len=8, seed=0)
    mixed = [*trace[:3], *plain]
    path = str(tmp_path / "t.jsonl")
    save_trace(path, mixed)
    back = load_trace(path)
    assert back == mixed
    assert all(isinstance(r.prompt_ids, tuple) for r in back[:3])
    assert all(r.prompt_ids is None for r in back[3:])
    # A request written before prompt_ids existed (no such key) still loads.
    old = tmp_path / "old.jsonl"
    fields = {k: v for k, v in dataclasses.asdict(plain[0]).items() if k != "prompt_ids"}
    old.write_text(json.dumps(fields) + "\n")
    assert load_trace(str(old)) == [plain[0]]


def test_prompt_ids_survive_the_round_trip_into_trace_token_ids(trace, tmp_path):
    path = str(tmp_path / "c.jsonl")
    save_trace(path, trace)
    assert trace_token_ids(load_trace(path), 49152) == trace_token_ids(trace, 49152)


def test_make_trace_builds_copying_without_a_model_flag():
    """`bench serve` has no --model: the copying trace then uses the default model's
    tokenizer; a request rate changes arrival times only, not the prompts."""
    from argparse import Namespace

    from jaxserve.entrypoints.cli.bench import make_trace

    args = Namespace(trace="copying", num_requests=2, request_rate=None, save_trace=None)
    plain = make_trace(args)
    timed = make_trace(Namespace(**{**vars(args), "request_rate": 2.0}))
    assert [r.prompt_ids for r in plain] == [r.prompt_ids for r in timed]
    assert all(r.arrival_time == 0.0 for r in plain) and timed[1].arrival_time > 0
