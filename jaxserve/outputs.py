"""User-facing results in vLLM's shape: `RequestOutput` holding `CompletionOutput`s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

# One generated position's logprobs: {token_id: Logprob}.
SampleLogprobs = list[dict[int, "Logprob"]]


@dataclass
class Logprob:
    """Log-probability of one token at one position.

    Attributes:
        logprob: Natural-log probability under the model's raw distribution.
        rank: 1-based rank of the token at that position (1 = most likely), if known.
        decoded_token: The token's text, if detokenized.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the `n` completions of a request.

    Attributes:
        index: Position among the request's completions.
        text: Generated text (stop string removed unless asked to keep it).
        token_ids: Generated token ids.
        cumulative_logprob: Sum of the sampled tokens' logprobs (None unless logprobs).
        logprobs: Per position, the sampled token and the top alternatives.
        finish_reason: "stop", "length", "abort", "error", or None while running.
        stop_reason: The stop string or stop token id that ended it, else None.
        routed_experts: With `enable_return_routed_experts` (a mixture of experts), once
            finished: i32[num_prompt_tokens + len(token_ids) - 1, num_layers, top_k],
            the experts every computed position (the last sampled token never goes
            through the model) was routed to in each layer, the router's heaviest first;
            -1 on a dense layer of a mixed model and where a position's routing is
            unknown (a prefix-cache hit on pages whose routing was dropped). Else None.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    routed_experts: np.ndarray | None = field(default=None, compare=False)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timing of one request (seconds since the epoch).

    Attributes:
        arrival_time: When the request was added.
        first_scheduled_time: When it first got a step.
        first_token_time: When its first token was sampled.
        last_token_time: When its latest token was sampled.
        finished_time: When it finished.
        num_cached_tokens: Prompt tokens served from the prefix cache.
        num_preemptions: How often it was preempted.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    def snapshot(self) -> RequestMetrics:
        """A copy (a quarter of `dataclasses.replace`'s cost: outputs take one per step)."""
        copy = RequestMetrics.__new__(RequestMetrics)
        copy.__dict__.update(self.__dict__)
        return copy


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its completions so far.

    Attributes:
        request_id: The request's id.
        prompt: The prompt text (None when given as token ids).
        prompt_token_ids: The prompt's ids.
        outputs: The completions, ordered by index.
        finished: Whether every completion finished.
        metrics: Timings and cache statistics.
        num_cached_tokens: Prompt tokens served from the prefix cache.
        prompt_logprobs: Per prompt position (the first is None), when requested.
        error: Why the request failed (finish_reason "error"), else None. Only this
            request failed; the others in its steps went on.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's `EmbeddingOutput`).

    Attributes:
        embedding: The pooled vector (truncated and normalized as asked).
    """

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingOutput:
    """One prompt's pooled values (vLLM's `PoolingOutput`, from `LLM.encode` and `LLM.reward`).

    Attributes:
        data: An embedding, or a classifier's class values (activated or raw logits).
    """

    data: list[float]


@dataclass
class PoolingRequestOutput:
    """The result of one pooling request (vLLM's `PoolingRequestOutput`); the subclasses
    say what `outputs` holds.

    Attributes:
        request_id: The request's id.
        outputs: Its result (empty when the request failed or was aborted).
        prompt_token_ids: The prompt's ids.
        finished: Always True: a pooling request is answered once, when its prompt is
            computed.
        metrics: Timings.
        error: Why the request failed, else None.
    """

    request_id: str
    outputs: object
    prompt_token_ids: list[int]
    finished: bool = True
    metrics: RequestMetrics | None = None
    error: str | None = None


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """An embedding request's result (vLLM's `EmbeddingRequestOutput`): `outputs` an
    `EmbeddingOutput`."""


@dataclass
class ClassificationOutput:
    """One prompt's class probabilities (vLLM's `ClassificationOutput`).

    Attributes:
        probs: One value per class: the softmax of the class logits (a sigmoid for one
            class or a multi-label problem; the logits for a regression or with
            `use_activation=False`).
    """

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """A classification request's result (vLLM's): `outputs` a `ClassificationOutput`."""


@dataclass
class ScoringOutput:
    """One pair's similarity score (vLLM's `ScoringOutput`).

    Attributes:
        score: A cross-encoder's activated logit, or the cosine of two embeddings.
    """

    score: float


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    """A scoring request's result (vLLM's): `outputs` a `ScoringOutput`."""
