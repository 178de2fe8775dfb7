"""Pydantic models of `POST /v1/responses` bodies (OpenAI's Responses API with vLLM's extras),
and their translation into the chat request that serves them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from jaxserve.entrypoints.openai.protocol import SEED_LIMIT, SEED_LOW, OpenAIBaseModel

# The `include` entry that asks for the output text's logprobs.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# Chat request fields whose errors are reported under the Responses field that set them.
CHAT_FIELD_NAMES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                    "max_tokens": "max_output_tokens", "response_format": "text",
                    "logprobs": "top_logprobs"}


def _type_of(default: str | None):
    """A discriminator reading an item's `type` (`default` when the key is absent)."""
    def read(value):
        if isinstance(value, dict):
            return value.get("type", default)
        return getattr(value, "type", default)
    return read


class InputText(OpenAIBaseModel):
    """An `input_text` content part."""

    type: Literal["input_text"]
    text: str


class OutputText(OpenAIBaseModel):
    """An `output_text` content part (an earlier response's message sent back)."""

    type: Literal["output_text"]
    text: str


class InputImage(OpenAIBaseModel):
    """An `input_image` content part: its `image_url` (a data, file or http(s) URL)."""

    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


ContentPart = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[OutputText, Tag("output_text")]
    | Annotated[InputImage, Tag("input_image")],
    Discriminator(_type_of(None), custom_error_type="content_part_type",
                  custom_error_message="only input_text, output_text and input_image content "
                                       "parts are supported (files and audio are not)")]


def _joined(content: str | list[InputText | OutputText]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _chat_content(content, index: int):
    """A message item's content for chat: text joined, or with images chat's parts."""
    if isinstance(content, str) or not any(isinstance(p, InputImage) for p in content):
        return _joined(content)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, InputImage):
            parts.append({"type": "text", "text": part.text})
        elif not part.image_url:
            raise ValueError(f"input[{index}].content[{j}]: an input_image part needs image_url "
                             "(file_id is not supported)")
        else:
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
    return parts


class MessageItem(OpenAIBaseModel):
    """A message: `{"role", "content"}` (with or without `"type": "message"`)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(OpenAIBaseModel):
    """A `function_call` the model made in an earlier response, sent back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(OpenAIBaseModel):
    """The result of a function call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningText(OpenAIBaseModel):
    """A reasoning item's text part."""

    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(OpenAIBaseModel):
    """The reasoning of an earlier response, sent back: it reaches the chat template as the
    next assistant message's `reasoning_content` (gpt-oss's template renders it before a
    tool call); `summary` and `encrypted_content` are ignored."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        return "".join(p.text for p in self.content or [])


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_type_of("message"), custom_error_type="input_item_type",
                  custom_error_message="input items are messages, function_call, "
                                       "function_call_output or reasoning items (other types "
                                       "are not supported)")]


class FunctionTool(OpenAIBaseModel):
    """A function tool in the Responses form (`name` and `parameters` at the top level)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")],
    Discriminator(_type_of(None), custom_error_type="tool_type",
                  custom_error_message="only function tools (type 'function') are supported")]


class ToolChoiceFunction(OpenAIBaseModel):
    """`tool_choice` naming one function: `{"type": "function", "name": ...}`."""

    type: Literal["function"]
    name: str


class TextConfig(OpenAIBaseModel):
    """`text`: the output's format (`{"type": "text" | "json_object" | "json_schema"}`)."""

    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(OpenAIBaseModel):
    """Body of `POST /v1/responses` (OpenAI's fields, then vLLM's extras)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = 0
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    truncation: Literal["auto", "disabled"] | None = "disabled"
    user: str | None = None
    prompt_cache_key: str | None = None  # ignored, as vLLM
    # vLLM's extras
    top_k: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=SEED_LOW, le=SEED_LIMIT)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    structured_outputs: Any = None
    priority: int = 0
    cache_salt: str | None = None

    def check_supported(self) -> None:
        """Refuses what this server does not do, naming the field (ValueError).

        NOTE: `store` is accepted and nothing is stored, as vLLM without
        `VLLM_ENABLE_RESPONSES_API_STORE`; so a `previous_response_id` can never be found.
        """
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported: this server does not "
                             "store responses (store is ignored, as vLLM's default); send the "
                             "earlier turns in input instead (messages, function_call and "
                             "function_call_output items)")
        if self.background:
            raise ValueError("background is not supported: it needs stored responses, and "
                             "this server does not store them")
        if self.prompt is not None:
            raise ValueError("prompt: prompt templates are not supported")
        if self.truncation == "auto":
            raise ValueError("truncation 'auto' is not supported yet (it would drop the start "
                             "of the conversation); use 'disabled'")

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request that serves this one (ValueError naming a field)."""
        body: dict[str, Any] = {
            "model": self.model, "messages": self.messages(), "stream": self.stream,
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed,
            "stop": self.stop, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": self.logit_bias, "structured_outputs": self.structured_outputs,
            "priority": self.priority, "cache_salt": self.cache_salt,
            "response_format": self.response_format(),
        }
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                k: v for k, v in t.model_dump(exclude={"type", "strict"}).items()
                if v is not None}} for t in self.tools]
            choice = self.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else {
                "type": "function", "function": {"name": choice.name}}
        elif isinstance(self.tool_choice, ToolChoiceFunction) or self.tool_choice == "required":
            raise ValueError("tool_choice: a required or named tool call needs tools")
        if self.include and INCLUDE_LOGPROBS in self.include:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        if self.reasoning and self.reasoning.get("effort") is not None:
            body["chat_template_kwargs"] = {"reasoning_effort": self.reasoning["effort"]}
        return {k: v for k, v in body.items() if v is not None}

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages: `instructions` as the system message, then
        `input` (developer messages as system ones, function calls as the assistant's
        `tool_calls`, their outputs as `tool` messages, reasoning as the next assistant
        message's `reasoning_content`; reasoning no assistant item follows is dropped)."""
        return self.messages_and_items()[0]

    def messages_and_items(self) -> tuple[list[dict[str, Any]], list[int | None]]:
        """`messages()`, and for each message the index of the `input` item it came from
        (None: `instructions`), to name an item in errors about a message."""
        messages: list[dict[str, Any]] = []
        items: list[int | None] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
            items.append(None)
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}], [*items, 0]
        reasoning = None  # a reasoning item's text, for the next assistant message
        for index, item in enumerate(self.input):
            if isinstance(item, ReasoningItem):
                reasoning = (reasoning or "") + item.text()
            elif isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": _chat_content(item.content, index)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and reasoning is None:
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None,
                                     "tool_calls": [call]})
            else:
                messages.append({"role": "tool", "content": _joined(item.output),
                                 "tool_call_id": item.call_id})
            items.extend([index] * (len(messages) - len(items)))
            if not isinstance(item, ReasoningItem):
                if reasoning is not None and messages[-1]["role"] == "assistant":
                    messages[-1]["reasoning_content"] = reasoning
                reasoning = None
        if not messages:
            raise ValueError("input must hold at least one item")
        return messages, items

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's `response_format`."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None:
            return None
        kind = fmt.get("type")
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise ValueError("text.format: a json_schema format needs schema, a JSON "
                                 "schema object")
            return {"type": "json_schema",
                    "json_schema": {"name": fmt.get("name") or "response",
                                    "schema": fmt["schema"]}}
        if kind in ("text", "json_object"):
            return {"type": kind}
        raise ValueError(f"text.format: type must be 'text', 'json_object' or 'json_schema', "
                         f"got {kind!r}")
