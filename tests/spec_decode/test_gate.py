"""The gate that pauses proposals while acceptance stays below break-even."""

from __future__ import annotations

import pytest

from jaxserve.spec_decode.gate import AcceptanceGate, break_even, expected_tokens


def test_break_even_solves_expected_tokens():
    a = break_even(3, 1.3)
    assert expected_tokens(a, 3) == pytest.approx(1.3, abs=1e-6)
    assert 0.2 < a < 0.25
    assert break_even(3, 4.3) == 1.0  # k=3 gives at most 4 tokens: never pays
    assert break_even(3, 1.0) == pytest.approx(0.0, abs=1e-6)  # free proposals always pay


def test_pauses_double_while_failing_and_reset_when_paying():
    gate = AcceptanceGate(k=3, cost_ratio=1.3, window=12, min_pause=2, max_pause=8)
    assert gate.tick() and gate.active
    for _ in range(4):
        gate.record(3, 0)  # a full window accepting nothing
    assert not gate.active and gate.num_pauses == 1
    assert [gate.tick() for _ in range(3)] == [False, False, True]
    for pause in (4, 8, 8):  # doubled, then capped
        for _ in range(4):
            gate.record(3, 0)
        assert gate.paused_for == pause
        gate.paused_for = 0
    for _ in range(4):
        gate.record(3, 3)  # a window that pays
    assert gate.active and gate.pause == 2
    for _ in range(4):
        gate.record(3, 0)
    assert gate.paused_for == 2


def test_a_partial_window_does_not_judge():
    gate = AcceptanceGate(k=3, cost_ratio=1.3, window=64)
    for _ in range(20):
        gate.record(3, 0)  # 60 tokens < 64
    assert gate.active and gate.num_pauses == 0


def _decoding(request_id: str, tokens: list[int]):
    from jaxserve.request import Request

    request = Request(request_id, tokens)
    request.num_computed_tokens = len(tokens) - 1  # its last token is computed next
    return request


def test_text_that_never_repeats_pauses_lookups():
    """A request whose text has no earlier match counts as k rejected proposals for the
    gate: lookups pause, and the engine's steps may overlap again."""
    from jaxserve.config import SpeculativeConfig
    from jaxserve.spec_decode.speculator import NgramSpeculator

    spec = NgramSpeculator(SpeculativeConfig.from_dict({"method": "ngram",
                                                        "num_speculative_tokens": 4}))
    fresh = [_decoding(f"r{i}", list(range(100 * i, 100 * i + 30))) for i in range(4)]
    proposals = spec.step(fresh)  # 16 unmatched proposals: not a full window of 64 yet
    assert spec.active and proposals == {r.request_id: [] for r in fresh}
    for _ in range(3):
        spec.step(fresh)
    assert not spec.active and spec.gate.num_pauses == 1
    looping = _decoding("loop", [1, 2, 3, 4] * 8)
    assert spec.step([looping]) == {}  # paused: no lookup made
    assert spec.num_drafts == 0  # the metrics count real drafts only


def test_measured_periods_set_the_break_even():
    """Verifying steps measured at 1.9x plain ones at one batch size make the break-even
    that of 1.9; other batch sizes and idle gaps do not count."""
    gate = AcceptanceGate(k=3, cost_ratio=1.3)
    prior = gate.min_acceptance
    for _ in range(4):
        gate.step_period(False, 1, 0.010)
        gate.step_period(True, 8, 0.050)  # another bucket: no plain period there yet
        gate.step_period(False, 1, 5.0)  # an idle engine between requests: dropped
    assert gate.min_acceptance == prior and gate.periods.ratio(8) is None
    for period in (0.019, 0.018, 0.020, 0.019):
        gate.step_period(True, 1, period)
    assert gate.cost_ratio == pytest.approx(1.9)
    assert gate.min_acceptance == pytest.approx(break_even(3, 1.9))
    assert gate.min_acceptance > prior
    assert gate.periods.bucket(3) == gate.periods.bucket(4) == 4 != gate.periods.bucket(5)


def test_a_threshold_set_by_hand_is_kept_and_nothing_probes():
    gate = AcceptanceGate(k=3, cost_ratio=1.3, window=12, probe_every=1)
    gate.min_acceptance = 0.0  # verify every step (the tests' setting)
    for _ in range(8):
        gate.step_period(True, 1, 0.05)
        gate.step_period(False, 1, 0.01)
        gate.record(3, 0)
    assert gate.min_acceptance == 0.0 and gate.cost_ratio == 1.3
    assert gate.active and gate.num_probes == 0 and gate.num_pauses == 0


def test_probes_measure_plain_steps_while_proposals_pay():
    """While windows pay and no plain period is known at the batch size, the gate pauses a
    few steps now and then (a probe); once plain periods are known it stops probing."""
    gate = AcceptanceGate(k=3, cost_ratio=1.3, window=12, probe_every=2, probe_steps=3)
    gate.step_period(True, 2, 0.02)
    for _ in range(8):
        gate.record(3, 3)  # two paying windows
    assert gate.paused_for == 3 and gate.num_probes == 1 and gate.num_pauses == 0
    assert gate.pause == gate.min_pause  # a probe is not a failure
    assert [gate.tick() for _ in range(4)] == [False, False, False, True]
    for _ in range(4):
        gate.step_period(False, 2, 0.01)  # the probe's plain steps
    for _ in range(16):
        gate.record(3, 3)
    assert gate.num_probes == 1 and gate.active


def test_the_speculator_times_decode_steps(monkeypatch):
    """`Speculator.step` hands the gate each step's dispatch-to-dispatch period, with the
    number of requests decoding; a step with a request still in its prompt is not timed."""
    from jaxserve.config import SpeculativeConfig
    from jaxserve.request import Request
    from jaxserve.spec_decode import speculator as module

    clock = iter([0.0, 0.01, 0.02, 0.05, 0.06])
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    spec = module.NgramSpeculator(SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3}))
    seen = []
    monkeypatch.setattr(spec.gate, "step_period", lambda *a: seen.append(a))
    looping = []
    for i in range(2):  # past their prompts, decoding: their text repeats
        request = Request(f"r{i}", [1, 2, 3, 4] * 8)
        request.append_output_token_ids([1, 2])
        request.num_computed_tokens = request.num_tokens - 1
        looping.append(request)
    prefill = Request("p", list(range(40)))
    spec.step(looping)  # verifying (the text repeats)
    spec.step(looping)
    spec.step([*looping, prefill])  # a prompt in the step: its period is not counted
    spec.step(looping)
    assert seen == [(True, 2, 0.01), (True, 2, pytest.approx(0.01)),
                    (True, 0, pytest.approx(0.03))]
