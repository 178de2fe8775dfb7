"""Request state the scheduler and KV cache manager share: token ids, progress, status."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable

from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; every status after PREEMPTED is a finished one.

    NOTE: the order matters. `status > RequestStatus.PREEMPTED` is the single
    "is finished" test (the vLLM v1 convention), so new finished reasons go at the end
    and new live states go before PREEMPTED.
    """

    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()  # this request's own host-side work failed

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        """Whether `status` is one of the finished states."""
        return status > RequestStatus.PREEMPTED


class Request:
    """One generation request (or one sample of it) as the scheduler and KV cache see it.

    `num_computed_tokens` counts tokens whose KV is in the cache; each step schedules
    `{request_id: num_new_tokens}` until it catches up with `num_tokens`. Prefill, chunked
    prefill, prefix-cache hits and recompute after preemption all follow from that rule.

    Args:
        request_id: Unique, non-empty id.
        prompt_token_ids: The prompt; at least one token.
        cache_salt: Optional tenant key; prefix-cache hits only happen inside one salt.
        lora_request: The LoRA adapter the request runs with (`jaxserve.lora.LoRARequest`;
            None: the base model); its KV is cached under the adapter's id.
        mm_items: The prompt's images (`jaxserve.multimodal.inputs.ImageItem`), each at
            its placeholder tokens; their hashes key the pages that hold them.
        arrival_time: Seconds (time.time()); defaults to now.
        sampling_params: The request's `SamplingParams`; the scheduler reads its stop
            settings (max_tokens, stop ids, min_tokens, ignore_eos) and prompt_logprobs.
            None: no limit but the context length (`SamplingParams(max_tokens=None)`).
        priority: Lower runs first under the "priority" scheduling policy.
        eos_token_ids: Token ids that end the request (unless `ignore_eos`).
        user_request_id: The id the caller gave (a fan-out sample's `request_id` differs);
            defaults to `request_id`.
        seeds: One sampling seed per completion; n of them fan the request out into n
            samples when its prompt completes.

    Raises:
        ValueError: Empty id or empty prompt.
    """

    def __init__(self, request_id: str, prompt_token_ids: Iterable[int], *,
                 cache_salt: str | None = None, arrival_time: float | None = None,
                 sampling_params: SamplingParams | None = None, priority: int = 0,
                 eos_token_ids: tuple[int, ...] = (),
                 user_request_id: str | None = None, seeds: tuple[int, ...] = (0,),
                 lora_request=None, mm_items: tuple = ()):
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError(f"request {request_id!r}: prompt_token_ids is empty")
        self.request_id = request_id
        self.prompt_token_ids: list[int] = prompt
        self.output_token_ids: list[int] = []
        # NOTE: prompt + outputs kept as one list so KV hashing and slot mapping never
        # concatenate per step; only append_output_token_ids mutates it.
        self._all_token_ids: list[int] = list(prompt)
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        # Chained prefix-cache hashes of this request's full pages, filled lazily by the
        # KV cache manager (one page size per engine).
        self.page_hashes: list[bytes] = []
        # Engine-level settings the scheduler reads (stop checks, priority, fan-out).
        self.sampling_params = (sampling_params if sampling_params is not None
                                else SamplingParams(max_tokens=None))
        self.priority = priority
        self.eos_token_ids = tuple(eos_token_ids)
        self.user_request_id = user_request_id or request_id
        self.seeds = tuple(seeds)  # one per completion (n > 1 fans out into n samples)
        # `jaxserve.multimodal.inputs.ImageItem`s at their placeholders, by offset
        self.mm_items = tuple(sorted(mm_items, key=lambda item: item.offset))
        # A multimodal rotary's prompt positions (i32[3, num_prompt_tokens]) and the shift of
        # every later token's (`models.mrope`); None: positions are the token indices.
        self.rope_positions = None
        self.rope_delta = 0
        self.fan_out = len(self.seeds)  # samples to draw when the prompt completes
        self.sample_index = 0  # which completion of the user request this is
        self.forked_from: str | None = None
        self.num_cached_tokens = 0
        # Tokens still to come from steps in flight (async scheduling: a step is
        # scheduled before the previous one's sampled ids reach the host).
        self.num_output_placeholders = 0
        # Proposed next tokens (speculative decoding), set by the engine before each
        # `schedule()`, which consumes them; never part of the request's tokens unless
        # the target accepts them.
        self.spec_token_ids: list[int] = []
        self.stop_reason: str | int | None = None
        # Structured outputs: the `RequestGrammar` that masks this request's next token.
        self.grammar = None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by outputs. Read-only by convention: do not mutate."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """Number of prompt plus output tokens."""
        return len(self._all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Tokens once every step in flight has delivered its sampled one."""
        return len(self._all_token_ids) + self.num_output_placeholders

    @property
    def decodes_next(self) -> bool:
        """Whether its next step is a plain decode: every token but the last computed and
        nothing in flight (the only state in which proposals can be verified)."""
        return (not self.num_output_placeholders
                and self.num_computed_tokens + 1 == len(self._all_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens so far."""
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        """Appends sampled token id(s) to the outputs."""
        new_ids = [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]
        self.output_token_ids.extend(new_ids)
        self._all_token_ids.extend(new_ids)

    def is_finished(self) -> bool:
        """Whether the request reached a finished status."""
        return RequestStatus.is_finished(self.status)

    @property
    def lora_id(self) -> int:
        """The adapter's `lora_int_id`, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    def fork(self, request_id: str) -> Request:
        """A copy with a new id: same tokens, progress, salt and status (for n > 1).

        Pair it with `KVCacheManager.fork(parent, child)` so the child shares the pages.
        """
        child = Request(request_id, self.prompt_token_ids, cache_salt=self.cache_salt,
                        arrival_time=self.arrival_time, sampling_params=self.sampling_params,
                        priority=self.priority, eos_token_ids=self.eos_token_ids,
                        user_request_id=self.user_request_id, seeds=self.seeds,
                        lora_request=self.lora_request, mm_items=self.mm_items)
        child.rope_positions, child.rope_delta = self.rope_positions, self.rope_delta
        child.fan_out = 1
        child.num_cached_tokens = self.num_cached_tokens
        child.append_output_token_ids(self.output_token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.page_hashes = list(self.page_hashes)
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        return child

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens}, status={self.status.name})")
