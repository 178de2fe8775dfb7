"""Output processing: per user request state (completions, detokenizers, logprobs, metrics) and
the turning of each step's sampled tokens into `RequestOutput`s."""

from __future__ import annotations

import dataclasses
import logging
import math
import time

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.engine.detokenizer import IncrementalDetokenizer
from jaxserve.engine.routed_experts import RoutedExperts
from jaxserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxserve.request import Request, RequestStatus
from jaxserve.runner.step_io import StepResult
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

_FINISH = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
           RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_IGNORED: "length",
           RequestStatus.FINISHED_ERROR: "error"}
logger = logging.getLogger("jaxserve")


@dataclasses.dataclass
class CoreStep:
    """What one step did on the device and in the scheduler (`LLMEngine.step`).

    Attributes:
        out: The scheduler's step (decode rows first).
        requests: The scheduled requests by id, as they were before the update.
        result: The runner's `StepResult` (sampled ids, logprobs, ...).
        updates: `(request, new token ids)` from `Scheduler.update_from_output`.
        row_of: Sampling rows of each request id.
        failed: `{request_id: error}` of requests whose sampling rows could not be built;
            they are finished (FINISHED_ERROR) and got no token.
    """

    out: SchedulerOutput
    requests: dict[str, Request]
    result: StepResult
    updates: list[tuple[Request, list[int]]]
    row_of: dict[str, list[int]]
    failed: dict[str, BaseException]



class RequestState:
    """Everything the engine tracks for one user request across its `n` completions."""

    def __init__(self, tokenizer, root: Request, prompt: str | None, params: SamplingParams):
        self.tokenizer = tokenizer
        self.root = root
        self.request_id = root.request_id
        self.prompt = prompt
        self.prompt_token_ids = root.prompt_token_ids
        # NOTE: one copy, shared by this request's outputs (copying it for every output
        # cost a prompt's length per request per step).
        self._output_prompt_ids = list(root.prompt_token_ids)
        self.params = params
        self.row_params = params  # what the sampler sees (see make_request)
        self.metrics = RequestMetrics(arrival_time=root.arrival_time)
        self.outputs = [CompletionOutput(index=i) for i in range(params.n)]
        self.requests: dict[int, Request] = {0: root}
        self.prompt_logprobs: list | None = None  # per prompt position, when asked for
        self.error: str | None = None  # why it failed (finish_reason "error")
        self._detok: dict[int, IncrementalDetokenizer] = {}
        # NOTE: a request read only when it finishes and with no stop string to watch for
        # is detokenized once, at its end: the same text, without per-step host work.
        self._text_at_end = (params.output_kind == RequestOutputKind.FINAL_ONLY
                             and not params.stop)
        # DELTA: per completion, the tokens, characters and logprobs already sent, and
        # whether its end was.
        self._sent: dict[int, tuple[int, int, int, bool]] = {}
        self._prompt_logprobs_sent = False

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
                self._end_text(out, stop_terminated=False, strict=False)

    def fail(self, message: str) -> None:
        """Ends every unfinished completion with finish_reason "error"."""
        self.error = message
        for out in self.outputs:
            if out.finish_reason is None:
                out.finish_reason = "error"
                self._end_text(out, stop_terminated=False, strict=False)

    def _end_text(self, out: CompletionOutput, stop_terminated: bool, strict: bool) -> None:
        """Detokenizes the tokens a text-at-end completion holds (see `__init__`).

        Args:
            strict: Raise a detokenization failure (False: keep the text as it is).
        """
        detok = self._detokenizer(out.index)
        if detok is None or detok.finished:
            return
        try:
            detok.update(out.token_ids[len(detok.output_token_ids):],
                         stop_terminated=stop_terminated)
            detok.finish()
        except Exception:
            if strict:
                raise
        out.text = detok.output_text

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

    def on_tokens(self, req: Request, tokens: list[int], result, rows: list[int],
                  now: float) -> str | None:
        """Records a completion's new token(s); returns a stop string if one matched.

        Args:
            rows: The sampling row of each token (several when proposals were accepted).
        """
        index = req.sample_index
        self.requests[index] = req
        out = self.outputs[index]
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        self.metrics.num_cached_tokens = self.root.num_cached_tokens
        self.metrics.num_preemptions = (req.num_preemptions if len(self.requests) == 1 else
                                        max(r.num_preemptions for r in self.requests.values()))
        stop_str = None
        stopped_by_token = req.status == RequestStatus.FINISHED_STOPPED
        detok = None if self._text_at_end else self._detokenizer(index)
        if detok is not None and len(tokens) > 1 and self.params.stop:
            # NOTE: a stop string ends the output at the token that completed it, as if
            # the tokens had come one step at a time (verified proposals come together).
            for i in range(len(tokens)):
                last = i == len(tokens) - 1
                stop_str = detok.update(tokens[i:i + 1],
                                        stop_terminated=stopped_by_token and last)
                if stop_str is not None:
                    tokens = tokens[:i + 1]
                    break
            out.text = detok.output_text
        elif detok is not None:
            stop_str = detok.update(tokens, stop_terminated=stopped_by_token)
            out.text = detok.output_text
        out.token_ids.extend(tokens)
        if self.params.logprobs is not None:
            for token, row in zip(tokens, rows, strict=False):
                self._add_logprobs(out, token, result, row)
        if stop_str is not None:
            out.finish_reason, out.stop_reason = "stop", stop_str
        elif req.is_finished():
            out.finish_reason, out.stop_reason = _FINISH[req.status], req.stop_reason
        if out.finish_reason is not None:
            if detok is not None:
                detok.finish()
                out.text = detok.output_text
            elif self._text_at_end:
                self._end_text(out, stopped_by_token, strict=True)
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

    @property
    def wants_output(self) -> bool:
        """Whether this step's `RequestOutput` is emitted (FINAL_ONLY: only at the end)."""
        return self.params.output_kind != RequestOutputKind.FINAL_ONLY or self.finished

    def make_output(self) -> RequestOutput:
        """A snapshot `RequestOutput` (lists copied so later steps do not mutate it; the
        prompt's ids are one list shared by the request's outputs).

        DELTA requests get only what is new since their previous output: new tokens and
        logprobs, new text (less the characters a stop string could still claim, until the
        completion ends), prompt logprobs in the first output only.
        """
        if self.params.output_kind != RequestOutputKind.DELTA:
            outputs = [CompletionOutput(o.index, o.text, list(o.token_ids), o.cumulative_logprob,
                                        list(o.logprobs) if o.logprobs is not None else None,
                                        o.finish_reason, o.stop_reason, o.routed_experts)
                       for o in self.outputs]
            prompt_logprobs = self.prompt_logprobs
        else:
            outputs = [c for o in self.outputs if (c := self._delta(o)) is not None]
            prompt_logprobs = None if self._prompt_logprobs_sent else self.prompt_logprobs
            self._prompt_logprobs_sent = True
        return RequestOutput(self.request_id, self.prompt, self._output_prompt_ids, outputs,
                             self.finished, self.metrics.snapshot(),
                             self.root.num_cached_tokens,
                             None if prompt_logprobs is None else list(prompt_logprobs),
                             self.error)

    def _delta(self, o: CompletionOutput) -> CompletionOutput | None:
        """What completion `o` gained since its last DELTA output (None: nothing)."""
        ntok, nchar, nlp, ended = self._sent.get(o.index, (0, 0, 0, False))
        end = len(o.text)
        if o.finish_reason is None:
            end = max(nchar, end - self.params.output_text_buffer_length)
        if (len(o.token_ids), end) == (ntok, nchar) and (o.finish_reason is None or ended):
            return None
        num_lp = len(o.logprobs) if o.logprobs is not None else 0
        self._sent[o.index] = (len(o.token_ids), end, num_lp, o.finish_reason is not None)
        return CompletionOutput(o.index, o.text[nchar:end], o.token_ids[ntok:],
                                o.cumulative_logprob,
                                o.logprobs[nlp:] if o.logprobs is not None else None,
                                o.finish_reason, o.stop_reason, o.routed_experts)


@dataclasses.dataclass
class ProcessedOutputs:
    """What the output processor made of a step or an abort (vLLM's
    `OutputProcessorOutput`).

    Attributes:
        outputs: The `RequestOutput`s to hand to callers.
        to_finish: `{request_id: status}` of scheduler requests the engine must end now
            (a stop string matched, the request failed or was aborted); the processor
            never touches the scheduler itself.
    """

    outputs: list[RequestOutput]
    to_finish: dict[str, RequestStatus]


class OutputProcessor:
    """The engine's live user requests and what each step turns into `RequestOutput`s.

    Args:
        routing: Where the steps' routed experts are recorded (routing capture), handed
            to each completion when it finishes; None: no capture.
    """

    def __init__(self, routing: RoutedExperts | None = None):
        self.routing = routing
        self.states: dict[str, RequestState] = {}
        self.finished_reasons: dict[str, int] = {}
        self.num_generation_tokens = 0
        # Prompt tokens of requests (each completion of n > 1 apart) that got their first
        # token, counted then, as vLLM counts `prompt_tokens`.
        self.num_prompt_tokens = 0

    def add(self, state: RequestState) -> None:
        self.states[state.request_id] = state

    def abort(self, request_ids: list[str]) -> ProcessedOutputs:
        """Ends requests (finish_reason "abort"): their final outputs, and the scheduler
        requests to end."""
        done = ProcessedOutputs([], {})
        for request_id in request_ids:
            state = self.states.pop(request_id, None)
            if state is None:
                continue
            for req_id in state.live_request_ids():
                done.to_finish[req_id] = RequestStatus.FINISHED_ABORTED
            if self.routing is not None:
                for req in state.requests.values():
                    self.routing.drop(req.request_id)
            state.abort()
            self._count(["abort"])
            done.outputs.append(state.make_output())
        return done

    def _fail(self, state: RequestState, error: BaseException | str,
              to_finish: dict[str, RequestStatus]) -> None:
        """Ends one user request with finish_reason "error" (its scheduler requests go to
        `to_finish`); the others go on."""
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        logger.warning("jaxserve: request %s failed: %s", state.request_id, message)
        for req_id in state.live_request_ids():
            to_finish.setdefault(req_id, RequestStatus.FINISHED_ERROR)
        state.fail(message)

    def row_state(self, req: Request, now: float) -> RequestState:
        """The state of a scheduled request (marks it scheduled)."""
        state = self.states[req.user_request_id]
        state.on_scheduled(now)
        return state

    def process(self, step: CoreStep, now: float | None = None) -> ProcessedOutputs:
        """Outputs of the requests a step advanced (`CoreStep`), and the scheduler requests
        the engine must end.

        NOTE: a failure in one request's own work (its sampling row, its detokenization)
        ends that request only, with finish_reason "error".
        """
        now = time.time() if now is None else now
        touched: dict[str, RequestState] = {}
        to_finish: dict[str, RequestStatus] = {}
        for req_id, error in step.failed.items():
            state = self.states.get(step.requests[req_id].user_request_id)
            if state is None:
                continue  # aborted while its step ran (async scheduling)
            if state.error is None:
                self._fail(state, error, to_finish)
            touched[state.request_id] = state
        for req, tokens in step.updates:
            state = self.states[req.user_request_id]
            if state.error is not None:  # failed earlier in this step
                if not req.is_finished():  # a sibling forked after the failure
                    to_finish.setdefault(req.request_id, RequestStatus.FINISHED_ERROR)
                continue
            # A child forked this step sampled from its parent's i-th fan-out row.
            rows = step.row_of.get(req.request_id) \
                or [step.row_of[req.forked_from][req.sample_index]]
            self.num_generation_tokens += len(tokens)
            if req.num_output_tokens == len(tokens):  # its first token(s)
                self.num_prompt_tokens += len(state.prompt_token_ids)
            try:
                stop_str = state.on_tokens(req, tokens, step.result, rows, now)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the step's
                self._fail(state, e, to_finish)
                stop_str = None
            if stop_str is not None and not req.is_finished():
                to_finish.setdefault(req.request_id, RequestStatus.FINISHED_STOPPED)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if self.routing is not None:
                self._hand_routing(state)
            if state.wants_output:
                outputs.append(state.make_output())
            if state.finished:
                del self.states[state.request_id]
                self._count(state.finish_reasons())
        return ProcessedOutputs(outputs, to_finish)

    def _hand_routing(self, state: RequestState) -> None:
        """Gives each newly finished completion its routed experts (children first: a
        fan-out child that computed nothing yet starts from its parent's record)."""
        for o in reversed(state.outputs):
            req = state.requests.get(o.index)
            if o.finish_reason is not None and o.routed_experts is None and req is not None:
                length = len(state.prompt_token_ids) + len(o.token_ids) - 1
                o.routed_experts = self.routing.take(req, max(length, 0))

    def _count(self, reasons: list[str]) -> None:
        for reason in reasons:
            self.finished_reasons[reason] = self.finished_reasons.get(reason, 0) + 1

    def record_prompt_logprobs(self, out, requests: dict[str, Request], lp) -> None:
        """Stores the prompt logprobs a step computed (`PromptLogprobs` of host arrays)."""
        t = 0
        for s in out.scheduled:
            req = requests[s.request_id]
            state = self.states.get(req.user_request_id)
            k = req.sampling_params.prompt_logprobs
            if state is not None and k is not None and req.sample_index == 0:
                for i in range(s.num_new_tokens):
                    pos = s.start_pos + i
                    if pos + 1 < req.num_prompt_tokens:
                        state.set_prompt_logprob(pos + 1, req.prompt_token_ids[pos + 1],
                                                 lp, t + i, k)
            t += s.num_new_tokens
