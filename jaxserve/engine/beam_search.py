"""Beam search on the engine's forking: beams share pages and copy on write as they diverge.

Each beam is a greedy request that returns its top 2W next tokens. After a step, every beam
that sampled gives back its token (not yet computed) and waits; once all live beams of a
prompt have their candidates, the best W continuations are chosen: a beam picked once
takes its token, a beam picked k times forks k - 1 children (sharing its pages), and a
beam not picked is freed. Candidates ending in EOS become finished hypotheses.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from jaxserve.request import Request, RequestStatus
from jaxserve.sampling_params import SamplingParams


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


class _Group:
    """The beams of one prompt."""

    def __init__(self, root: Request):
        self.beams: dict[str, float] = {root.request_id: 0.0}  # request id -> cum logprob
        self.pending: dict[str, list[tuple[int, float]]] = {}  # candidates per waiting beam
        self.done: list[BeamSearchSequence] = []
        self.num_children = 0


def beam_search(engine, prompts: list, params: BeamSearchParams,
                loras: list | None = None) -> list[BeamSearchOutput]:
    """Runs beam search for each prompt on `engine` (which must have no other requests),
    prompt i with adapter `loras[i]` (a `LoRARequest`, or None: the base model).

    Raises:
        ValueError: The engine is busy or speculates (`speculative_config`), a prompt is
            invalid or too long, or an adapter does not load.
    """
    if engine.speculator is not None:
        raise ValueError("speculative_config: beam search does not combine with speculative "
                         "decoding; use an engine without speculative_config")
    if engine.has_unfinished_requests() or engine.scheduler.has_unfinished_requests():
        raise ValueError("beam_search needs an idle engine; finish or abort other requests")
    width = params.beam_width
    sp = SamplingParams(temperature=0.0, max_tokens=None, logprobs=2 * width, ignore_eos=True,
                        detokenize=False)
    all_ids = [engine.inputs.tokenize(prompt)[1] for prompt in prompts]
    for i, ids in enumerate(all_ids):  # validate every prompt before queuing any
        if len(ids) + params.max_tokens >= engine.limits.max_model_len:
            raise ValueError(f"prompt {i} ({len(ids)} tokens) + max_tokens "
                             f"{params.max_tokens} exceeds max_model_len "
                             f"{engine.limits.max_model_len}")
    loras = loras or [None] * len(prompts)
    for lora in loras:
        if lora is not None:
            engine.add_lora(lora)
    groups: dict[str, _Group] = {}
    for i, ids in enumerate(all_ids):
        root = Request(f"beam-{i}", ids, sampling_params=sp.clone(
            max_tokens=engine.limits.max_model_len - len(ids)),
            eos_token_ids=engine.eos_token_ids, user_request_id=f"beam-{i}",
            lora_request=loras[i])
        engine.scheduler.add_request(root)
        groups[root.request_id] = _Group(root)
    owner = {g: g for g in groups}  # beam request id -> group id

    while any(g.beams for g in groups.values()):
        step = _execute_step(engine)
        if step is None:
            break
        result, requests = step
        for row, req_id in enumerate(result.row_request_ids):
            req, group = requests[req_id], groups[owner[req_id]]
            k = 2 * width
            cands = [(int(t), float(lp)) for t, lp in zip(result.topk_token_ids[row][:k],
                                                         result.topk_logprobs[row][:k],
                                                         strict=True)]
            if req.is_finished():  # capped by the pool's size: keep it as a hypothesis
                _finish(group, req, list(req.all_token_ids),
                        group.beams.pop(req_id) + cands[0][1], "length")
                continue
            engine.scheduler.pop_output_token(req)  # the beam waits for the group's choice
            group.pending[req_id] = cands
        for gid, group in groups.items():
            if group.beams and set(group.pending) >= set(group.beams):
                _select(engine, gid, group, owner, params)

    outputs = []
    for group in groups.values():
        best = best_hypotheses(group.done, params)
        for seq in best:
            seq.text = engine.tokenizer.decode(seq.tokens[seq.num_prompt_tokens:],
                                               skip_special_tokens=True)
        outputs.append(BeamSearchOutput(best))
    return outputs


def _select(engine, gid: str, group: _Group, owner: dict, params: BeamSearchParams) -> None:
    """Chooses the group's next beams from its pending candidates."""
    width, sched = params.beam_width, engine.scheduler
    eos = set(engine.eos_token_ids)
    scored = []
    for req_id, cands in group.pending.items():
        for token, lp in cands:
            scored.append((group.beams[req_id] + lp, req_id, token))
    group.pending.clear()
    keep, ended = select_beams(scored, width, eos, params.ignore_eos)
    for cum, req_id, token in ended:
        req = sched.requests[req_id]
        _finish(group, req, req.all_token_ids + [token], cum, "stop")
    # Forks first, from the beams' current (waiting) state; then every beam takes its token.
    used: set[str] = set()
    assigned: list[tuple[Request, int, float]] = []
    for cum, req_id, token in keep:
        parent = sched.requests[req_id]
        if req_id not in used:
            used.add(req_id)
            assigned.append((parent, token, cum))
            continue
        group.num_children += 1
        beam = sched.fork(parent, f"{gid}.{group.num_children}")  # shares pages (CoW)
        owner[beam.request_id] = gid
        assigned.append((beam, token, cum))
    new_beams: dict[str, float] = {}
    for beam, token, cum in assigned:
        sched.append_output_token(beam, token)
        new_beams[beam.request_id] = cum
    for req_id in group.beams:
        if req_id not in used:
            sched.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
    group.beams = new_beams
    for req_id, cum in list(group.beams.items()):
        req = sched.requests[req_id]
        if req.num_output_tokens >= params.max_tokens:
            _finish(group, req, list(req.all_token_ids), cum, "length")
            sched.finish_request(req_id, RequestStatus.FINISHED_LENGTH_CAPPED)
            del group.beams[req_id]


def _finish(group: _Group, req: Request, tokens: list[int], cum: float, reason: str) -> None:
    group.done.append(BeamSearchSequence(tokens, cum, req.num_prompt_tokens,
                                         finish_reason=reason))


def _execute_step(engine):
    """Runs one core step of the engine's (beam) requests; None when nothing ran."""
    from jaxserve.sample.metadata import RowSpec

    core = engine.run_core_step(lambda req, s, k: RowSpec(
        req.sampling_params, req.prompt_token_ids, req.output_token_ids, 0, s.sampling_counter))
    return None if core is None else (core.result, core.requests)
