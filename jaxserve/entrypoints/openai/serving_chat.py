"""`POST /v1/chat/completions`: messages through the chat template, replies whole or streamed."""

from __future__ import annotations

from collections.abc import AsyncIterator

from jaxserve.entrypoints.chat_template import ChatTemplateError, render_chat
from jaxserve.entrypoints.openai.chat_images import image_prompt
from jaxserve.entrypoints.openai.harmony_chat import HarmonyReplyStream, split_reply
from jaxserve.entrypoints.openai.protocol import REQUEST_FIELDS, ChatCompletionRequest, ChatMessage
from jaxserve.entrypoints.openai.reasoning import (
    ReasoningParser,
    get_reasoning_parser,
    thinking_disabled,
)
from jaxserve.entrypoints.openai.serving_base import SAMPLING_FIELDS, Prepared
from jaxserve.entrypoints.openai.serving_completion import json_logprob, prompt_logprobs_json
from jaxserve.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    chunk_usage,
    deltas,
    final_usage,
    from_value_error,
    now,
    routed_experts_json,
    token_label,
    usage,
)
from jaxserve.entrypoints.openai.tool_calls import ToolCallStream, reply_message, tool_mode
from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser
from jaxserve.multimodal.chat import HTTP_IMAGE_PARTS, has_image_parts
from jaxserve.outputs import CompletionOutput

_FIELDS = SAMPLING_FIELDS | REQUEST_FIELDS | {"logit_bias", "top_logprobs", "messages",
                                                "max_completion_tokens"}


def _entry(token: str, logprob: float, text: str | None = None) -> dict:
    """A chat logprob: `bytes` are those of `text` (the token's own text) when given, else
    of `token`, as vLLM's (whose sampled tokens carry their text's bytes even as
    `token_id:N`, and whose alternatives the bytes of what they show)."""
    return {"token": token, "logprob": json_logprob(logprob),
            "bytes": list((token if text is None else text).encode("utf-8"))}


def chat_logprobs(comp: CompletionOutput, start: int, top: int, tokenizer,
                  as_ids: bool = False) -> dict:
    """OpenAI's chat logprobs object (`{"content": [...]}`) for tokens `start:`, with the
    `top` best alternatives (-1: every one returned; `as_ids`: tokens as `token_id:N`,
    vLLM's `return_tokens_as_token_ids`)."""
    top = float("inf") if top == -1 else top
    content = []
    decode = lambda tid, lp: lp.decoded_token if lp.decoded_token is not None \
        else tokenizer.decode([tid])
    for tid, entry in zip(comp.token_ids[start:], (comp.logprobs or [])[start:], strict=False):
        lp = entry.get(tid)
        if lp is not None:
            text = decode(tid, lp)
            item = _entry(token_label(tid, text, as_ids), lp.logprob, text)
        else:
            item = _entry(token_label(tid, tokenizer.decode([tid]), as_ids), float("nan"))
        ranked = sorted(((v.rank or 0, k, v) for k, v in entry.items() if v.rank is not None
                         and v.rank <= top), key=lambda r: r[0])
        item["top_logprobs"] = [_entry(token_label(k, "", True) if as_ids else decode(k, v),
                                       v.logprob) for _, k, v in ranked]
        content.append(item)
    return {"content": content}


def render_messages(tokenizer, messages: list[ChatMessage], *, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None
                    ) -> list[int]:
    """Token ids of `messages` through the chat template (bounded in time and size).

    Raises:
        OpenAIError: 400 naming `messages` (image parts too: they need `image_prompt`),
            `chat_template` or `chat_template_kwargs`.
    """
    plain = template_messages(messages)
    if has_image_parts(plain, HTTP_IMAGE_PARTS):
        raise OpenAIError(400, "messages: image_url parts are not supported by this endpoint",
                          "messages")
    try:
        ids = render_chat(tokenizer, plain, chat_template=chat_template,
                          add_generation_prompt=add_generation_prompt,
                          continue_final_message=continue_final_message, tools=tools,
                          template_kwargs=template_kwargs)
    except ChatTemplateError as e:
        raise OpenAIError(400, str(e), e.param) from None
    if not ids:
        raise OpenAIError(400, "the chat template rendered an empty prompt",
                          "chat_template" if chat_template is not None else "messages")
    return ids


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the chat template takes them (`ChatMessage.as_template_message`).

    Raises:
        OpenAIError: 400 naming `messages` for a content part type that is not served.
    """
    try:
        return [m.as_template_message() for m in messages]
    except ValueError as e:
        raise OpenAIError(400, str(e), "messages") from None


def _text_of(content) -> str:
    """A template message's content as text (its text parts joined)."""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if p.get("type") == "text")
    return content or ""


class OpenAIServingChat(OpenAIServing):
    """Handles chat completion requests."""

    request_model = ChatCompletionRequest
    id_prefix = "chatcmpl"

    def prepare(self, req: ChatCompletionRequest) -> Prepared:
        """Sampling parameters and the rendered conversation, checked against max_model_len."""
        limit_name = "max_completion_tokens" if req.max_completion_tokens is not None \
            else "max_tokens"
        try:
            params = req.to_sampling_params()
            if req.continue_final_message and req.add_generation_prompt:
                raise ValueError("messages: continue_final_message needs "
                                 "add_generation_prompt=false")
        except ValueError as e:
            raise from_value_error(e, _FIELDS, {"max_tokens": limit_name}) from None
        self.check_constraint(req, params)
        if self.tool_mode(req) == "auto" and \
                get_tool_parser(self.limits.tool_call_parser).keep_special_tokens \
                or self.harmony(req, params) is not None:
            # the call marker (harmony's markers) is a special token the text must keep
            params = params.clone(skip_special_tokens=False)
        chars = sum(len(m.as_template_message()["content"] or "") for m in req.messages
                    if isinstance(m.content, str))
        per_token = self.limits.max_chars_per_token
        if per_token and chars > 2 * per_token * self.max_model_len:
            raise OpenAIError(400, f"This model's maximum context length is "
                                   f"{self.max_model_len} tokens. However, your messages "
                                   f"have {chars} characters, more than that many tokens "
                                   "can hold.", "messages")
        render = dict(chat_template=req.chat_template,
                      add_generation_prompt=req.add_generation_prompt,
                      continue_final_message=req.continue_final_message, tools=req.tools,
                      template_kwargs=req.chat_template_kwargs)
        plain = template_messages(req.messages)
        if has_image_parts(plain, HTTP_IMAGE_PARTS):
            if req.use_beam_search:
                raise OpenAIError(400, "use_beam_search is not supported with images",
                                  "use_beam_search")
            prompt = image_prompt(self.tokenizer, plain, self.limits.multimodal, **render)
            # NOTE: the text's own tokens; the engine adds each image's placeholders and
            # checks the whole prompt against max_model_len again.
            num_tokens = len(self.encode(prompt["prompt"], "messages", check=False))
        else:
            prompt = {"prompt_token_ids": render_messages(self.tokenizer, req.messages,
                                                          **render)}
            num_tokens = len(prompt["prompt_token_ids"])
        self.check_length(num_tokens, params, "messages", limit_name)
        last = req.messages[-1]
        echo = _text_of(plain[-1]["content"]) if req.echo and last.role == "assistant" else ""
        return Prepared(params, [prompt], {"echo": echo})

    def tool_mode(self, req) -> str | None:
        """How the reply is read for tool calls (`tool_calls.tool_mode`; "auto" only with
        a tool-call parser)."""
        mode = tool_mode(req.tools, req.tool_choice)
        return None if mode == "auto" and not self.limits.tool_call_parser else mode

    def reasoning_parser(self, req, prep: Prepared) -> ReasoningParser | None:
        """The `--reasoning-parser` for this request's replies: None without one, when
        `chat_template_kwargs` turned thinking off, or when the output is constrained from
        its first token (a schema, a forced call: no think block can come first)."""
        name = self.limits.reasoning_parser
        if name is None or thinking_disabled(req.chat_template_kwargs) \
                or prep.params.structured_outputs is not None:
            return None
        return get_reasoning_parser(name)

    def harmony(self, req, params) -> tuple[bool, bool] | None:
        """(split reasoning, read calls) when this request's reply is read as harmony
        (gpt-oss: `--reasoning-parser openai_gptoss` or `--tool-call-parser openai`); None
        otherwise, and when the output is constrained from its first token (a schema or a
        forced call: the reply is that JSON, not harmony)."""
        if params.structured_outputs is not None:
            return None
        name = self.limits.reasoning_parser
        reasoning = name is not None and get_reasoning_parser(name).harmony \
            and not thinking_disabled(req.chat_template_kwargs)
        tools = self.limits.tool_call_parser is not None \
            and get_tool_parser(self.limits.tool_call_parser).harmony
        if not (reasoning or tools):
            return None
        return reasoning, tools and self.tool_mode(req) == "auto"

    def shows_token_ids(self, req, prep: Prepared) -> bool:
        """`return_token_ids`, unless reasoning is split off and left out
        (`include_reasoning: false`): its ids would show it, so vLLM sends none."""
        return bool(req.return_token_ids) and (
            req.include_reasoning or self.reasoning_parser(req, prep) is None)

    def full_response(self, req, prep, request_id, finals) -> dict:
        params, final = prep.params, finals[0]
        mode = self.tool_mode(req)
        splitter = self.reasoning_parser(req, prep)
        harmony = self.harmony(req, params)
        as_ids, show_ids = self.tokens_as_ids(req), self.shows_token_ids(req, prep)
        choices = []
        for comp in final.outputs:
            if harmony is not None:  # gpt-oss: reasoning, content and calls from one parse
                message, finish_reason = harmony_message(comp.text, comp.finish_reason,
                                                         *harmony, req.include_reasoning)
            else:
                message, finish_reason = self._message(req, prep, comp, mode, splitter)
            choices.append({
                "index": comp.index, "message": message,
                "logprobs": chat_logprobs(comp, 0, params.logprobs, self.tokenizer, as_ids)
                if params.logprobs is not None else None,
                "finish_reason": finish_reason, "stop_reason": comp.stop_reason,
                "token_ids": list(comp.token_ids) if show_ids else None,
                "routed_experts": routed_experts_json(comp)})
        return {"id": request_id, "object": "chat.completion", "created": now(),
                "model": self.serving_models.response_name(prep.lora_request),
                "choices": choices, "service_tier": None, "system_fingerprint": None,
                "usage": usage([final], details=self.limits.enable_prompt_tokens_details),
                "prompt_logprobs": prompt_logprobs_json(final)
                if req.prompt_logprobs is not None else None,
                "prompt_token_ids": list(final.prompt_token_ids) if req.return_token_ids
                else None, "kv_transfer_params": None}

    def _message(self, req, prep, comp, mode, splitter) -> tuple[dict, str | None]:
        """A completion's assistant message and finish_reason: reasoning split off, then
        tool calls read by `mode`."""
        reasoning, text = splitter.split(comp.text) if splitter else (None, comp.text)
        # NOTE: a forced call's arguments are the generated text alone (no echo).
        if mode not in ("named", "required") and prep.extra["echo"]:
            text = prep.extra["echo"] + (text or "")
        return reply_message(mode, text, req.tool_choice, comp.finish_reason,
                             parser=self.limits.tool_call_parser, tools=req.tools,
                             reasoning=reasoning if req.include_reasoning else None)

    async def stream_events(self, req, prep, request_id, streams) -> AsyncIterator[dict]:
        params = prep.params
        head = {"id": request_id, "object": "chat.completion.chunk", "created": now(),
                "model": self.serving_models.response_name(prep.lora_request)}
        # NOTE: vLLM's chunks hold the keys it set (`exclude_unset`): the first one
        # `prompt_token_ids` (the ids with `return_token_ids`), every delta its deprecated
        # `reasoning_content`.
        # An image prompt's ids are the engine's (its markers expanded): none here.
        known = prep.prompts[0].get("prompt_token_ids")
        prompt_ids = list(known) if req.return_token_ids and known is not None else None
        for c in range(params.n):
            yield {**head, "choices": [{
                "index": c, "delta": {"role": "assistant", "content": prep.extra["echo"],
                                      "reasoning_content": None},
                "logprobs": None, "finish_reason": None}], "prompt_token_ids": prompt_ids,
                **chunk_usage(req, prep, [None], chat=True)}
        finals = [None]
        mode, splitter = self.tool_mode(req), self.reasoning_parser(req, prep)
        harmony = self.harmony(req, params)
        replies = [HarmonyReplyStream(*harmony, req.include_reasoning) if harmony is not None
                   else ReplyStream(ToolCallStream(mode, req.tool_choice,
                                                   self.limits.tool_call_parser, req.tools),
                                    splitter.stream() if splitter else None,
                                    req.include_reasoning)
                   for _ in range(params.n)]
        as_ids, show_ids = self.tokens_as_ids(req), self.shows_token_ids(req, prep)
        async for d in deltas(streams, params, finals):
            logprobs = chat_logprobs(d.comp, d.token_start, params.logprobs, self.tokenizer,
                                     as_ids) if params.logprobs is not None else None
            delta, finish_reason = replies[d.comp.index].feed(d.text, d.comp.finish_reason)
            choice = {"index": d.comp.index, "delta": delta,
                      "logprobs": logprobs, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = d.comp.stop_reason
                if d.comp.routed_experts is not None:
                    choice["routed_experts"] = routed_experts_json(d.comp)
            choice["token_ids"] = list(d.comp.token_ids[d.token_start:]) if show_ids else None
            yield {**head, "choices": [choice], **chunk_usage(req, prep, finals, chat=True)}
        if req.stream_options is not None and req.stream_options.include_usage:
            yield {**head, "choices": [], "usage": final_usage(
                finals, details=self.limits.enable_prompt_tokens_details)}


def harmony_message(text: str, finish_reason: str | None, reasoning: bool, calls: bool,
                    include_reasoning: bool = True) -> tuple[dict, str | None]:
    """(assistant message, finish_reason) of a whole harmony reply (`harmony_chat`), with
    `reply_message`'s keys; "tool_calls" for a reply that stopped after calls."""
    thought, content, found = split_reply(text, reasoning and include_reasoning, calls)
    message, finish_reason = reply_message(None, content, None, finish_reason,
                                           reasoning=thought)
    if found:
        message["tool_calls"] = found
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
    return message, finish_reason


class ReplyStream:
    """One choice's streamed reply: reasoning split off first (deltas with `reasoning` and
    vLLM's older `reasoning_content`), the rest read for tool calls.

    Args:
        tools: The choice's tool-call stream.
        reasoning: The reasoning split's stream (None: no split).
        include_reasoning: Send the reasoning (vLLM's `include_reasoning`; false drops it).
    """

    def __init__(self, tools: ToolCallStream, reasoning=None, include_reasoning: bool = True):
        self.tools, self.reasoning, self.include = tools, reasoning, include_reasoning

    def feed(self, delta: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta object for new text `delta` (every one carries `reasoning_content`, as
        vLLM's), and the finish_reason to report."""
        if self.reasoning is None:
            out, finish_reason = self.tools.feed(delta, finish_reason)
            return {**out, "reasoning_content": None}, finish_reason
        pieces = self.reasoning.feed(delta)
        if finish_reason is not None:
            pieces += self.reasoning.flush()
        thought = "".join(t for kind, t in pieces if kind == "reasoning")
        content = "".join(t for kind, t in pieces if kind == "content")
        out, finish_reason = self.tools.feed(content, finish_reason)
        if thought and self.include:
            return {"reasoning": thought, **out, "reasoning_content": thought}, finish_reason
        return {**out, "reasoning_content": None}, finish_reason
