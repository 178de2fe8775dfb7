"""`POST /v1/completions`: prompts (text or token ids) to completions, whole or streamed (SSE)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

from jaxserve.engine.async_llm import EngineDeadError
from jaxserve.entrypoints.openai.protocol import CompletionRequest
from jaxserve.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    error_body,
    from_value_error,
    merge_streams,
    now,
    parse_body,
    random_id,
    sse,
    usage,
    visible_text,
)
from jaxserve.outputs import CompletionOutput
from jaxserve.sampling_params import SamplingParams

_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)} | {
    "logit_bias", "suffix", "best_of", "prompt"}


def _token_text(entry: dict, token_id: int, tokenizer) -> tuple[str, float]:
    lp = entry.get(token_id)
    text = lp.decoded_token if lp is not None and lp.decoded_token is not None \
        else tokenizer.decode([token_id])
    return text, (lp.logprob if lp is not None else float("nan"))


def completion_logprobs(comp: CompletionOutput, start: int, offset: int, tokenizer) -> dict:
    """OpenAI's legacy logprobs object for tokens `start:` of a completion."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for tid, entry in zip(comp.token_ids[start:], (comp.logprobs or [])[start:], strict=False):
        text, lp = _token_text(entry, tid, tokenizer)
        tokens.append(text)
        token_logprobs.append(lp)
        top_logprobs.append({(v.decoded_token if v.decoded_token is not None
                              else tokenizer.decode([k])): v.logprob for k, v in entry.items()})
        text_offset.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


class OpenAIServingCompletion(OpenAIServing):
    """Handles completion requests."""

    def _prompts(self, req: CompletionRequest) -> list[dict]:
        """Each prompt as `{"prompt": text or None, "prompt_token_ids": ids}`."""
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise OpenAIError(400, "prompt must not be empty", "prompt")
        prompts = []
        for item in p:
            if isinstance(item, str):
                prompts.append({"prompt": item, "prompt_token_ids": self.encode(item)})
            else:
                prompts.append({"prompt": None, "prompt_token_ids": list(item)})
            if not prompts[-1]["prompt_token_ids"]:
                raise OpenAIError(400, "prompt must not be empty", "prompt")
        return prompts

    async def create(self, body, is_disconnected: Callable[[], Awaitable[bool]] | None = None):
        """Answers one request: a response dict, or an async iterator of SSE lines.

        Raises:
            OpenAIError: A bad request (400), unknown model (404), engine gone (503).
        """
        req = parse_body(body, CompletionRequest)
        self.check_model(req.model)
        try:
            params = req.to_sampling_params()
        except ValueError as e:
            raise from_value_error(e, _FIELDS) from None
        prompts = self._prompts(req)
        for p in prompts:
            self.check_length(len(p["prompt_token_ids"]), params, "prompt")
        request_id = random_id("cmpl")
        streams = await self.start(request_id, prompts, params, req.priority, req.cache_salt)
        if req.stream:
            return self._stream(req, params, request_id, prompts, streams)
        return await self._full(req, params, request_id, prompts, streams, is_disconnected)

    def _echo(self, req: CompletionRequest, prompt: dict) -> str:
        if not req.echo:
            return ""
        return prompt["prompt"] or self.tokenizer.decode(prompt["prompt_token_ids"])

    async def _full(self, req, params, request_id, prompts, streams, is_disconnected) -> dict:
        finals = [None] * len(streams)
        async for i, out in merge_streams(streams):
            finals[i] = out
            if is_disconnected is not None and not out.finished and await is_disconnected():
                raise OpenAIError(499, "client disconnected")
        choices = []
        for i, out in enumerate(finals):
            echo = self._echo(req, prompts[i])
            for comp in out.outputs:
                choices.append({
                    "index": i * params.n + comp.index, "text": echo + comp.text,
                    "logprobs": completion_logprobs(comp, 0, len(echo), self.tokenizer)
                    if params.logprobs is not None else None,
                    "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason})
        return {"id": request_id, "object": "text_completion", "created": now(),
                "model": self.model_name, "choices": choices, "usage": usage(finals)}

    async def _stream(self, req, params: SamplingParams, request_id, prompts,
                      streams) -> AsyncIterator[str]:
        created = now()
        n = params.n
        sent_text = [[0] * n for _ in streams]
        sent_tokens = [[0] * n for _ in streams]
        done = [[False] * n for _ in streams]
        finals = [None] * len(streams)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        try:
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
                    if sent_text[i][c] == 0 and sent_tokens[i][c] == 0:
                        delta = self._echo(req, prompts[i]) + delta
                    logprobs = completion_logprobs(comp, start, sent_text[i][c], self.tokenizer) \
                        if params.logprobs is not None else None
                    sent_text[i][c], sent_tokens[i][c] = len(text), len(comp.token_ids)
                    done[i][c] = comp.finish_reason is not None
                    yield sse({"id": request_id, "object": "text_completion",
                               "created": created, "model": self.model_name,
                               "choices": [{"index": i * n + c, "text": delta,
                                            "logprobs": logprobs,
                                            "finish_reason": comp.finish_reason,
                                            "stop_reason": comp.stop_reason}]})
            if include_usage:
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": self.model_name, "choices": [], "usage": usage(finals)})
        except OpenAIError as e:
            yield sse(e.body())
        except EngineDeadError as e:
            yield sse(error_body(503, str(e)))
        except Exception as e:  # noqa: BLE001 - reported in-band: the headers are sent
            yield sse(error_body(500, str(e)))
        yield sse("[DONE]")
