"""`POST /v1/chat/completions`: messages through the chat template, replies whole or streamed."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

from jaxserve.engine.async_llm import EngineDeadError
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
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
    "logit_bias", "top_logprobs", "messages", "max_completion_tokens"}


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(comp: CompletionOutput, start: int, top: int, tokenizer) -> dict:
    """OpenAI's chat logprobs object (`{"content": [...]}`) for tokens `start:`."""
    content = []
    decode = lambda tid, lp: lp.decoded_token if lp.decoded_token is not None \
        else tokenizer.decode([tid])
    for tid, entry in zip(comp.token_ids[start:], (comp.logprobs or [])[start:], strict=False):
        lp = entry.get(tid)
        item = _entry(decode(tid, lp), lp.logprob) if lp is not None \
            else _entry(tokenizer.decode([tid]), float("nan"))
        ranked = sorted(((v.rank or 0, k, v) for k, v in entry.items() if v.rank is not None
                         and v.rank <= top), key=lambda r: r[0])
        item["top_logprobs"] = [_entry(decode(k, v), v.logprob) for _, k, v in ranked]
        content.append(item)
    return {"content": content}


def render_messages(tokenizer, messages: list[ChatMessage], **kwargs) -> list[int]:
    """Token ids of `messages` through the chat template (a 400 naming `messages` on failure)."""
    try:
        ids = tokenizer.apply_chat_template(
            [m.as_template_message() for m in messages], tokenize=True, return_dict=False,
            **{k: v for k, v in kwargs.items() if v is not None})
    except OpenAIError:
        raise
    except Exception as e:  # noqa: BLE001 - template errors are the client's
        raise OpenAIError(400, f"messages: cannot apply the chat template: {e}",
                          "messages") from None
    return list(ids)


class OpenAIServingChat(OpenAIServing):
    """Handles chat completion requests."""

    async def create(self, body, is_disconnected: Callable[[], Awaitable[bool]] | None = None):
        """Answers one request: a response dict, or an async iterator of SSE lines.

        Raises:
            OpenAIError: A bad request (400), unknown model (404), engine gone (503).
        """
        req = parse_body(body, ChatCompletionRequest)
        self.check_model(req.model)
        try:
            params = req.to_sampling_params()
            if req.continue_final_message and req.add_generation_prompt:
                raise ValueError("messages: continue_final_message needs "
                                 "add_generation_prompt=false")
        except ValueError as e:
            raise from_value_error(e, _FIELDS) from None
        kwargs = dict(req.chat_template_kwargs or {})
        ids = render_messages(self.tokenizer, req.messages,
                              add_generation_prompt=req.add_generation_prompt,
                              continue_final_message=req.continue_final_message or None,
                              chat_template=req.chat_template, **kwargs)
        self.check_length(len(ids), params, "messages")
        request_id = random_id("chatcmpl")
        streams = await self.start(request_id, [{"prompt_token_ids": ids}], params,
                                   req.priority, req.cache_salt)
        last = req.messages[-1]
        echo = last.as_template_message()["content"] if req.echo and last.role == "assistant" \
            else ""
        if req.stream:
            return self._stream(req, params, request_id, streams, echo)
        final = None
        async for _, out in merge_streams(streams):
            final = out
            if is_disconnected is not None and not out.finished and await is_disconnected():
                raise OpenAIError(499, "client disconnected")
        choices = [{
            "index": comp.index,
            "message": {"role": "assistant", "content": echo + comp.text},
            "logprobs": chat_logprobs(comp, 0, params.logprobs, self.tokenizer)
            if params.logprobs is not None else None,
            "finish_reason": comp.finish_reason, "stop_reason": comp.stop_reason,
        } for comp in final.outputs]
        return {"id": request_id, "object": "chat.completion", "created": now(),
                "model": self.model_name, "choices": choices, "usage": usage([final])}

    async def _stream(self, req, params: SamplingParams, request_id, streams,
                      echo: str) -> AsyncIterator[str]:
        created, n = now(), params.n
        sent_text, sent_tokens, done = [0] * n, [0] * n, [False] * n
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        final = None
        try:
            for c in range(n):
                yield sse({**head, "choices": [{
                    "index": c, "delta": {"role": "assistant", "content": echo},
                    "logprobs": None, "finish_reason": None}]})
            async for _, out in merge_streams(streams):
                final = out
                for comp in out.outputs:
                    c = comp.index
                    if done[c]:
                        continue
                    text = visible_text(comp, params)
                    delta, start = text[sent_text[c]:], sent_tokens[c]
                    if not delta and len(comp.token_ids) == start and not comp.finish_reason:
                        continue
                    logprobs = chat_logprobs(comp, start, params.logprobs, self.tokenizer) \
                        if params.logprobs is not None else None
                    sent_text[c], sent_tokens[c] = len(text), len(comp.token_ids)
                    done[c] = comp.finish_reason is not None
                    yield sse({**head, "choices": [{
                        "index": c, "delta": {"content": delta} if delta else {},
                        "logprobs": logprobs, "finish_reason": comp.finish_reason,
                        "stop_reason": comp.stop_reason}]})
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage([final])})
        except OpenAIError as e:
            yield sse(e.body())
        except EngineDeadError as e:
            yield sse(error_body(503, str(e)))
        except Exception as e:  # noqa: BLE001 - reported in-band: the headers are sent
            yield sse(error_body(500, str(e)))
        yield sse("[DONE]")
