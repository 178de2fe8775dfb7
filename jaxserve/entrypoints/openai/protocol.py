"""Pydantic models of the OpenAI-compatible request bodies (with vLLM's extra sampling fields)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxserve.entrypoints.openai.structured import request_constraint, tool_call_schema
from jaxserve.sampling_params import ParameterError, SamplingParams

# The request seed's range: any signed 64-bit seed, as vLLM's `Field(ge=, le=)` of torch.long
# (issue 48); outside it a 400 carrying pydantic's `greater_than_equal`/`less_than_equal`.
SEED_LOW, SEED_LIMIT = -(2**63), 2**63 - 1
# vLLM's structured-output fields (besides OpenAI's `response_format`).
STRUCTURED_OUTPUT_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                            "structured_outputs")
# vLLM's sampling extras not built yet, with the value that leaves the output unchanged:
# any other value is refused (a 400 naming the field), never silently ignored.
UNSUPPORTED_EXTRAS = {"truncate_prompt_tokens": None, "logits_processors": None}
# Fields that may be named as `param` of an error raised below.
REQUEST_FIELDS = frozenset({"stream_options", "response_format", "tools", "tool_choice",
                            "functions", "function_call", *STRUCTURED_OUTPUT_FIELDS,
                            *UNSUPPORTED_EXTRAS, "use_beam_search", "length_penalty"})


class OpenAIBaseModel(BaseModel):
    """Base of every request body: unknown fields are ignored, as vLLM does.

    NOTE: pydantic's lax mode, as vLLM's models (FastAPI validates them the same way):
    scalars are coerced where pydantic can (`"logprobs": "true"` is true, `"5"` and `5.0`
    are 5, `"yes"`/`"on"`/`1` are true); a value that does not parse as its type (`"maybe"`
    for a bool, `1.5` or `"ten"` for an integer, a number for a string, a string for a list
    or an object) is still a 400 naming the field.
    """

    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    """`stream_options`: a final usage chunk (`include_usage`, on by default as in vLLM)."""

    include_usage: bool = True
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
    seed: int | None = Field(None, ge=SEED_LOW, le=SEED_LIMIT)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
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
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    truncate_prompt_tokens: Any = None
    logits_processors: Any = None
    # vLLM's token-id extensions (RL rollouts): the prompt's and the output's ids in the
    # response; logprob tokens as `token_id:N` (None: the server's
    # --return-tokens-as-token-ids).
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        tool_schema: dict | None = None) -> SamplingParams:
        """The engine's `SamplingParams` (raises ValueError naming a bad field).

        Args:
            max_tokens: The completion's token limit.
            logprobs: Top logprobs per token, or None.
            tool_schema: The JSON schema a forced tool call follows (chat), if any.
        """
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.prompt_logprobs is not None and self.prompt_logprobs < -1:
            raise ParameterError("`prompt_logprobs` must be a positive value or -1.",
                                 "prompt_logprobs", self.prompt_logprobs)  # vLLM's words
        constraint, field = request_constraint(self, tool_schema)
        if constraint is not None and self.use_beam_search:
            raise ValueError(f"{field}: structured output is not supported with "
                             "use_beam_search")
        if self.use_beam_search:
            self._check_beam_search()
        elif self.length_penalty != 1.0:
            raise ValueError("length_penalty applies to beam search only (use_beam_search)")
        for name, neutral in UNSUPPORTED_EXTRAS.items():
            value = getattr(self, name)
            if value != neutral and not (neutral is None and value in ([], "")):
                raise ValueError(f"{name} is not supported yet (got {value!r}; it would "
                                 "change the output, so it is not ignored)")
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
            logit_bias=self.logit_bias or None, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None, structured_outputs=constraint,
            **{k: v for k, v in given.items() if v is not None})

    def _check_beam_search(self) -> None:
        """What beam search over HTTP supports: n beams (1..10), greedy candidates."""
        if self.stream:
            raise ValueError("use_beam_search does not stream; send stream=false")
        if not 1 <= self.n <= SamplingParams.MAX_LOGPROBS // 2:
            raise ValueError(f"n is the beam width with use_beam_search: 1 to "
                             f"{SamplingParams.MAX_LOGPROBS // 2}, got {self.n}")
        if getattr(self, "logprobs", None) or self.prompt_logprobs is not None:
            raise ValueError("logprobs are not returned with use_beam_search")
        # NOTE: beams extend by their top candidates; a field that would change that is
        # refused by name rather than ignored.
        changed = [name for name, neutral in (
            ("logit_bias", None), ("allowed_token_ids", None), ("bad_words", None),
            ("stop", None), ("stop_token_ids", None), ("min_tokens", 0),
            ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", None),
            ("top_k", None), ("top_p", None), ("min_p", None))
            if getattr(self, name) not in (neutral, [], {})]
        if self.temperature not in (None, 0, 0.0):
            changed.insert(0, "temperature")
        if changed:
            raise ValueError(f"{changed[0]} is not supported with use_beam_search (beams "
                             f"extend greedily by their top candidates)")
        if not isinstance(self.length_penalty, (int, float)) or self.length_penalty != \
                self.length_penalty:
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")

    def beam_search_params(self, max_tokens: int):
        """The `BeamSearchParams` of a `use_beam_search` request."""
        from jaxserve.engine.beam_search import BeamSearchParams

        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens,
                                ignore_eos=self.ignore_eos,
                                length_penalty=float(self.length_penalty))


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
        # NOTE: echo with max_tokens=0 scores the prompt only (how evaluation harnesses ask
        # for log-likelihoods): one token is generated and dropped, as vLLM does.
        if self.logprobs is not None and self.logprobs < 0:  # vLLM's rule and words: no -1
            raise ParameterError("`logprobs` must be a positive value.", "logprobs",
                                 self.logprobs)
        params = self.sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None and params.prompt_logprobs != -1:
            params = params.clone(prompt_logprobs=max(params.prompt_logprobs or 0,
                                                      self.logprobs))
        return params

    @property
    def echo_only(self) -> bool:
        """echo=True with max_tokens=0: the response is the prompt, nothing generated."""
        return self.echo and self.max_tokens == 0


class ContentPart(OpenAIBaseModel):
    """One part of a message's content: `text`, or `image_url` (`{"url": ...}`, or the URL
    alone as vLLM takes it); other types are refused."""

    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None


class ChatMessage(OpenAIBaseModel):
    """One chat message; extra keys (e.g. tool call fields) reach the chat template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        """The message as the chat template expects it: text parts joined, or, when it
        holds `image_url` parts, its parts as JSON (for `jaxserve.multimodal.chat`)."""
        content = self.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type not in ("text", "image_url")]
            if bad:
                raise ValueError(f"messages: only text and image_url content parts are "
                                 f"supported, got {bad}")
            if any(p.type == "image_url" for p in content):
                content = [p.model_dump(exclude_none=True) for p in content]
            else:
                content = "".join(p.text or "" for p in content)
        message = {**(self.model_extra or {}), "role": self.role, "content": content or ""}
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            # NOTE: clients send a call's arguments back as JSON text; templates expect
            # the object (they apply `tojson` themselves), as vLLM passes them.
            message["tool_calls"] = [_parsed_arguments(c) for c in calls]
        if self.name is not None:
            message["name"] = self.name
        return message


def _parsed_arguments(call):
    """A tool call with `function.arguments` parsed from JSON text (kept if not JSON)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


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
    tool_choice: str | dict[str, Any] | None = None
    include_reasoning: bool = True
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def to_sampling_params(self) -> SamplingParams:
        """The engine's `SamplingParams`; `max_completion_tokens` wins over `max_tokens`."""
        if self.top_logprobs is not None and self.top_logprobs < -1:
            raise ParameterError("`top_logprobs` must be a positive value or -1.",
                                 "top_logprobs", self.top_logprobs)  # vLLM's words
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        self._check_tools()
        limit = self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(limit, logprobs,
                                    tool_call_schema(self.tools or [], self.tool_choice))

    def _check_tools(self) -> None:
        """`tools` are function objects; `tool_choice` is none, auto, required or a named
        function among them."""
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is deprecated by OpenAI and not supported; use tools "
                                 "and tool_choice")
        choice = self.tool_choice
        for tool in self.tools or []:
            function = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str) or not function["name"]:
                raise ValueError(f"tools: each tool needs type 'function' and a 'function' "
                                 f"object with a name, got {tool!r}")
            if not isinstance(function.get("parameters", {}), dict):
                raise ValueError(f"tools: the parameters of {function['name']!r} must be a "
                                 "JSON schema object")
        if isinstance(choice, dict):
            function = choice.get("function")
            if not isinstance(function, dict):
                raise ValueError(f"tool_choice: a named choice needs a 'function' object, got "
                                 f"{choice!r}")
            name = function.get("name")
            known = {t["function"].get("name") for t in self.tools or []}
            if name not in known:
                raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        elif choice not in (None, "none", "auto", "required"):
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a named "
                             f"function, got {choice!r}")
        if choice == "required" and not self.tools:
            raise ValueError("tool_choice 'required' needs tools")


class TokenizeRequest(OpenAIBaseModel):
    """Body of `POST /tokenize`: a prompt, or chat messages rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
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


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """Body of `POST /v1/load_lora_adapter` (vLLM's)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """Body of `POST /v1/unload_lora_adapter` (vLLM's: the name, or the id)."""

    lora_name: str | None = None
    lora_int_id: int | None = None
