"""What every endpoint handler shares before a request reaches the engine: the served names
and limits, the prepared request, and the checks made before anything is queued."""

from __future__ import annotations

import dataclasses
import os
import re
import uuid
from typing import Any

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.admission import PrepareLanes
from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.entrypoints.openai.reasoning import get_reasoning_parser
from jaxserve.entrypoints.openai.serving_models import OpenAIServingModels
from jaxserve.entrypoints.openai.tool_parsers import get_tool_parser
from jaxserve.lora import LoRARequest
from jaxserve.multimodal.config import MultiModalConfig
from jaxserve.sampling_params import SamplingParams

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_QUANT_SUFFIX = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)


def default_model_name(source) -> str:
    """A served name from a model path: `.../SmolLM2-135M-Instruct.Q4_1.gguf` gives
    `SmolLM2-135M-Instruct`; a directory gives its own name; a hub id or URL that is no
    local path is served under itself (`Qwen/Qwen3-0.6B`, as vLLM)."""
    from models.loaders.model_source import is_hub_id, is_url

    source = str(source)
    if not os.path.exists(source) and (is_url(source) or is_hub_id(source)):
        return source
    name = os.path.basename(os.path.normpath(source))
    if name.lower().endswith(".gguf"):
        name = _QUANT_SUFFIX.sub("", name[:-5])
    return name or "jaxserve-model"


@dataclasses.dataclass(frozen=True)
class ServingLimits:
    """Per-request limits of the server (all give a 400 naming the field when exceeded).

    Attributes:
        max_prompts_per_request: Most prompts one completion request may carry.
        max_chars_per_token: Longest text one token covers; a prompt longer than
            `2 * max_chars_per_token * max_model_len` characters cannot fit and is refused
            before it is tokenized (None: the longest vocabulary entry; 0: always tokenize).
        tool_call_parser: How chat replies with `tool_choice="auto"` are read for tool
            calls: a name of `tool_parsers.TOOL_PARSERS` ("hermes", "llama3_json",
            "mistral", "pythonic", "qwen3_coder"), or None (never: the reply is content).
        reasoning_parser: How a chat reply's reasoning is split from its content: a name
            of `reasoning.REASONING_PARSERS` ("qwen3", "deepseek_r1"), or None (no split).
        max_tokenize_tokens: Most token ids `/tokenize` returns and `/detokenize` takes
            (None: 4 * max_model_len). Text longer than this many tokens can hold is refused
            before it is tokenized.
        max_stop_strings: Most `stop` strings one request may give: each is searched for
            on the host after every token (0.36 us per string and token; BENCHMARKS.md).
        enable_prompt_tokens_details: Report `usage.prompt_tokens_details` (the prompt's
            prefix-cache hits) when some tokens were cached, as vLLM's
            `--enable-prompt-tokens-details`; null otherwise.
        return_tokens_as_token_ids: Render logprob tokens as `token_id:N` unless a request
            says otherwise (its `return_tokens_as_token_ids`), as vLLM's
            `--return-tokens-as-token-ids`.
        multimodal: The images chat messages may carry (the engine's `MultiModalConfig`:
            `--limit-mm-per-prompt`, `--allowed-local-media-path`, the pixel, byte and
            fetch limits).
    """

    max_prompts_per_request: int = 256
    max_chars_per_token: int | None = None
    tool_call_parser: str | None = "hermes"
    reasoning_parser: str | None = None
    max_tokenize_tokens: int | None = None
    max_stop_strings: int = 64
    enable_prompt_tokens_details: bool = False
    return_tokens_as_token_ids: bool = False
    multimodal: MultiModalConfig = MultiModalConfig()

    def __post_init__(self):
        for name in ("max_prompts_per_request", "max_tokenize_tokens", "max_stop_strings"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)  # an unknown name: a ValueError
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)


@dataclasses.dataclass
class Prepared:
    """A validated request, ready for the engine.

    Attributes:
        params: The engine's sampling parameters.
        prompts: Per prompt `{"prompt": text or None, "prompt_token_ids": ids}`.
        extra: Endpoint-specific values (echo text, ...).
        lora_request: The LoRA adapter the request's `model` named (None: the base).
    """

    params: SamplingParams
    prompts: list[dict]
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    lora_request: LoRARequest | None = None


def random_id(prefix: str) -> str:
    """A unique id such as `cmpl-<32 hex digits>`."""
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIServingBase:
    """What every endpoint handler shares: the served names, the tokenizer, the limits and
    the checks made before anything is queued.

    Args:
        llm: The async engine.
        served_model_names: Names clients may ask for; the first is reported.
        limits: Per-request limits.
        lanes: Where requests are prepared (the server shares one between its handlers;
            None: lanes of this handler's own).
        models: The base names and LoRA adapters requests may name (the server shares
            one between its handlers; None: `served_model_names` without adapters).
    """

    def __init__(self, llm: AsyncLLM, served_model_names: list[str],
                 limits: ServingLimits | None = None, lanes: PrepareLanes | None = None,
                 models: OpenAIServingModels | None = None):
        self.llm = llm
        self.lanes = lanes or PrepareLanes()
        self.serving_models = models or OpenAIServingModels(served_model_names)
        self.served_model_names = list(self.serving_models.base_model_names)
        self.model_name = self.served_model_names[0]
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.limits = limits or ServingLimits()
        # The model's vocabulary size (None: unknown, the engine checks ids itself).
        self.vocab_size: int | None = llm.engine.vocab_size

    # ----------------------------------------------------------- helpers
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model, or no model given).

        Raises:
            OpenAIError: 404 for a model this server does not serve.
        """
        return self.serving_models.lora_request(model)

    def prompt_list(self, value, param: str = "prompt") -> list:
        """`value` (a text, token ids, or a list of either) as a list of prompts.

        Raises:
            OpenAIError: 400 for no prompt, or more than `max_prompts_per_request`.
        """
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            value = [value]
        if not value:
            raise OpenAIError(400, f"{param} must not be empty", param)
        limit = self.limits.max_prompts_per_request
        if len(value) > limit:
            raise OpenAIError(400, f"{param}: at most {limit} {param}s per request, got "
                                   f"{len(value)}", param)
        return value

    def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = True,
               check: bool = True) -> list[int]:
        """Token ids of `text`, as the engine would tokenize it.

        With `check`, text that cannot fit `max_model_len` whatever its tokens is refused
        before tokenizing (a multi-megabyte prompt costs seconds to tokenize).
        """
        per_token = self.limits.max_chars_per_token
        if check and per_token and len(text) > 2 * per_token * self.max_model_len:
            raise OpenAIError(400, f"This model's maximum context length is "
                                   f"{self.max_model_len} tokens. However, your {param} has "
                                   f"{len(text)} characters, more than that many tokens can "
                                   "hold.", param)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def check_length(self, num_prompt: int, params: SamplingParams, param: str,
                     max_tokens_param: str = "max_tokens") -> None:
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
                                   "in the completion).", max_tokens_param)

    def tokens_as_ids(self, req) -> bool:
        """Whether `req`'s logprob tokens are rendered as `token_id:N`: its own
        `return_tokens_as_token_ids` when given (true or false), else the server's flag."""
        asked = getattr(req, "return_tokens_as_token_ids", None)
        return self.limits.return_tokens_as_token_ids if asked is None else asked

    def check_stop(self, stop: str | list[str] | None) -> None:
        """400 for more stop strings than `max_stop_strings` (each costs host time every
        step, for the whole batch)."""
        limit = self.limits.max_stop_strings
        if isinstance(stop, list) and len(stop) > limit:
            raise OpenAIError(400, f"stop: at most {limit} stop strings per request "
                                   f"(--max-stop-strings), got {len(stop)}", "stop")

    def check_constraint(self, req, params: SamplingParams) -> None:
        """Compiles the request's output constraint now (the engine's LRU cache keeps it),
        so a schema or grammar that does not compile is a 400 naming the field it came
        from, before anything is queued."""
        if params.structured_outputs is None:
            return
        try:
            self.llm.engine.check_constraint(params.structured_outputs)
        except ValueError as e:
            from jaxserve.entrypoints.openai.structured import request_constraint

            field = request_constraint(req)[1] or "tools"
            raise OpenAIError(400, f"{field}: {e}", field) from None
