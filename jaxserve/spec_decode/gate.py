"""Switching speculation off while it does not pay: pauses when acceptance stays too low.

A verifying step of k proposals costs `cost_ratio` plain decode steps and yields, at an
acceptance rate a, E(a) = 1 + a + a^2 + ... + a^k tokens per request. Speculation pays
while E(a) > cost_ratio; the gate finds the break-even rate once, watches the acceptance
of the last `window` proposed tokens, and below the break-even stops proposing for a
pause (8 steps, doubled at each failed try up to 256, reset by a window that pays), then
tries again. While paused the engine steps with async scheduling, as without speculation.

`cost_ratio` comes from measurements on this CPU (BENCHMARKS.md, "Speculative
decoding"): verifying 1 + k tokens per request costs ~1.3 decode steps at batch 1-4
(`VERIFY_OVERHEAD`), and a draft model adds k of its own steps, each about its size
relative to the target's.
"""

from __future__ import annotations

VERIFY_OVERHEAD = 0.3  # a verifying step's extra cost, in decode steps (measured here)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verifying request gets per step at this per-proposal acceptance rate."""
    return sum(acceptance ** i for i in range(k + 1))


def break_even(k: int, cost_ratio: float) -> float:
    """The acceptance rate at which k proposals pay for a step `cost_ratio` times as
    expensive as a plain one (1.0 when none does)."""
    if expected_tokens(1.0, k) <= cost_ratio:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < cost_ratio else (lo, mid)
    return hi


class AcceptanceGate:
    """Decides, step by step, whether proposals are made (see the module docstring).

    Args:
        k: Proposals per request per step.
        cost_ratio: Cost of a verifying step in plain decode steps.
        window: Proposed tokens per judgement.
        min_pause: First pause, in steps.
        max_pause: Longest pause.
    """

    def __init__(self, k: int, cost_ratio: float, window: int = 64, min_pause: int = 8,
                 max_pause: int = 256):
        self.min_acceptance = break_even(k, cost_ratio)
        self.window, self.min_pause, self.max_pause = window, min_pause, max_pause
        self.pause = min_pause
        self.paused_for = 0  # steps left without proposals
        self.num_pauses = 0
        self._drafted = self._accepted = 0

    @property
    def active(self) -> bool:
        """Whether proposals are being made (not paused)."""
        return self.paused_for == 0

    def tick(self) -> bool:
        """Called once per step before proposing: whether to propose this step."""
        if self.paused_for:
            self.paused_for -= 1
            return False
        return True

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """Counts one verification; judges the window once it is full."""
        self._drafted += num_drafted
        self._accepted += num_accepted
        if self._drafted < self.window:
            return
        rate = self._accepted / self._drafted
        self._drafted = self._accepted = 0
        if rate >= self.min_acceptance:
            self.pause = self.min_pause
            return
        self.paused_for = self.pause
        self.num_pauses += 1
        self.pause = min(2 * self.pause, self.max_pause)
