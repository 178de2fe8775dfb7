"""The engine's side of speculative decoding: propose before a step, verify after it, count.

Verification of n-gram proposals needs no probabilities. A proposal d is a one-hot draft,
for which the rejection rule (accept with min(1, p(d)/q(d)), else draw from the residual)
is the same as: draw x from the target's distribution p at that position, accept d if
x == d, else emit x (x is then distributed as p without d, renormalised: the residual).
So each verified position is one ordinary sampling row (temperature, top-k/p, penalties
and seeds as without speculation) and the step's tokens are its rows' samples up to and
including the first that differs from its proposal. A seeded row draws with the counter of
the output position it samples, so a seeded request produces the same tokens with or
without speculation; a greedy row is the argmax rule.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterable, Sequence

import numpy as np

from jaxserve.config import SpeculativeConfig
from jaxserve.request import Request
from jaxserve.spec_decode.gate import VERIFY_OVERHEAD, AcceptanceGate
from jaxserve.spec_decode.ngram import propose_ngram


def accepted_prefix(draft_ids: Sequence[int], sampled_ids: Sequence[int]) -> int:
    """How many proposals hold: the longest prefix of `draft_ids` equal to `sampled_ids`
    (the target's sample at each proposal's position)."""
    n = min(len(draft_ids), len(sampled_ids))
    differ = np.flatnonzero(np.asarray(draft_ids[:n]) != np.asarray(sampled_ids[:n]))
    return int(differ[0]) if differ.size else n


class Speculator(abc.ABC):
    """Verification and vLLM's acceptance counters, shared by the proposers.

    Args:
        config: The engine's `SpeculativeConfig`.

    Attributes:
        own_device_calls: Whether proposing runs device programs of its own, besides the
            runner's steps (a multi-host follower replays only the runner's calls).
    """

    own_device_calls = False

    def __init__(self, config: SpeculativeConfig, draft_cost: float = 0.0):
        self.config = config
        self.k = config.num_speculative_tokens
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k  # i-th proposal accepted, by position
        # NOTE: a draft step costs about `draft_cost` target steps (its relative size).
        self.gate = AcceptanceGate(self.k, 1.0 + VERIFY_OVERHEAD + self.k * draft_cost)
        self._previous: tuple[float, bool, int] | None = None  # (dispatch time, kind, batch)

    @property
    def active(self) -> bool:
        """Whether proposals are made now (the gate pauses them while they do not pay)."""
        return self.gate.active

    def step(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        """Before a step: `{request_id: proposed tokens}` for `requests` (the running ones;
        nothing while the gate pauses proposals); the engine hands them to
        `Scheduler.set_proposals`. The time since the previous call is that step's period,
        which the gate counts when every request in it was past its prompt."""
        requests = list(requests)
        now = time.perf_counter()
        if self._previous is not None:
            start, verifying, batch = self._previous
            self.gate.step_period(verifying, batch, now - start)
        proposals = self.propose(requests) if self.gate.tick() else {}
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in requests)
        self._previous = (now, any(proposals.values()), len(requests) if decoding else 0)
        return proposals

    @staticmethod
    def wants_proposals(request: Request) -> bool:
        """Whether a request decodes next step: all its tokens but the last computed and
        nothing in flight (the scheduler then takes the proposals that fit)."""
        return request.decodes_next and not request.is_finished()

    @abc.abstractmethod
    def propose(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        """`{request_id: proposed tokens}` of the requests that decode next step."""

    def warmup(self, make_dummy_sampling) -> float:
        """Compiles what proposing runs (nothing for host-side proposers); seconds."""
        return 0.0

    def attach(self, runner) -> None:
        """Sees the target's runner once it is built, before warm-up (a proposer that reads
        the target's step outputs asks for them here)."""
        return None

    def observe(self, out, requests: dict[str, Request], sampled: dict[str, list[int]],
                aux) -> None:
        """After each target step (`update_from_output` done): a proposer that drafts from
        the step's hidden states (`aux`, `StepResult.aux_hidden`) reads them here; `sampled`
        are each entry's tokens after verification."""
        return None

    @property
    def num_compilations(self) -> int:
        """Compilations of the proposer's own programs since warm-up."""
        return 0

    def verify(self, draft_ids: Sequence[int], sampled_ids: Sequence[int]) -> list[int]:
        """The tokens a verifying request produced this step, and counts them.

        Args:
            draft_ids: Its s proposals.
            sampled_ids: Its 1 + s rows' samples (the target's token after each prefix).

        Returns:
            The accepted proposals and the token after them (1 + accepted tokens).
        """
        num_accepted = accepted_prefix(draft_ids, sampled_ids)
        self.gate.record(len(draft_ids), num_accepted)
        self.num_drafts += 1
        self.num_draft_tokens += len(draft_ids)
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        return list(sampled_ids[:num_accepted + 1])

    def metrics(self) -> dict[str, float]:
        """vLLM's counters with the `jaxserve:` prefix (per-position acceptance labelled)."""
        out = {"jaxserve:spec_decode_num_drafts": self.num_drafts,
               "jaxserve:spec_decode_num_draft_tokens": self.num_draft_tokens,
               "jaxserve:spec_decode_num_accepted_tokens": self.num_accepted_tokens}
        for i, n in enumerate(self.accepted_per_pos):
            out[f"jaxserve:spec_decode_num_accepted_tokens_per_pos{{position={i}}}"] = n
        out["jaxserve:spec_decode_num_pauses"] = self.gate.num_pauses
        return out


class NgramSpeculator(Speculator):
    """Proposes what followed the latest earlier occurrence of each request's suffix."""

    def propose(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        cfg = self.config
        proposals: dict[str, list[int]] = {}
        for request in requests:
            if self.wants_proposals(request):
                proposals[request.request_id] = propose_ngram(
                    request.all_token_ids, self.k, cfg.prompt_lookup_min,
                    cfg.prompt_lookup_max).tolist()
        num_unmatched = sum(not p for p in proposals.values())
        # NOTE: for the gate, a request whose text has no match is k proposals that did
        # not pay: text that never repeats pauses lookups, and steps overlap again.
        if num_unmatched:
            self.gate.record(self.k * num_unmatched, 0)
        return proposals
