"""Per user request state in the engine: prompt, completions, detokenizers, logprobs, metrics."""

from __future__ import annotations

import dataclasses
import math
import operator

import numpy as np

from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.sample.metadata import MAX_BANNED_TOKEN_IDS, RowSpec, build_sampling_metadata
from jaxserve.sampling_params import SamplingParams

_FINISH = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
           RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_IGNORED: "length",
           RequestStatus.FINISHED_ERROR: "error"}


def tokenize_prompt(engine, prompt) -> tuple[str | None, list[int]]:
    """(text, ids) of a prompt given as text, a list of ids or {"prompt_token_ids": [...]}.

    Raises:
        ValueError: Empty prompt, ids outside the vocabulary, or an unsupported type.
    """
    vocab = engine.model.cfg.vocab_size
    text = None
    if isinstance(prompt, str):
        text, ids = prompt, engine.tokenizer(prompt).input_ids
    elif isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
        elif "prompt" in prompt:
            return tokenize_prompt(engine, prompt["prompt"])
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids', got keys "
                             f"{sorted(prompt)}")
    elif isinstance(prompt, (list, tuple, np.ndarray)):
        ids = prompt
    else:
        raise ValueError(f"prompt must be a string, token ids or a dict, got "
                         f"{type(prompt).__name__}")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"prompt must be a string, got {type(text).__name__}")
    try:
        ids = [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("prompt: prompt_token_ids must be a list of integers") from None
    if not ids:
        raise ValueError("prompt is empty: it must hold at least one token")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt: prompt_token_ids hold ids outside [0, {vocab}): {bad[:5]}")
    return text, ids


def make_request(engine, request_id: str, prompt, params: SamplingParams, *, priority: int,
                 cache_salt: str | None, arrival_time: float | None) -> RequestState:
    """Validates and tokenizes a new request; returns its state (root request inside)."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got "
                         f"{type(params).__name__}")
    # NOTE: a validated copy: fields set after construction are checked again here, at
    # add time, so nothing invalid reaches a step that other requests share.
    params = params.clone()
    if isinstance(priority, bool) or not isinstance(priority, int) \
            or not -2**63 <= priority < 2**63:
        raise ValueError(f"priority must be a 64-bit integer, got {priority!r}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
    vocab = engine.model.cfg.vocab_size
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(f"stop_token_ids hold ids outside [0, {vocab}): {bad[:5]}")
    text, ids = tokenize_prompt(engine, prompt)
    max_len = engine.limits.max_model_len
    if len(ids) >= max_len:
        raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {max_len}, which "
                         "leaves no room to generate")
    if params.n > engine.scheduler.max_num_seqs:
        raise ValueError(f"n={params.n} exceeds max_num_seqs={engine.scheduler.max_num_seqs}")
    if params.max_tokens is None:
        params = dataclasses.replace(params, max_tokens=max_len - len(ids))
    base = int(params.seed) if params.seed is not None else int(engine.rng.integers(2**31))
    # NOTE: completion i of a seeded request gets its own stream, derived from the seed.
    seeds = [base] + [int(x) for x in np.random.SeedSequence([base, params.n]).generate_state(
        params.n - 1)]
    root = Request(request_id, ids, cache_salt=cache_salt, arrival_time=arrival_time,
                   sampling_params=params, priority=priority, eos_token_ids=engine.eos_token_ids,
                   seeds=tuple(seeds))
    state = RequestState(engine.tokenizer, root, text, params)
    extra_eos = [e for e in engine.eos_token_ids[1:] if e not in (params.stop_token_ids or [])]
    if params.min_tokens and not params.ignore_eos and extra_eos:
        # NOTE: the sampler bans `stop_token_ids` and one EOS id below min_tokens; a model
        # with several EOS ids needs the others banned too.
        state.row_params = params.clone(
            stop_token_ids=[*(params.stop_token_ids or []), *extra_eos])
    check_sampling_row(state.row_params, ids, seeds[0], vocab, engine.eos_token_ids)
    return state


def check_sampling_row(params: SamplingParams, prompt_ids: list[int], seed: int, vocab: int,
                       eos_token_ids: tuple[int, ...]) -> None:
    """Builds this request's sampling row alone, as a step would, so that whatever cannot
    go into a step's arrays is refused now (ValueError) instead of failing the step.

    Raises:
        ValueError: The row cannot be built, or it bans more tokens below `min_tokens`
            than the width the sampler was compiled for.
    """
    if params.min_tokens:
        banned = params.all_stop_token_ids(eos_token_ids[0] if eos_token_ids else None)
        if len(banned) > MAX_BANNED_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids may hold at most {MAX_BANNED_TOKEN_IDS - len(eos_token_ids)} "
                f"ids when min_tokens > 0 (they are banned on the device until min_tokens), "
                f"got {len(params.stop_token_ids)}")
    try:
        build_sampling_metadata([RowSpec(params, prompt_ids, (), seed, 0)], 1, vocab,
                                eos_token_id=eos_token_ids[0] if eos_token_ids else None)
    except (ValueError, TypeError, OverflowError) as e:
        raise ValueError(f"sampling parameters cannot be used: {e}") from None


class RequestState:
    """Everything the engine tracks for one user request across its `n` completions."""

    def __init__(self, tokenizer, root: Request, prompt: str | None, params: SamplingParams):
        self.tokenizer = tokenizer
        self.root = root
        self.request_id = root.request_id
        self.prompt = prompt
        self.prompt_token_ids = root.prompt_token_ids
        self.params = params
        self.row_params = params  # what the sampler sees (see make_request)
        self.metrics = RequestMetrics(arrival_time=root.arrival_time)
        self.outputs = [CompletionOutput(index=i) for i in range(params.n)]
        self.requests: dict[int, Request] = {0: root}
        self.prompt_logprobs: list | None = None  # per prompt position, when asked for
        self.error: str | None = None  # why it failed (finish_reason "error")
        self._detok: dict[int, IncrementalDetokenizer] = {}

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    def live_request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests.values() if not r.is_finished()]

    def finish_reasons(self) -> list[str]:
        return [o.finish_reason for o in self.outputs]

    def on_scheduled(self, now: float) -> None:
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now

    def abort(self) -> None:
        for out in self.outputs:
            if out.finish_reason is None:
                out.finish_reason = "abort"

    def fail(self, message: str) -> None:
        """Ends every unfinished completion with finish_reason "error"."""
        self.error = message
        for out in self.outputs:
            if out.finish_reason is None:
                out.finish_reason = "error"

    def _detokenizer(self, index: int) -> IncrementalDetokenizer | None:
        p = self.params
        if not p.detokenize:
            return None
        if index not in self._detok:
            self._detok[index] = IncrementalDetokenizer(
                self.tokenizer, self.prompt_token_ids, skip_special_tokens=p.skip_special_tokens,
                spaces_between_special_tokens=p.spaces_between_special_tokens, stop=p.stop,
                include_stop_str_in_output=p.include_stop_str_in_output,
                min_tokens=p.min_tokens)
        return self._detok[index]

    def on_tokens(self, req: Request, tokens: list[int], result, row: int,
                  now: float) -> str | None:
        """Records a completion's new token(s); returns a stop string if one matched."""
        index = req.sample_index
        self.requests[index] = req
        out = self.outputs[index]
        out.token_ids.extend(tokens)
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self.metrics.num_cached_tokens = self.root.num_cached_tokens
        self.metrics.num_preemptions = max(r.num_preemptions for r in self.requests.values())
        if self.params.logprobs is not None:
            self._add_logprobs(out, tokens[-1], result, row)
        stop_str = None
        detok = self._detokenizer(index)
        if detok is not None:
            stopped_by_token = req.status == RequestStatus.FINISHED_STOPPED
            stop_str = detok.update(tokens, stop_terminated=stopped_by_token)
            out.text = detok.output_text
        if stop_str is not None:
            out.finish_reason, out.stop_reason = "stop", stop_str
        elif req.is_finished():
            out.finish_reason, out.stop_reason = _FINISH[req.status], req.stop_reason
        if out.finish_reason is not None:
            if detok is not None:
                detok.finish()
                out.text = detok.output_text
            if self.finished:
                self.metrics.finished_time = now
        return stop_str

    def _add_logprobs(self, out: CompletionOutput, token: int, result, row: int) -> None:
        lp = float(result.logprobs[row])
        entry = {token: Logprob(lp, rank=int(result.token_ranks[row])
                                if result.token_ranks is not None else None)}
        k = self.params.logprobs
        if k and result.topk_token_ids is not None:
            for rank, (tid, tlp) in enumerate(zip(result.topk_token_ids[row][:k],
                                                  result.topk_logprobs[row][:k],
                                                  strict=True), start=1):
                entry.setdefault(int(tid), Logprob(float(tlp), rank=rank))
        if self.params.detokenize:
            for tid, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([tid])
        out.logprobs = (out.logprobs or []) + [entry]
        out.cumulative_logprob = (out.cumulative_logprob or 0.0) + (lp if math.isfinite(lp)
                                                                    else 0.0)

    def set_prompt_logprob(self, position: int, token: int, lp, row: int, k: int) -> None:
        """Records prompt position `position` (its token `token`) from row `row` of a
        `PromptLogprobs` of host arrays, with the top `k` alternatives."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        entry = {token: Logprob(float(lp.token_logprobs[row]), rank=int(lp.token_ranks[row]))}
        if k and lp.topk_token_ids is not None:
            for rank, (tid, tlp) in enumerate(zip(lp.topk_token_ids[row][:k],
                                                  lp.topk_logprobs[row][:k], strict=True),
                                              start=1):
                entry.setdefault(int(tid), Logprob(float(tlp), rank=rank))
        if self.params.detokenize:
            for tid, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([tid])
        self.prompt_logprobs[position] = entry

    def make_output(self) -> RequestOutput:
        """A snapshot `RequestOutput` (lists copied so later steps do not mutate it)."""
        outputs = [CompletionOutput(o.index, o.text, list(o.token_ids), o.cumulative_logprob,
                                    list(o.logprobs) if o.logprobs is not None else None,
                                    o.finish_reason, o.stop_reason) for o in self.outputs]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), outputs,
                             self.finished, dataclasses.replace(self.metrics),
                             self.root.num_cached_tokens,
                             None if self.prompt_logprobs is None
                             else list(self.prompt_logprobs), self.error)
