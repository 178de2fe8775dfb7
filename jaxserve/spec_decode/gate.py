"""Switching speculation off while it does not pay: pauses when acceptance stays too low.

A verifying step of k proposals costs `cost_ratio` plain decode steps and yields, at an
acceptance rate a, E(a) = 1 + a + a^2 + ... + a^k tokens per request. Speculation pays
while E(a) > cost_ratio; the gate watches the acceptance of the last `window` proposed
tokens, and below the break-even stops proposing for a pause (8 steps, doubled at each
failed try up to 256, reset by a window that pays), then tries again. While paused the
engine steps with async scheduling, as without speculation.

`cost_ratio` starts from a prior (`VERIFY_OVERHEAD`: verifying 1 + k tokens per request
cost ~1.3 decode steps at batch 1-4 on float32 weights here, BENCHMARKS.md; a draft model
adds k of its own steps, each about its size relative to the target's) and is then measured
(`StepPeriods`): the time from one step's dispatch to the next, for decode-only steps, by
batch size, verifying against plain (on the CPU's 8-bit kernels a 4-token step costs ~1.9
plain ones, docs/benchmarks/speculation.md). Plain steps happen during pauses; while
proposals keep paying and no plain period is known for the batch size, the gate pauses a few
steps now and then to measure one (a probe). A `min_acceptance` set by hand (tests set 0.0:
verify every step) fixes the threshold: nothing is measured or probed then.
"""

from __future__ import annotations

import statistics
from collections import deque

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


class StepPeriods:
    """Measured dispatch-to-dispatch periods of decode-only steps, by kind (verifying or
    plain) and batch bucket (the next power of two of the requests decoding).

    Args:
        keep: Periods kept per kind and bucket (the median of those is used).
        min_samples: Periods of each kind a bucket needs before its ratio counts.
        max_period: Longer periods are dropped (an idle engine between requests).
    """

    def __init__(self, keep: int = 16, min_samples: int = 4, max_period: float = 1.0):
        self.keep, self.min_samples, self.max_period = keep, min_samples, max_period
        self.samples: dict[tuple[bool, int], deque] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        """The batch size's bucket: the next power of two."""
        return 1 << max(0, batch - 1).bit_length()

    def add(self, verifying: bool, batch: int, seconds: float) -> None:
        """Counts one step's period (batch: its decoding requests, > 0)."""
        if seconds <= self.max_period:
            key = (verifying, self.bucket(batch))
            self.samples.setdefault(key, deque(maxlen=self.keep)).append(seconds)

    def count(self, verifying: bool, batch: int) -> int:
        """Periods known of that kind at that batch size's bucket."""
        return len(self.samples.get((verifying, self.bucket(batch)), ()))

    def ratio(self, batch: int) -> float | None:
        """Median verifying period over median plain period at the batch size's bucket; None
        until both have `min_samples`."""
        if min(self.count(True, batch), self.count(False, batch)) < self.min_samples:
            return None
        b = self.bucket(batch)
        return statistics.median(self.samples[(True, b)]) / statistics.median(
            self.samples[(False, b)])


class AcceptanceGate:
    """Decides, step by step, whether proposals are made (see the module docstring).

    Args:
        k: Proposals per request per step.
        cost_ratio: Cost of a verifying step in plain decode steps.
        window: Proposed tokens per judgement.
        min_pause: First pause, in steps.
        max_pause: Longest pause.
        probe_every: Paying windows in a row after which, with no plain period known for
            the batch size, the gate pauses `probe_steps` steps to measure some.
        probe_steps: Steps of such a probe.

    Attributes:
        cost_ratio: A verifying step's cost in plain steps: the prior, then measured.
    """

    def __init__(self, k: int, cost_ratio: float, window: int = 64, min_pause: int = 8,
                 max_pause: int = 256, probe_every: int = 8, probe_steps: int = 6):
        self.k, self.cost_ratio = k, cost_ratio
        self._threshold = break_even(k, cost_ratio)
        self._fixed: float | None = None
        self.periods = StepPeriods()
        self.probe_every, self.probe_steps = probe_every, probe_steps
        self.num_probes = 0
        self._paying = 0  # paying windows in a row
        self._batch = 0  # decoding requests of the latest measured step
        self.window, self.min_pause, self.max_pause = window, min_pause, max_pause
        self.pause = min_pause
        self.paused_for = 0  # steps left without proposals
        self.num_pauses = 0
        self._drafted = self._accepted = 0

    @property
    def min_acceptance(self) -> float:
        """The acceptance rate below which proposals pause: the break-even of `cost_ratio`,
        or the value set by hand (which also stops measuring and probing)."""
        return self._threshold if self._fixed is None else self._fixed

    @min_acceptance.setter
    def min_acceptance(self, value: float) -> None:
        self._fixed = value

    def step_period(self, verifying: bool, batch: int, seconds: float) -> None:
        """Counts a decode-only step's dispatch-to-dispatch period (`batch` requests
        decoding); the cost ratio follows the measurements at that batch size."""
        if self._fixed is not None or batch <= 0:
            return
        self._batch = batch
        self.periods.add(verifying, batch, seconds)
        ratio = self.periods.ratio(batch)
        if ratio is not None:
            self.cost_ratio = ratio
            self._threshold = break_even(self.k, ratio)

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
            self._paying += 1
            if (self._fixed is None and self._batch and self._paying >= self.probe_every
                    and self.periods.count(False, self._batch) < self.periods.min_samples):
                self.paused_for, self._paying = self.probe_steps, 0  # measure plain steps
                self.num_probes += 1
            return
        self._paying = 0
        self.paused_for = self.pause
        self.num_pauses += 1
        self.pause = min(2 * self.pause, self.max_pause)
