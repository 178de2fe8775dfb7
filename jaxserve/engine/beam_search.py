"""Beam search on the engine's public API: beams share pages and copy on write as they diverge.

Each beam is a greedy engine request that returns its top 2W next tokens (`logprobs=2W`).
The engine steps one at a time (no overlap) and every beam of a prompt samples in the same
step; once they all have, the best W continuations are chosen (`select_beams`): a beam
whose request sampled the chosen token goes on in it, and every other continuation is a
new request started from its beam's KV with `LLMEngine.fork_request` (it shares the pages
and computes only the chosen token); requests no continuation goes on in are aborted.
Candidates ending in EOS become finished hypotheses. A beam whose group is not ready (a
sibling was preempted) is aborted and later continued as a request of its own.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from jaxserve.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search settings (vLLM's names).

    Attributes:
        beam_width: Beams kept per prompt (1..10: 2W candidates must fit 20 logprobs).
        max_tokens: Longest continuation.
        ignore_eos: Keep extending past EOS.
        length_penalty: Score = cumulative logprob / (sequence length ** length_penalty).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self):
        if not 1 <= self.beam_width <= SamplingParams.MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be in [1, {SamplingParams.MAX_LOGPROBS // 2}], "
                             f"got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")


@dataclass
class BeamSearchSequence:
    """One hypothesis: all its tokens (prompt included), score inputs and text."""

    tokens: list[int]
    cum_logprob: float
    num_prompt_tokens: int
    text: str = ""
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def beam_score(num_tokens: int, cum_logprob: float, length_penalty: float) -> float:
    """Length-normalised score of a hypothesis of `num_tokens` tokens (vLLM's formula)."""
    return cum_logprob / (num_tokens ** length_penalty)


def select_beams(scored: list[tuple], width: int, eos: set[int], ignore_eos: bool
                 ) -> tuple[list[tuple], list[tuple]]:
    """Top-W selection, shared by the engine's beam search and the server's.

    Args:
        scored: `(cumulative logprob, beam key, token)` candidates (the key breaks ties).
        width: Beams to keep.
        eos: Tokens that end a hypothesis (unless `ignore_eos`).

    Returns:
        (the best `width` continuations that do not end, best first; the EOS candidates
        ranked above the last one kept, which become finished hypotheses).
    """
    keep, ended = [], []
    for cand in heapq.nlargest(len(scored), scored):
        if cand[2] in eos and not ignore_eos:
            ended.append(cand)
            continue
        keep.append(cand)
        if len(keep) == width:
            break
    return keep, ended


def best_hypotheses(done: list[BeamSearchSequence], params: BeamSearchParams
                    ) -> list[BeamSearchSequence]:
    """The `beam_width` best finished hypotheses by `beam_score`, best first."""
    return sorted(done, key=lambda s: -beam_score(len(s.tokens), s.cum_logprob,
                                                   params.length_penalty))[:params.beam_width]


@dataclass
class _Beam:
    """A live hypothesis: its tokens (prompt included), score, and the engine request that
    computes its next token (None once parked: aborted while its group waited)."""

    tokens: list[int]
    cum_logprob: float
    request_id: str | None
    sampled: int | None = None  # what its request sampled last (not computed yet)
    candidates: list[tuple[int, float]] | None = None  # its top 2W (token, logprob)


@dataclass
class _Group:
    """The beams of one prompt."""

    num_prompt_tokens: int
    lora_request: object
    beams: list[_Beam]
    done: list[BeamSearchSequence] = field(default_factory=list)
    num_requests: int = 1  # engine requests made for it (their ids' suffixes)


def beam_search(engine, prompts: list, params: BeamSearchParams,
                loras: list | None = None) -> list[BeamSearchOutput]:
    """Runs beam search for each prompt on `engine` (which must have no other requests),
    prompt i with adapter `loras[i]` (a `LoRARequest`, or None: the base model).

    Raises:
        ValueError: The engine is busy or speculates (`speculative_config`), a prompt is
            invalid or too long, an adapter does not load, or a beam's request failed.
    """
    if engine.speculator is not None:
        raise ValueError("speculative_config: beam search does not combine with speculative "
                         "decoding; use an engine without speculative_config")
    if engine.has_unfinished_requests():
        raise ValueError("beam_search needs an idle engine; finish or abort other requests")
    all_ids = [engine.inputs.tokenize(prompt)[1] for prompt in prompts]
    for i, ids in enumerate(all_ids):  # validate every prompt before queuing any
        if len(ids) + params.max_tokens >= engine.max_model_len:
            raise ValueError(f"prompt {i} ({len(ids)} tokens) + max_tokens "
                             f"{params.max_tokens} exceeds max_model_len "
                             f"{engine.max_model_len}")
    loras = loras or [None] * len(prompts)
    for lora in loras:
        if lora is not None:
            engine.add_lora(lora)
    # Each beam request computes its newest token and returns the top 2W next ones; it
    # then waits (steps one at a time, not overlapped) until its group has chosen.
    step_params = SamplingParams(temperature=0.0, max_tokens=None, logprobs=2 * params.beam_width,
                                 ignore_eos=True, detokenize=False,
                                 output_kind=RequestOutputKind.DELTA)
    groups: list[_Group] = []
    live: dict[str, tuple[_Group, _Beam]] = {}  # beam request id -> its group and beam
    overlap, engine.async_scheduling = engine.async_scheduling, False
    try:
        for i, ids in enumerate(all_ids):
            group = _Group(len(ids), loras[i], [_Beam(list(ids), 0.0, f"beam-{i}")])
            engine.add_request(f"beam-{i}", {"prompt_token_ids": ids}, step_params,
                               lora_request=loras[i])
            groups.append(group)
            live[f"beam-{i}"] = (group, group.beams[0])
        while live:
            for out in engine.step():
                if out.request_id in live:
                    _take_candidates(live, out, 2 * params.beam_width)
            for g, group in enumerate(groups):
                if not group.beams:
                    continue
                if all(beam.candidates is not None for beam in group.beams):
                    _select(engine, f"beam-{g}", group, live, step_params, params)
                else:  # NOTE: a beam that has its candidates must not compute on
                    _park([b for b in group.beams if b.candidates is not None], engine, live)
    finally:
        engine.async_scheduling = overlap
        if live:
            engine.abort_request(list(live))
    outputs = []
    for group in groups:
        best = best_hypotheses(group.done, params)
        for seq in best:
            seq.text = engine.tokenizer.decode(seq.tokens[seq.num_prompt_tokens:],
                                               skip_special_tokens=True)
        outputs.append(BeamSearchOutput(best))
    return outputs


def ranked_candidates(entry: dict, k: int | None = None) -> list[tuple[int, float]]:
    """(token id, logprob) of a step's logprobs entry ({token id: `Logprob`}), most likely
    first (ties in the entry's order); the top `k` of them when given."""
    ranked = sorted(((int(t), float(lp.logprob)) for t, lp in entry.items()),
                    key=lambda c: -c[1])
    return ranked if k is None else ranked[:k]


def _take_candidates(live: dict, out, k: int) -> None:
    """Records a beam request's step: its sampled token and top `k` candidates; a request
    the engine ended (its length cap) becomes a finished hypothesis."""
    group, beam = live[out.request_id]
    completion = out.outputs[0]
    if completion.finish_reason == "error":
        raise ValueError(f"beam search: request {out.request_id} failed: {out.error}")
    token, entry = completion.token_ids[-1], completion.logprobs[-1]
    ranked = ranked_candidates(entry)
    if completion.finish_reason is not None:  # capped by the pool's size: a hypothesis
        group.beams.remove(beam)
        del live[out.request_id]
        _finish(group, beam.tokens + [token], beam.cum_logprob + ranked[0][1], "length")
        return
    beam.sampled, beam.candidates = token, ranked[:k]


def _park(beams: list[_Beam], engine, live: dict) -> None:
    """Aborts the requests of beams that have their candidates while others of their group
    do not yet (preempted, or computing a longer prompt): they would compute on."""
    ids = [beam.request_id for beam in beams if beam.request_id is not None]
    for beam in beams:
        beam.request_id = None
    for request_id in ids:
        del live[request_id]
    if ids:
        engine.abort_request(ids)


def _select(engine, gid: str, group: _Group, live: dict, step_params: SamplingParams,
            params: BeamSearchParams) -> None:
    """Chooses the group's next beams from its beams' candidates: a beam whose request
    sampled the chosen token goes on in that request; every other choice is a new request
    forked from its beam's (sharing its pages) or, for a parked beam, a new one."""
    eos = set(engine.eos_token_ids)
    scored = [(beam.cum_logprob + lp, -i, token) for i, beam in enumerate(group.beams)
              for token, lp in beam.candidates]
    keep, ended = select_beams(scored, params.beam_width, eos, params.ignore_eos)
    for cum, neg_i, token in ended:
        _finish(group, group.beams[-neg_i].tokens + [token], cum, "stop")
    going_on: set[str] = set()  # requests that carry a beam on
    beams: list[_Beam] = []
    for cum, neg_i, token in keep:
        parent = group.beams[-neg_i]
        tokens = parent.tokens + [token]
        if len(tokens) - group.num_prompt_tokens >= params.max_tokens:
            _finish(group, tokens, cum, "length")
            continue
        request_id = parent.request_id
        if request_id is None or token != parent.sampled or request_id in going_on:
            request_id = f"{gid}.{group.num_requests}"
            group.num_requests += 1
            prompt = {"prompt_token_ids": tokens}
            if parent.request_id is not None:
                engine.fork_request(parent.request_id, request_id, prompt, step_params)
            else:
                engine.add_request(request_id, prompt, step_params,
                                   lora_request=group.lora_request)
        going_on.add(request_id)
        beams.append(_Beam(tokens, cum, request_id))
        live[request_id] = (group, beams[-1])
    done = [b.request_id for b in group.beams
            if b.request_id is not None and b.request_id not in going_on]
    for request_id in done:
        del live[request_id]
    if done:
        engine.abort_request(done)
    group.beams = beams


def _finish(group: _Group, tokens: list[int], cum: float, reason: str) -> None:
    group.done.append(BeamSearchSequence(tokens, cum, group.num_prompt_tokens,
                                         finish_reason=reason))
