"""`SchedulerOutput`: the only contract between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jaxserve.core.plans import KVPlans

if TYPE_CHECKING:
    from jaxserve.request import Request

# A token id not known on the host yet: the one the previous step (still in flight) samples
# for this request. The runner takes it from that step's device output.
PLACEHOLDER = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        request_id: The request.
        token_ids: The `num_new_tokens` tokens whose KV this step computes; the last may be
            `PLACEHOLDER` (async scheduling).
        start_pos: Position of the first of them (the request's computed tokens so far).
        page_ids: The request's block table (page ids, in order) from index `pages_from`
            on; the whole table when `pages_from` is 0 or None.
        num_samples: Tokens to sample from the last position: 0 while a prompt is only
            partly computed, 1 normally, n when a request fans out into n samples.
        sampling_counter: How many tokens the request has generated (seeds the per-row key).
        num_spec_tokens: The last this many of `token_ids` are proposals (speculative
            decoding): the step verifies them, returning 1 + the accepted count tokens.
        pages_from: None: `page_ids` is the whole table and the runner keeps nothing of it
            (steps built by hand: warm-up, benchmarks, the draft model). An index: a
            delta against the table the runner kept from this request's previous step,
            whose first `pages_from` pages are unchanged (the scheduler's steps; 0 sends
            the whole table and starts the runner's row).
        group_pages: With a hybrid KV cache (`models.kv_groups`), the block tables of
            groups 1, 2, ... as `(pages_from, page_ids)`, each read like `pages_from` and
            `page_ids` above (which are group 0's); a group's `pages_from` is 0 when
            `pages_from` is None. Empty with one group.
        lora_id: The request's LoRA adapter (`lora_int_id`), 0 for the base model.
        state_slot: With a state group (linear-attention layers), the request's state slot:
            the row of the state pools this step reads and writes (the runner puts it in
            `AttentionMetadata.state_slots`; a step starting at position 0 starts the state
            from zero). 0, the null slot, without one.
        rank: The attention rank holding the request's KV (data-parallel attention:
            `RankedKVCacheManager.rank_of`); its page ids lie in that rank's range. 0
            with one rank.
        mm_items: The request's images (`jaxserve.multimodal.inputs.ImageItem`) whose
            placeholders this step computes: the runner puts their encoder rows in for the
            placeholders' embeddings.
        rope_positions: i32[3, len(token_ids)] the tokens' multimodal rotary positions
            (a request with `Request.rope_positions`); None: their positions.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    page_ids: list[int]
    num_samples: int
    sampling_counter: int = 0
    num_spec_tokens: int = 0
    pages_from: int | None = None
    group_pages: tuple[tuple[int, list[int]], ...] = ()
    lora_id: int = 0
    state_slot: int = 0
    rank: int = 0
    mm_items: tuple = ()
    rope_positions: object = None

    @property
    def num_pages(self) -> int:
        """Pages in the request's whole block table."""
        return (self.pages_from or 0) + len(self.page_ids)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def spec_token_ids(self) -> list[int]:
        """The proposals this step verifies (the last `num_spec_tokens` of `token_ids`)."""
        return self.token_ids[len(self.token_ids) - self.num_spec_tokens:]


@dataclass
class SchedulerOutput:
    """What one step computes: `{request_id: num_new_tokens}` plus the KV plans to run first.

    Attributes:
        scheduled: Requests in row order (their tokens are packed in this order).
        plans: Page copies (copy-on-write) and swaps the runner executes before the step.
        preempted_request_ids: Requests preempted while building this step.
        released_request_ids: Requests whose device block table was dropped (finished,
            aborted, preempted, swapped out) since the previous step: the runner forgets
            its rows of them before it runs this step.
        requests: Host only (never sent to the device or other processes): the `Request`
            each entry was scheduled for. A request that ends while its step is in flight
            (async scheduling) may see its id reused by a new request; the scheduler updates
            only the objects it scheduled.
        total_num_scheduled_tokens: Sum of all requests' new tokens.
        num_rows: Sampling rows (sum of `num_samples`, at least one per request, plus one
            per proposal verified).
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    plans: KVPlans | None = None
    preempted_request_ids: list[str] = field(default_factory=list)
    released_request_ids: list[str] = field(default_factory=list)
    requests: dict[str, Request] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """The step itself: `{request_id: num_new_tokens}`."""
        return {s.request_id: s.num_new_tokens for s in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_rows(self) -> int:
        return sum(max(1, s.num_samples) + s.num_spec_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def decodes_first(self) -> SchedulerOutput:
        """Reorders `scheduled` (in place): single-token entries first, each group in its
        scheduling order, and under data-parallel attention each rank's entries together
        (rank 0's first, that order kept within each rank); returns self.

        NOTE: the runner packs rows in this order, so decode row i holds token i and
        attention reads each decode row's context once per row, not once per token
        (pallas_kernels/ragged_paged_attention/xla.py). The scheduler's own order is kept
        for its bookkeeping; call this before building the step's sampling rows.
        """
        self.scheduled = ([s for s in self.scheduled if s.num_new_tokens == 1]
                          + [s for s in self.scheduled if s.num_new_tokens != 1])
        self.scheduled.sort(key=lambda s: s.rank)  # stable: a no-op with one rank
        return self


class StepDraft:
    """The step `Scheduler.schedule` is building: its entries by request id and the token
    budget left."""

    def __init__(self, budget: int):
        self.entries: dict[str, ScheduledRequest] = {}
        self.budget = budget

    def add(self, entry: ScheduledRequest) -> None:
        """Adds a request's entry (its tokens come out of the budget)."""
        self.entries[entry.request_id] = entry
        self.budget -= entry.num_new_tokens

    def drop(self, request_id: str) -> bool:
        """Takes a request's entry back (it was preempted); False if it had none."""
        entry = self.entries.pop(request_id, None)
        if entry is not None:
            self.budget += entry.num_new_tokens
        return entry is not None
