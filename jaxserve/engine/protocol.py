"""`EngineClient`: the one interface `AsyncLLM`, the server and the step channel use of an engine.

`LLMEngine` (one replica) and `DataParallelEngine` (several) implement it; so does the test
suite's JAX-free `FakeEngine`. Code above the engine reads nothing else of it, so a new
engine kind (a remote one, a pooling one) only has to provide these members.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """What the serving layers call on an engine.

    Attributes:
        tokenizer: The engine's tokenizer (Hugging Face interface).
    """

    tokenizer: Any

    @property
    def runner_type(self) -> str:
        """"generate" (completions) or "pooling" (embeddings): each engine serves one."""

    @property
    def quantization(self) -> str:
        """The weight format served ("none" for float weights)."""

    @property
    def classifier_head(self):
        """A pooling engine's classifier head (`pooling_params.ClassifierHead`: scores,
        rerankers, `/classify`); None for an embedding or generate engine."""

    @property
    def model_source(self) -> str:
        """Where the served weights came from (a directory, file or hub id; "" if unknown)."""

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output a request may have."""

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size (None: unknown; the engine checks ids itself)."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The EOS ids requests stop on, the sampler's first."""

    def check_constraint(self, structured_outputs) -> None:
        """Compiles an output constraint now (kept for the request that follows), so the
        caller can refuse a bad one before queueing; raises ValueError naming the problem."""

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *,
                    priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None, lora_request=None) -> None:
        """Queues a request (with a LoRA adapter when `lora_request` is given); raises
        ValueError for a bad one (nothing is queued then)."""

    def add_lora(self, lora_request) -> bool:
        """Loads a LoRA adapter; raises ValueError when LoRA is off or it does not load."""

    def sleep(self, level: int = 1) -> int:
        """Frees the KV cache (level 2: the weights too); raises ValueError while requests
        are unfinished. Returns the bytes freed."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Allocates again what `sleep` freed: every memory tag, or those in `tags`
        ("weights", "kv_cache"); raises ValueError for an unknown tag."""

    def is_sleeping(self) -> bool:
        """Whether any memory tag sleeps (new requests are refused until all are awake)."""

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False while requests hold pages."""

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets a loaded adapter (requests running it finish with it); whether it was
        loaded."""

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Ends requests now; returns the final output of each that was live."""

    def step(self) -> list[RequestOutput]:
        """Runs one step; returns the outputs of the requests it advanced."""

    def has_unfinished_requests(self) -> bool:
        """Whether any request is queued, running or has outputs still to return."""

    def get_metrics(self) -> dict[str, float]:
        """Counters and gauges by vLLM's names with a `jaxserve:` prefix."""

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the engine has computed so far (its steps' scheduled tokens)."""

    @property
    def num_iteration_tokens(self) -> int:
        """Prompt plus generated tokens processed so far, as vLLM's
        `iteration_tokens_total` counts them (`EngineMetrics.num_iteration_tokens`)."""

    @property
    def warmup_progress(self) -> tuple[int, int]:
        """(buckets compiled, buckets in all) while warm-up runs (`/health`)."""

    def cache_config_info(self) -> dict[str, object]:
        """The KV cache's settings by vLLM's `cache_config_info` label names."""
