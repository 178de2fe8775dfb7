"""User-facing sampling settings (vLLM's `SamplingParams` fields, defaults and validation)."""

from __future__ import annotations

import dataclasses
import enum
import operator
from typing import Any, ClassVar

from jaxserve.structured.params import StructuredOutputsParams

# Temperatures below this mean greedy decoding (vLLM's `_SAMPLING_EPS`).
SAMPLING_EPS = 1e-5
# Integers that reach the device (top_k, token ids, lengths, counters) are int32 there.
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
# Seeds are folded to 32 bits on the device; any non-negative 64-bit value is accepted.
SEED_MAX = 2**64 - 1
# Smallest seed: any signed 64-bit seed is taken, as vLLM's server takes it.
SEED_MIN = -(2**63)
# Most stop token ids one request may give (checked on the host every step).
MAX_STOP_TOKEN_IDS = 1024
# Widths the sampler compiles for a row's logit_bias entries and allowed_token_ids (as the
# OpenAI API caps logit_bias at 300 entries); longer lists are refused at construction.
MAX_LOGIT_BIAS = 300
MAX_ALLOWED_TOKEN_IDS = 1024
MAX_BAD_WORDS = 64
LOGIT_BIAS_LIMIT = 100.0
# What sample logprobs hold (vLLM's `--logprobs-mode`, an engine argument): log-softmax or
# logits, of the model's logits ("raw") or of the distribution actually sampled ("processed").
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


class ParameterError(ValueError):
    """A bad request value whose message does not start with the field's name (vLLM's
    `VLLMValidationError`): the server reports `parameter` as the 400's `param`.

    Args:
        message: The message.
        parameter: The request field at fault.
        value: Its value.
    """

    def __init__(self, message: str, parameter: str, value: Any = None):
        super().__init__(message)
        self.parameter = parameter
        self.value = value


def resolve_num_logprobs(num: int | None, vocab_size: int) -> int | None:
    """A `logprobs` / `prompt_logprobs` value as a count: -1 (vLLM's "the whole vocabulary")
    becomes `vocab_size`; None stays None."""
    return vocab_size if num == -1 else num


def check_num_logprobs(params: SamplingParams, max_logprobs: int,
                       vocab_size: int) -> SamplingParams:
    """Refuses more `logprobs` or `prompt_logprobs` than an engine's `max_logprobs` (vLLM's
    check and words; -1 counts as the whole vocabulary, and so does a `max_logprobs` of -1).

    Returns:
        `params`, or a copy with -1 resolved to `vocab_size` (the count engines work with).

    Raises:
        ParameterError: A count above the limit (`parameter` names the field).
    """
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        num = resolve_num_logprobs(getattr(params, name), vocab_size)
        if num and num > limit:
            raise ParameterError(f"Requested {kind} logprobs of {num}, which is greater than "
                                 f"max allowed: {limit}", name, num)
    if -1 in (params.logprobs, params.prompt_logprobs):
        params = params.clone(logprobs=resolve_num_logprobs(params.logprobs, vocab_size),
                              prompt_logprobs=resolve_num_logprobs(params.prompt_logprobs,
                                                                   vocab_size))
    return params


class RequestOutputKind(enum.IntEnum):
    """When the engine emits a request's `RequestOutput` (vLLM's names and values)."""

    CUMULATIVE = 0  # at every step that advances it: everything so far
    DELTA = 1  # at every step that advances it: only what is new since the last one
    FINAL_ONLY = 2  # once, when it finishes (`LLM.generate`, non-streaming requests)


class SamplingType(enum.IntEnum):
    """How a request picks tokens."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _as_int(name: str, value: Any, low: int | None = None, high: int = INT32_MAX) -> int:
    """`value` as a Python int in [low, high], or ValueError naming the field.

    Bools and floats are refused. NOTE: every integer is range-checked here, when the
    request is made, so that nothing out of range reaches the step (where an int32
    overflow would fail every request sharing it).
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if low is not None and result < low:
        raise ValueError(f"{name} must be at least {low}, got {result}")
    if result > high:
        raise ValueError(f"{name} must be at most {high}, got {result}")
    return result


def device_seed(seed: int) -> int:
    """The sampler's 32-bit seed of a request seed in [SEED_MIN, SEED_MAX].

    The device key takes 32 bits: a seed in [0, 2**32) is used as it is; any other seed
    (negative, or 2**32 and more) is mixed down from all 64 bits of its two's complement
    (splitmix64's finalizer), so that seeds differing only in their high bits, or in sign,
    do not share a stream the way their low 32 bits would. Deterministic for every seed.
    """
    if 0 <= seed < 2**32:
        return seed
    z = seed % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    return (z ^ (z >> 32)) & 0xFFFFFFFF


def _as_float(name: str, value: Any) -> float:
    """`value` as a Python float, or ValueError naming the field."""
    if isinstance(value, bool) or isinstance(value, str):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if result != result:  # NaN passes every range comparison below
        raise ValueError(f"{name} must not be NaN, got {value!r}")
    if abs(result) > FLOAT32_MAX and result not in (float("inf"), float("-inf")):
        # NOTE: the device holds float32: a larger finite value would become infinity.
        raise ValueError(f"{name} must be at most {FLOAT32_MAX:.4g} in magnitude, got {value!r}")
    return result


@dataclasses.dataclass
class SamplingParams:
    """Sampling settings of one request, validated and normalised on construction.

    The fields, defaults and rules follow vLLM. `top_k` of 0 or -1 disables top-k and is
    stored as 0. A greedy request (`temperature < 1e-5`) has its top-k/top-p/min-p reset to
    "off", as vLLM does. `max_tokens=None` means "up to max_model_len"; the engine resolves it.

    NOTE: `seed=None` does not mean "unreproducible" on device: the engine draws a seed
    for such requests from its own seeded RNG at `add_request`, so the sampler always uses
    per-request keys. For `n > 1`, completion 0 uses the seed and completion `i > 0` a
    stream derived from it (`numpy.random.SeedSequence([seed, n])`; see `make_request`).

    Raises:
        ValueError: Any invalid value; the message names the field and the value.
    """

    # The engines' default `max_logprobs` (vLLM's): the most `logprobs` and `prompt_logprobs`
    # a request may ask for, checked when it is added (-1 asks for the whole vocabulary).
    MAX_LOGPROBS: ClassVar[int] = 20

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # A constraint the output follows (JSON schema, regex, choice, grammar); a dict of
    # `StructuredOutputsParams` fields is accepted and converted.
    structured_outputs: StructuredOutputsParams | None = None
    # Token sequences of `bad_words`, set by the engine from its tokenizer (as vLLM's
    # `_bad_words_token_ids`); not a constructor argument.
    bad_words_token_ids: list[list[int]] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.n = _as_int("n", self.n, 1)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0 or self.repetition_penalty == float("inf"):
            raise ValueError(
                f"repetition_penalty must be a finite number greater than zero, "
                f"got {self.repetition_penalty}")
        self.temperature = _as_float("temperature", self.temperature)
        if self.temperature < 0.0 or self.temperature == float("inf"):
            raise ValueError(
                f"temperature must be non-negative and finite, got {self.temperature}")
        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _as_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}")
        self.top_k = max(self.top_k, 0)
        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _as_int("seed", self.seed, SEED_MIN, SEED_MAX)
        self._init_stops()
        self._init_lengths()
        self._init_logit_controls()
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            value = _as_int(name, value)
            if value < -1:  # NOTE: vLLM's rule and words; the engine checks max_logprobs
                raise ValueError(f"{name} must be non-negative or -1, got {value}")
            setattr(self, name, value)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            if self.output_kind not in tuple(RequestOutputKind) or isinstance(self.output_kind,
                                                                               bool):
                raise ValueError(f"output_kind must be a RequestOutputKind, got "
                                 f"{self.output_kind!r}")
            self.output_kind = RequestOutputKind(self.output_kind)
        if self.stop and not self.detokenize:
            raise ValueError(
                f"stop strings need detokenize=True, got stop={self.stop!r} with detokenize=False")
        if self.temperature < SAMPLING_EPS:
            # NOTE: greedy ignores the filters; resetting them keeps the sampler's static
            # "needs_filtering" flag off for all-greedy batches (as vLLM does).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _init_stops(self) -> None:
        """Normalises `stop` to a list of non-empty strings and `stop_token_ids` to ints."""
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must hold strings, got {s!r} in stop={self.stop!r}")
            if not s:
                raise ValueError(f"stop cannot contain an empty string, got stop={self.stop!r}")
        if isinstance(self.stop_token_ids, (str, bytes, dict)):
            raise ValueError(f"stop_token_ids must be a list of integers, got "
                             f"{self.stop_token_ids!r}")
        try:
            ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        except TypeError:
            raise ValueError(f"stop_token_ids must be a list of integers, got "
                             f"{self.stop_token_ids!r}") from None
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                             f"{len(ids)}")
        try:
            self.stop_token_ids = [_as_int("stop_token_ids", t, 0) for t in ids]
        except ValueError:
            raise ValueError(f"stop_token_ids must hold integers in [0, {INT32_MAX}], got "
                             f"{ids!r}") from None

    def _init_logit_controls(self) -> None:
        """Normalises `logit_bias` ({id: bias in [-100, 100]}, OpenAI's rule; string keys
        of JSON accepted), `allowed_token_ids` and `bad_words` (None when empty)."""
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got "
                                 f"{len(bias)}")
            norm = {}
            for key, value in bias.items():
                try:
                    tid = int(key) if isinstance(key, str) else key
                except ValueError:
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
                tid = _as_int("logit_bias", tid, 0)
                value = _as_float("logit_bias", value)
                if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {value} "
                                     f"for token {tid}")
                norm[tid] = value
            self.logit_bias = norm or None
        ids = self.allowed_token_ids
        if ids is not None:
            if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__len__"):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got {ids!r}")
            if len(ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids may hold at most {MAX_ALLOWED_TOKEN_IDS} "
                                 f"ids, got {len(ids)}")
            if len(ids) == 0:
                raise ValueError("allowed_token_ids must not be empty (nothing could be "
                                 "sampled)")
            self.allowed_token_ids = sorted({_as_int("allowed_token_ids", t, 0) for t in ids})
        words = self.bad_words
        if words is not None:
            if isinstance(words, str):
                words = [words]
            if not isinstance(words, (list, tuple)) or not all(
                    isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got "
                                 f"{self.bad_words!r}")
            if len(words) > MAX_BAD_WORDS:
                raise ValueError(f"bad_words may hold at most {MAX_BAD_WORDS} words, got "
                                 f"{len(words)}")
            self.bad_words = list(words) or None

    @property
    def has_logit_controls(self) -> bool:
        """Whether logit_bias or allowed_token_ids change this request's logits."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    def _init_lengths(self) -> None:
        """Validates `max_tokens` (None allowed) and `min_tokens`."""
        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens, 1)
        self.min_tokens = _as_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be at most max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}")

    @property
    def is_greedy(self) -> bool:
        """Whether the request decodes greedily (temperature below 1e-5)."""
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY, RANDOM_SEED (user seed) or RANDOM."""
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def needs_filtering(self) -> bool:
        """Whether any of top-k, top-p or min-p is active."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether any presence, frequency or repetition penalty is active."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling a token reads the tokens generated before it (penalties, bad
        words): such a request's next step cannot be scheduled before its previous
        token is known on the host (no async scheduling). A structured-output constraint
        does too: its next mask follows the previous token."""
        return (self.has_penalties or bool(self.bad_words_token_ids or self.bad_words)
                or self.structured_outputs is not None)

    @property
    def output_text_buffer_length(self) -> int:
        """Characters the detokenizer holds back so a stop string is never streamed."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def all_stop_token_ids(self, eos_token_id: int | None = None) -> set[int]:
        """`stop_token_ids` plus the EOS token unless `ignore_eos` is set.

        Args:
            eos_token_id: The tokenizer's EOS id, or None when there is none.
        """
        ids = set(self.stop_token_ids)
        if eos_token_id is not None and not self.ignore_eos:
            ids.add(int(eos_token_id))
        return ids

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy with `changes` applied (e.g. a child's `seed` for n > 1)."""
        copy = dataclasses.replace(self, **changes)
        if "bad_words" not in changes:
            copy.bad_words_token_ids = self.bad_words_token_ids
        return copy
