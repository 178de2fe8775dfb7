"""`POST /v1/responses` (OpenAI's Responses API, as vLLM serves it): the request becomes a chat
request served by the chat path, whose reply becomes output items, whole or as events."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import AsyncIterator

from jaxserve.engine.async_llm import EngineDeadError, RequestStream
from jaxserve.entrypoints.openai.protocol import ChatCompletionRequest
from jaxserve.entrypoints.openai.protocol_responses import CHAT_FIELD_NAMES, ResponsesRequest
from jaxserve.entrypoints.openai.serving_base import Prepared
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    error_body,
    from_value_error,
    now,
)
from jaxserve.outputs import RequestOutput

_FIELDS = frozenset(ResponsesRequest.model_fields)


def _renamed(e: OpenAIError) -> OpenAIError:
    """A chat request's error under the Responses field that set the chat field."""
    name = CHAT_FIELD_NAMES.get(e.param)
    if name is None:
        return e
    message = name + e.message[len(e.param):] if e.message.startswith(e.param) else e.message
    return OpenAIError(e.status, message, name)


def _input_part(e: OpenAIError, items: list[int | None]) -> OpenAIError:
    """An error naming a chat message's content part (an image's) under the `input` item
    the message came from."""
    found = re.match(r"messages\[(\d+)\](\.content\[\d+\])", e.param or "")
    if found is None or items[int(found[1])] is None:
        return e
    name = f"input[{items[int(found[1])]}]{found[2]}"
    return OpenAIError(e.status, name + e.message[len(found[0]):]
                       if e.message.startswith(found[0]) else e.message, name)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, logprobs: list | None, status: str) -> dict:
    """An assistant `message` output item holding one `output_text` part (none if no text)."""
    parts = [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}] \
        if text else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": parts}


def call_item(item_id: str, call: dict, status: str) -> dict:
    """A `function_call` output item from a chat tool call (`{"id", "function"}`)."""
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def reasoning_item(item_id: str, text: str, status: str | None) -> dict:
    """A `reasoning` output item holding the reply's reasoning as one `reasoning_text` part
    (vLLM's, for gpt-oss's analysis and for `--reasoning-parser` replies)."""
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None,
            "status": status}


def output_items(message: dict, logprobs: list | None) -> list[dict]:
    """The output items of a whole chat reply: its reasoning (if any), its text as a message
    (also when there is neither text nor a call), then one `function_call` per tool call."""
    calls = message.get("tool_calls") or []
    items = [reasoning_item(_item_id("rs"), message["reasoning"], None)] \
        if message.get("reasoning") else []
    if message.get("content") or not calls:
        items.append(message_item(_item_id("msg"), message.get("content") or "", logprobs,
                                  "completed"))
    return items + [call_item(_item_id("fc"), c, "completed") for c in calls]


def response_usage(out: RequestOutput | None) -> dict | None:
    """vLLM's Responses `usage` (its per-turn lists are empty for a plain reply, as vLLM's)."""
    if out is None:
        return None
    prompt = len(out.prompt_token_ids or [])
    generated = sum(len(c.token_ids) for c in out.outputs)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": out.num_cached_tokens,
                                     "input_tokens_per_turn": [],
                                     "cached_tokens_per_turn": []},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + generated}


class _Recorded:
    """A request stream that keeps its latest output (a streamed response's usage), handed
    to the chat handler's stream in its place (iterated, or aborted when left early)."""

    def __init__(self, stream: RequestStream):
        self.stream, self.last = stream, None

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self):
        async for out in self.stream:
            self.last = out
            yield out

    def abort(self) -> None:
        self.stream.abort()


class ResponseEvents:
    """Numbers the events of one streamed response and builds its output items from the
    chat reply's deltas (text into a message item, each tool call into a function_call
    item), opening and closing items as the reply moves from one to the next."""

    def __init__(self, with_logprobs: bool):
        self.sequence_number = 0
        self.output: list[dict] = []  # items done
        self.item: dict | None = None  # the item being streamed
        self.with_logprobs = with_logprobs
        self.text, self.logprobs, self.pending = "", [], []

    def event(self, kind: str, **fields) -> dict:
        """One event, with the next sequence number."""
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _at(self) -> dict:
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def delta(self, delta: dict, logprobs: list | None) -> list[dict]:
        """The events of one chat delta (`reasoning`, `content`, `tool_calls`) and its
        tokens' logprobs."""
        events = []
        self.pending += logprobs or []
        if delta.get("reasoning"):
            if self.item is None or self.item["type"] != "reasoning":
                events += self.close()
                self.item = reasoning_item(_item_id("rs"), "", "in_progress")
                events.append(self.event("response.output_item.added",
                                         output_index=len(self.output), item=self.item))
                events.append(self.event("response.content_part.added", **self._at(),
                                         content_index=0, part=self.item["content"][0]))
            self.text += delta["reasoning"]
            self.pending = []  # reasoning tokens: no output_text logprobs
            events.append(self.event("response.reasoning_text.delta", **self._at(),
                                     content_index=0, delta=delta["reasoning"]))
        if delta.get("content"):
            if self.item is None or self.item["type"] != "message":
                events += self.close()
                self.item = message_item(_item_id("msg"), "", None, "in_progress")
                events.append(self.event("response.output_item.added",
                                         output_index=len(self.output), item=self.item))
                events.append(self.event("response.content_part.added", **self._at(),
                                         content_index=0, part=self._text_part("", [])))
            self.text += delta["content"]
            self.logprobs += self.pending
            events.append(self.event("response.output_text.delta", **self._at(),
                                     content_index=0, delta=delta["content"],
                                     logprobs=[_stream_logprob(lp) for lp in self.pending]))
            self.pending = []
        for call in delta.get("tool_calls") or []:
            if call.get("id"):  # a new call
                events += self.close()
                self.item = call_item(_item_id("fc"), {**call, "function": {
                    "name": call["function"]["name"], "arguments": ""}}, "in_progress")
                events.append(self.event("response.output_item.added",
                                         output_index=len(self.output), item=dict(self.item)))
            arguments = call.get("function", {}).get("arguments")
            if arguments and self.item is not None and self.item["type"] == "function_call":
                self.item["arguments"] += arguments
                events.append(self.event("response.function_call_arguments.delta",
                                         **self._at(), delta=arguments))
        return events

    def _text_part(self, text: str, logprobs: list | None) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def close(self) -> list[dict]:
        """The events that end the item being streamed, if any."""
        item, events = self.item, []
        if item is None:
            return events
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], self.text, "completed")
            events.append(self.event("response.reasoning_text.done", **self._at(),
                                     content_index=0, text=self.text))
            events.append(self.event("response.content_part.done", **self._at(),
                                     content_index=0, part=done["content"][0]))
            self.text = ""
        elif item["type"] == "message":
            logprobs = self.logprobs if self.with_logprobs else None
            events.append(self.event("response.output_text.done", **self._at(),
                                     content_index=0, text=self.text,
                                     logprobs=[_stream_logprob(lp) for lp in self.logprobs]))
            done = message_item(item["id"], self.text, logprobs, "completed")
            events.append(self.event("response.content_part.done", **self._at(),
                                     content_index=0, part=done["content"][0]))
            self.text, self.logprobs = "", []
        else:
            events.append(self.event("response.function_call_arguments.done", **self._at(),
                                     name=item["name"], arguments=item["arguments"]))
            done = {**item, "status": "completed"}
        events.append(self.event("response.output_item.done", output_index=len(self.output),
                                 item=done))
        self.output.append(done)
        self.item = None
        return events


def _stream_logprob(entry: dict) -> dict:
    """A chat logprob entry as a streamed text delta carries it (no bytes)."""
    return {"token": entry["token"], "logprob": entry["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]}
                             for t in entry.get("top_logprobs", [])]}


class OpenAIServingResponses(OpenAIServing):
    """Handles `POST /v1/responses` through a chat handler: its template, sampling,
    constraints and tool-call parser serve the request.

    NOTE: nothing is stored (`store` is accepted and ignored, vLLM's default), so
    `previous_response_id` and `background` are 400s.

    Args:
        llm, served_model_names, limits, lanes, models: As `OpenAIServingBase`'s.
        chat: The server's chat handler (None: a new one over the same engine).
    """

    request_model = ResponsesRequest
    id_prefix = "resp"
    field_renames = {"logprobs": "top_logprobs"}  # the engine's max_logprobs refusal

    def __init__(self, llm, served_model_names: list[str], limits=None, lanes=None,
                 models=None, chat: OpenAIServingChat | None = None):
        super().__init__(llm, served_model_names, limits, lanes, models)
        self.chat = chat or OpenAIServingChat(llm, served_model_names, self.limits,
                                              self.lanes, self.serving_models)

    def prepare(self, req: ResponsesRequest) -> Prepared:
        """The chat request's preparation, with its errors under the Responses names."""
        try:
            req.check_supported()
            body = req.chat_body()
        except ValueError as e:
            part = re.match(r"input\[\d+\]\.content\[\d+\]", str(e))
            raise OpenAIError(400, str(e), part[0]) if part else \
                from_value_error(e, _FIELDS) from None
        # NOTE: the body holds fields already validated by their Responses types.
        chat_req = ChatCompletionRequest.model_validate(body)
        try:
            prep = self.chat.prepare(chat_req)
        except OpenAIError as e:
            raise _renamed(_input_part(e, req.messages_and_items()[1])) from None
        prep.extra.update(chat=chat_req, created_at=now())
        return prep

    def response(self, req: ResponsesRequest, prep: Prepared, request_id: str,
                 output: list[dict], status: str, usage: dict | None) -> dict:
        """The response object, with the request fields vLLM echoes."""
        params = prep.params
        # An image prompt's ids are the engine's: its usage counts them.
        known = prep.prompts[0].get("prompt_token_ids")
        prompt_len = len(known) if known is not None else (usage or {}).get("input_tokens", 0)
        max_tokens = params.max_tokens if params.max_tokens is not None else \
            self.max_model_len - prompt_len
        choice = req.tool_choice
        return {
            # NOTE: OpenAI's ids are `resp_<hex>`; the engine's request id is `resp-<hex>`.
            "id": "resp_" + request_id.split("-", 1)[1], "created_at": prep.extra["created_at"],
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": req.instructions, "metadata": req.metadata,
            "model": self.serving_models.response_name(prep.lora_request),
            "object": "response", "output": output,
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": params.temperature,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in req.tools], "top_p": params.top_p,
            "background": req.background, "max_output_tokens": max_tokens,
            "max_tool_calls": req.max_tool_calls, "previous_response_id": None,
            "prompt": None, "reasoning": req.reasoning, "service_tier": req.service_tier,
            "status": status, "text": req.text.model_dump() if req.text is not None else None,
            "top_logprobs": params.logprobs, "truncation": req.truncation, "usage": usage,
            "user": req.user, "input_messages": None, "output_messages": None}

    def full_response(self, req, prep, request_id, finals) -> dict:
        chat = self.chat.full_response(prep.extra["chat"], prep, request_id, finals)
        (choice,) = chat["choices"]
        logprobs = choice["logprobs"]["content"] if choice["logprobs"] is not None else None
        return self.response(req, prep, request_id, output_items(choice["message"], logprobs),
                             _status(choice["finish_reason"]), response_usage(finals[0]))

    async def stream_events(self, req, prep, request_id, streams) -> AsyncIterator[dict]:
        recorded = _Recorded(streams[0])
        events = ResponseEvents(prep.params.logprobs is not None)
        started = self.response(req, prep, request_id, [], "in_progress", None)
        yield events.event("response.created", response=started)
        yield events.event("response.in_progress", response=started)
        finish_reason = None
        async for chunk in self.chat.stream_events(prep.extra["chat"], prep, request_id,
                                                   [recorded]):
            for choice in chunk["choices"]:
                logprobs = choice["logprobs"]["content"] if choice.get("logprobs") else None
                for event in events.delta(choice["delta"], logprobs):
                    yield event
                finish_reason = choice.get("finish_reason") or finish_reason
        for event in events.close():
            yield event
        yield events.event("response.completed", response=self.response(
            req, prep, request_id, events.output, _status(finish_reason),
            response_usage(recorded.last)))

    async def _sse(self, events: AsyncIterator[dict]) -> AsyncIterator[str]:
        """Named server-sent events (`event: <type>`), as vLLM sends them; a failure is an
        `error` event, and no `[DONE]` follows."""
        number = 0
        try:
            async for event in events:
                number = event["sequence_number"] + 1
                yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
        except Exception as e:  # noqa: BLE001 - reported in-band: the headers are sent
            status = e.status if isinstance(e, OpenAIError) else \
                503 if isinstance(e, EngineDeadError) else 500
            info = e.body()["error"] if isinstance(e, OpenAIError) else \
                error_body(status, str(e))["error"]
            event = {"type": "error", "code": str(status), "message": info["message"],
                     "param": info["param"], "sequence_number": number}
            yield f"event: error\ndata: {json.dumps(event)}\n\n"


def _status(finish_reason: str | None) -> str:
    """The response status of a reply that ended with `finish_reason`."""
    return "incomplete" if finish_reason == "length" else "completed"
