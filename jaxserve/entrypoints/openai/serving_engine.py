"""What completions, chat and tokenization share: errors, model check, prompts, request fan-out."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import time
import uuid
from collections.abc import AsyncIterator

from pydantic import BaseModel, ValidationError

from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


class OpenAIError(Exception):
    """An error answered with an OpenAI-style body.

    Args:
        status: HTTP status code.
        message: Human-readable message.
        param: The request field at fault, if any.
    """

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        """The JSON error body."""
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """`{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


# pydantic adds the tried member of a union to an error's location (`stop.str`).
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def from_validation_error(e: ValidationError) -> OpenAIError:
    """A 400 naming the first bad field of a pydantic validation error."""
    err = e.errors()[0]
    parts = [str(p) for p in err.get("loc", ())
             if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p))]
    loc = ".".join(parts)
    param = loc or None
    return OpenAIError(400, f"{loc}: {err['msg']}" if loc else err["msg"], param)


def from_value_error(e: Exception, fields: set[str]) -> OpenAIError:
    """A 400 for a ValueError whose message starts with a field name (SamplingParams')."""
    message = str(e)
    first = re.match(r"[A-Za-z_]\w*", message)
    return OpenAIError(400, message, first[0] if first and first[0] in fields else None)


def parse_body(data: bytes | dict, model: type[BaseModel]) -> BaseModel:
    """Parses a JSON body (bytes or an already decoded dict) into `model`, or a 400."""
    if isinstance(data, (bytes, str)):
        try:
            data = json.loads(data)
        except ValueError as e:
            raise OpenAIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


def random_id(prefix: str) -> str:
    """A unique id such as `cmpl-<32 hex digits>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIServing:
    """Base of the endpoint handlers.

    Args:
        llm: The async engine.
        served_model_names: Names clients may ask for; the first is reported.
    """

    def __init__(self, llm: AsyncLLM, served_model_names: list[str]):
        self.llm = llm
        self.served_model_names = list(served_model_names)
        self.model_name = self.served_model_names[0]
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len

    def check_model(self, model: str | None) -> None:
        """Raises a 404 for a model this server does not serve (None means the default)."""
        if model is not None and model not in self.served_model_names:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as the engine would tokenize it."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def check_length(self, num_prompt: int, params: SamplingParams, param: str) -> None:
        """400 for a prompt that leaves no room, or prompt + max_tokens over max_model_len."""
        limit = self.max_model_len
        if num_prompt >= limit:
            raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. "
                                   f"However, your prompt has {num_prompt} tokens, which "
                                   "leaves no room for a completion.", param)
        if params.max_tokens is not None and num_prompt + params.max_tokens > limit:
            raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. "
                                   f"However, you requested {num_prompt + params.max_tokens} "
                                   f"tokens ({num_prompt} in the prompt, {params.max_tokens} "
                                   "in the completion).", "max_tokens")

    async def start(self, base_id: str, prompts: list[dict], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None) -> list[RequestStream]:
        """Adds one engine request per prompt; all or none (the added ones are aborted)."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.llm.add_request(rid, prompt, params,
                                                          priority=priority,
                                                          cache_salt=cache_salt))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, EngineDeadError):
                raise OpenAIError(503, str(e)) from None
            if isinstance(e, ValueError):
                fields = {f.name for f in dataclasses.fields(SamplingParams)}
                raise from_value_error(e, fields | {"prompt", "messages", "priority"}) from None
            raise
        return streams


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


def usage(outputs: list[RequestOutput]) -> dict:
    """OpenAI `usage` over every prompt's request and all its completions."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def now() -> int:
    """Seconds since the epoch (OpenAI's `created`)."""
    return int(time.time())
