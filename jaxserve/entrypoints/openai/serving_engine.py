"""What completions and chat share: the request flow (prepare off the event loop, add all
prompts at once, answer whole or streamed), per-completion deltas, usage and SSE framing."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from jaxserve.engine.async_llm import (
    EngineDeadError,
    RequestFailedError,
    RequestStream,
)
from jaxserve.entrypoints.openai.errors import (  # noqa: F401 - re-exported
    OpenAIError,
    error_body,
    from_validation_error,
    from_value_error,
    parse_body,
)
from jaxserve.entrypoints.openai.serving_base import (
    SAMPLING_FIELDS,
    OpenAIServingBase,
    Prepared,
    random_id,
)
from jaxserve.lora import LoRARequest
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxserve.sampling_params import SamplingParams


@dataclasses.dataclass
class Delta:
    """New output of one completion since the last one sent.

    Attributes:
        prompt_index: Which prompt of the request.
        comp: The completion's latest state.
        text: Text not sent yet (a possible stop string held back while running).
        token_start: Index of the first token not sent yet.
        first: Whether nothing was sent for this completion before.
    """

    prompt_index: int
    comp: CompletionOutput
    text: str
    token_start: int
    first: bool


class OpenAIServing(OpenAIServingBase, abc.ABC):
    """Base of the generating endpoints: subclasses define `request_model`, `prepare` (runs
    in a worker thread), `full_response` and `stream_events`."""

    request_model: type = None
    id_prefix = "req"
    # Engine field names reported under the request's own (an engine refusal's `param`).
    field_renames: dict[str, str] = {}

    @abc.abstractmethod
    def prepare(self, req) -> Prepared:
        """Validates and tokenizes a parsed request (in a worker thread)."""

    def _parse(self, body):
        req = parse_body(body, self.request_model)
        self.check_model(req.model)
        self.check_stop(req.stop)
        return req

    def _parse_and_prepare(self, body, heavy: bool = True) -> tuple[Any, Prepared | None]:
        """The parsed request and, unless the light lane meets a request's own chat
        template (prepared in the heavy lane instead), the prepared one."""
        req = self._parse(body)
        if not heavy and getattr(req, "chat_template", None) is not None:
            return req, None
        return req, self.prepare(req)

    async def create(self, body, is_disconnected: Callable[[], Awaitable[bool]] | None = None,
                     body_bytes: int | None = None):
        """Answers one request: a response dict, or an async iterator of SSE lines.

        NOTE: parsing, tokenizing and template rendering run in a worker thread of
        `self.lanes`, so the event loop (and `/health`) stays responsive whatever the body
        holds: a large body (or `body_bytes`) is prepared in the heavy lane, and so is a
        request's own `chat_template` (parsed in the light lane, rendered in the heavy one).

        Raises:
            OpenAIError: A bad request (400), unknown model (404), too many heavy requests
                (429), engine gone (503), a request that failed in the engine (500).
        """
        size = len(body) if isinstance(body, (bytes, str)) else body_bytes or 0
        heavy = self.lanes.is_heavy(size)
        req, prep = await self.lanes.run(heavy, self._parse_and_prepare, body, heavy)
        if prep is None:
            prep = await self.lanes.run(True, self.prepare, req)
        # NOTE: resolved again here, on the event loop: an adapter unloaded since `_parse`
        # checked the name is a 404 now, not a request for an adapter no longer served.
        prep.lora_request = self.check_model(req.model)
        request_id = random_id(self.id_prefix)
        if getattr(req, "use_beam_search", False):
            return await self._beam_search(req, prep, request_id, is_disconnected)
        streams = await self.start(request_id, prep.prompts, prep.params,
                                   getattr(req, "priority", 0), getattr(req, "cache_salt", None),
                                   prep.lora_request)
        if getattr(req, "stream", False):
            return self._sse(self.stream_events(req, prep, request_id, streams))
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            await _until_done_or_gone(_collect(streams, finals), is_disconnected)
        except RequestFailedError as e:
            raise OpenAIError(500, str(e)) from None
        except EngineDeadError as e:
            raise OpenAIError(503, str(e)) from None
        return self.full_response(req, prep, request_id, finals)

    async def _beam_search(self, req, prep: Prepared, request_id: str,
                           is_disconnected=None) -> dict:
        """A `use_beam_search` request: the best n hypotheses of each prompt as choices."""
        from jaxserve.entrypoints.openai.beam_search import beam_search

        eos = self.llm.engine.eos_token_ids
        salt = getattr(req, "cache_salt", None)

        async def one(i: int, prompt: dict) -> RequestOutput:
            ids = prompt["prompt_token_ids"]
            # NOTE: max_tokens=None runs to max_model_len, as for sampling.
            bp = req.beam_search_params(prep.params.max_tokens
                                        or max(1, self.max_model_len - len(ids) - 1))
            seqs = await beam_search(self.llm, ids, bp, f"{request_id}-{i}", eos, salt,
                                     prep.lora_request)
            outputs = [CompletionOutput(
                j, self.tokenizer.decode(s.tokens[len(ids):], skip_special_tokens=True),
                s.tokens[len(ids):], s.cum_logprob, None, s.finish_reason)
                for j, s in enumerate(seqs)]
            return RequestOutput(request_id, prompt.get("prompt"), ids, outputs, True,
                                 RequestMetrics(arrival_time=time.time()))

        async def every_prompt():
            tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prep.prompts)]
            try:
                return await asyncio.gather(*tasks)
            finally:  # NOTE: one prompt's failure stops the others' searches
                for task in tasks:
                    task.cancel()

        try:
            finals = await _until_done_or_gone(every_prompt(), is_disconnected)
        except RequestFailedError as e:
            raise OpenAIError(500, str(e)) from None
        except EngineDeadError as e:
            raise OpenAIError(503, str(e)) from None
        return self.full_response(req, prep, request_id, finals)

    async def start(self, base_id: str, prompts: list[dict], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None,
                    lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """Adds one engine request per prompt (with the LoRA adapter `lora_request`, if
        any), all at once; all or none."""
        limit = self.limits.max_prompts_per_request
        if len(prompts) > limit:
            raise OpenAIError(400, f"prompt: at most {limit} prompts per request, got "
                                   f"{len(prompts)}", "prompt")
        ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        try:
            return await self.llm.add_requests(list(zip(ids, prompts, strict=True)), params,
                                               priority=priority, cache_salt=cache_salt,
                                               lora_request=lora_request)
        except EngineDeadError as e:
            raise OpenAIError(503, str(e)) from None
        except ValueError as e:
            raise from_value_error(e, SAMPLING_FIELDS | {"prompt", "messages", "priority",
                                                         "cache_salt"},
                                   self.field_renames) from None

    @abc.abstractmethod
    def full_response(self, req, prep: Prepared, request_id: str,
                      finals: list[RequestOutput]) -> dict:
        """The non-streamed response body."""

    @abc.abstractmethod
    def stream_events(self, req, prep: Prepared, request_id: str,
                      streams: list[RequestStream]) -> AsyncIterator[dict]:
        """The streamed response's events (the base adds errors and `[DONE]`)."""

    async def _sse(self, events: AsyncIterator[dict]) -> AsyncIterator[str]:
        """SSE lines of `events`, an in-band error event on failure, then `[DONE]`."""
        try:
            async for event in events:
                yield sse(event)
        except OpenAIError as e:
            yield sse(e.body())
        except EngineDeadError as e:
            yield sse(error_body(503, str(e)))
        except Exception as e:  # noqa: BLE001 - reported in-band: the headers are sent
            yield sse(error_body(500, str(e)))
        yield sse("[DONE]")


# How often a non-streaming request checks that its client is still there.
DISCONNECT_POLL_SECONDS = 0.2


async def _collect(streams: list[RequestStream], finals: list[RequestOutput | None]) -> None:
    async for i, out in merge_streams(streams):
        finals[i] = out


async def _until_done_or_gone(work: Awaitable,
                              is_disconnected: Callable[[], Awaitable[bool]] | None):
    """Awaits `work`, checking the client meanwhile (whether or not outputs arrive: a
    request still waiting for a slot has none); a client that left cancels `work`, which
    aborts its requests at once (a 499).

    Returns:
        What `work` returns.

    Raises:
        OpenAIError: 499 when the client disconnected; whatever `work` raises.
    """
    task = asyncio.ensure_future(work)
    if is_disconnected is None:
        return await task
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await is_disconnected():
                raise OpenAIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()  # NOTE: closing merge_streams aborts every unfinished request
            with contextlib.suppress(BaseException):
                await task


async def deltas(streams: list[RequestStream], params: SamplingParams,
                 finals: list[RequestOutput | None]) -> AsyncIterator[Delta]:
    """New text/tokens of every completion as outputs arrive; fills `finals`.

    Raises:
        RequestFailedError: A request failed in the engine.
    """
    n = params.n
    sent_text = [[0] * n for _ in streams]
    sent_tokens = [[0] * n for _ in streams]
    done = [[False] * n for _ in streams]
    async for i, out in merge_streams(streams):
        finals[i] = out
        for comp in out.outputs:
            c = comp.index
            if done[i][c]:
                continue
            text = visible_text(comp, params)
            delta, start = text[sent_text[i][c]:], sent_tokens[i][c]
            if not delta and len(comp.token_ids) == start and not comp.finish_reason:
                continue
            first = sent_text[i][c] == 0 and sent_tokens[i][c] == 0
            sent_text[i][c], sent_tokens[i][c] = len(text), len(comp.token_ids)
            done[i][c] = comp.finish_reason is not None
            yield Delta(i, comp, delta, start, first)


async def merge_streams(streams: list[RequestStream]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields `(prompt index, output)` from several streams as outputs arrive.

    Leaving early aborts every unfinished request.
    """
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    pending = {asyncio.ensure_future(s.get()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                out = task.result()
                if not out.finished:
                    pending[asyncio.ensure_future(streams[i].get())] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
        for s in streams:
            s.abort()


def visible_text(comp: CompletionOutput, params: SamplingParams) -> str:
    """The text safe to show now: a running completion holds back a possible stop string."""
    if comp.finish_reason is not None:
        return comp.text
    hold = params.output_text_buffer_length
    return comp.text[:max(0, len(comp.text) - hold)]


def usage(outputs: list[RequestOutput | None], req=None, prep: Prepared | None = None,
          details: bool = False) -> dict:
    """OpenAI `usage` over every prompt's request and all its completions (vLLM's keys).

    Args:
        outputs: The requests' latest outputs (None: no output yet).
        req: The request body; echo with max_tokens=0 generated nothing to count.
        prep: The prepared request; its prompts count even before their first output.
        details: `prompt_tokens_details` (`{"cached_tokens"}`) when some prompt tokens were
            cached (`--enable-prompt-tokens-details`, as vLLM); None otherwise.
    """
    seen = [o for o in outputs if o is not None]
    # NOTE: an image prompt (text the engine tokenizes, its markers expanded) counts the
    # engine's ids once its first output came, nothing before.
    prompt = sum(len(p["prompt_token_ids"]) if "prompt_token_ids" in p
                 else len(o.prompt_token_ids) if o is not None else 0
                 for p, o in zip(prep.prompts, outputs, strict=False)) if prep is not None \
        else sum(len(o.prompt_token_ids) for o in seen)
    completion = 0 if getattr(req, "echo_only", False) else sum(
        len(c.token_ids) for o in seen for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in seen)
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached} if details and cached else None}


def final_usage(outputs: list[RequestOutput | None], req=None, details: bool = False) -> dict:
    """The last stream chunk's `usage` (`include_usage`): vLLM drops its null keys."""
    return {k: v for k, v in usage(outputs, req, details=details).items() if v is not None}


def chunk_usage(req, prep: Prepared, finals: list[RequestOutput | None],
                chat: bool = False) -> dict:
    """A stream chunk's `usage` so far when the request asked for
    `stream_options.continuous_usage_stats` (with `include_usage`), as vLLM sends it: a
    completion chunk always has the key (null otherwise, and a null
    `prompt_tokens_details`); a chat chunk has it only then, with the three counts."""
    opts = req.stream_options
    if opts is None or not (opts.include_usage and opts.continuous_usage_stats):
        return {} if chat else {"usage": None}
    counts = usage(finals, req, prep)
    if chat:
        del counts["prompt_tokens_details"]
    return {"usage": counts}


def token_label(token_id: int, text: str, as_ids: bool) -> str:
    """A logprob entry's token: its text, or vLLM's `token_id:N` (`return_tokens_as_token_ids`:
    a client maps it back to the id without the tokenizer, whatever the text holds)."""
    return f"token_id:{token_id}" if as_ids else text


def routed_experts_json(comp: CompletionOutput) -> list | None:
    """A finished completion's routed experts as nested lists [position][layer][k] (the
    engine captures them under `--enable-return-routed-experts`), else None."""
    return None if comp.routed_experts is None else comp.routed_experts.tolist()


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def now() -> int:
    """Seconds since the epoch (OpenAI's `created`)."""
    return int(time.time())
