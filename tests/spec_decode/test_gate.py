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
