"""Pydantic models of the OpenAI-compatible request bodies (with vLLM's extra sampling fields)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.sampling_params import SamplingParams


class OpenAIBaseModel(BaseModel):
    """Base of every request body: unknown fields are ignored, as vLLM does.

    NOTE: strict types: a string or a bool is never coerced into a number (`max_tokens:
    true` or `"16"` is a 400), nor a string into a bool (`stream: "yes"`); integers are
    accepted where a float is expected.
    """

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(OpenAIBaseModel):
    """`stream_options`: a final usage chunk (`include_usage`)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIBaseModel):
    """Fields shared by completions and chat, OpenAI's and vLLM's extras.

    Ranges are checked by `SamplingParams`, whose errors name the field.
    """

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None
    priority: int = 0
    cache_salt: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's `SamplingParams` (raises ValueError naming a bad field)."""
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
        }
        return SamplingParams(
            n=self.n, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            **{k: v for k, v in given.items() if v is not None})


class CompletionRequest(SamplingFields):
    """Body of `POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_sampling_params(self) -> SamplingParams:
        """The engine's `SamplingParams` (ValueError naming a bad or unsupported field)."""
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n (best_of > n is not supported), got "
                             f"{self.best_of}")
        return self.sampling_params(self.max_tokens, self.logprobs)


class ContentPart(OpenAIBaseModel):
    """One part of a message's content (only `text` parts are supported)."""

    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    """One chat message; extra keys (e.g. tool call fields) reach the chat template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        """The message as the chat template expects it (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type != "text"]
            if bad:
                raise ValueError(f"messages: only text content parts are supported, got {bad}")
            content = "".join(p.text or "" for p in content)
        message = {**(self.model_extra or {}), "role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingFields):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None

    def to_sampling_params(self) -> SamplingParams:
        """The engine's `SamplingParams`; `max_completion_tokens` wins over `max_tokens`."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(limit, logprobs)


class TokenizeRequest(OpenAIBaseModel):
    """Body of `POST /tokenize`: a prompt, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    """Body of `POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


class BatchRequestInput(OpenAIBaseModel):
    """One line of an OpenAI batch input file."""

    custom_id: str
    method: Literal["POST"]
    url: str
    body: dict[str, Any]
