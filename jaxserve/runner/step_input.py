"""Builds a step's model inputs on the host (NumPy) from a `SchedulerOutput`, padded to a bucket."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np

from jaxserve.core.scheduler_output import PLACEHOLDER, SchedulerOutput
from jaxserve.runner.block_table_rows import BlockTableRows


@dataclass
class StepArrays:
    """Host arrays of one step (before packing).

    Attributes:
        input_ids: i32[num_tokens] token ids; padding and placeholders 0.
        prev_rows: i32[num_tokens] for a placeholder token, the previous step's sampling
            row whose id it takes (on the device); -1 elsewhere.
        positions: i32[num_tokens] absolute positions; padding 0.
        slot_mapping: i32[num_tokens] KV slots; padding 0 (null page, not written). With
            several KV cache groups i32[num_groups, num_tokens], each group's slots.
        block_tables: i32[num_rows, max_pages_per_seq] page ids; padding 0. With several
            KV cache groups i32[num_groups, num_rows, max_pages_per_seq].
        kv_lens: i32[num_rows] context length after the step; padded rows 0.
        cu_q_lens: i32[num_rows + 1] cumulative new-token counts.
        logits_indices: i32[num_sample_rows] token whose logits each sampling row uses.
            Sent with i32[1] "sample_rows", how many of them are real (the rest padding,
            whose logits a packed LM head leaves at 0).
        row_request_ids: Request id of each real sampling row (host only, not sent).
        lora_slots: i32[num_tokens] each token's LoRA adapter slot (-1: none; padding -1),
            set by the runner when it serves adapters; None: not sent.
        state_slots: i32[num_rows] each request's row of the state pools
            (`ScheduledRequest.state_slot`; padding rows 0, the null slot), for a model with
            linear-attention layers (`AttentionMetadata.state_slots`); None: not sent.
        mm_rows: i32[num_tokens] each image placeholder's row of the encoder cache (-1:
            text, padding), set by a runner serving images; None: not sent.
        span_end: i32[num_tokens] each token's bidirectional span end
            (`AttentionMetadata.q_span_end`; 0 outside one), with `mm_rows` for families
            whose images attend both ways; None: not sent.
        rope_positions: i32[3, num_tokens] a multimodal rotary's position rows (a model
            with `mrope_section`: `rope_rows`); None: not sent.
    """

    input_ids: np.ndarray
    prev_rows: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    kv_lens: np.ndarray
    cu_q_lens: np.ndarray
    logits_indices: np.ndarray
    row_request_ids: list[str]
    lora_slots: np.ndarray | None = None
    state_slots: np.ndarray | None = None
    mm_rows: np.ndarray | None = None
    span_end: np.ndarray | None = None
    rope_positions: np.ndarray | None = None

    def device_tree(self) -> dict:
        """The arrays the jitted step receives."""
        return {"input_ids": self.input_ids, "prev_rows": self.prev_rows,
                "positions": self.positions,
                "slot_mapping": self.slot_mapping, "block_tables": self.block_tables,
                "kv_lens": self.kv_lens, "cu_q_lens": self.cu_q_lens,
                "logits_indices": self.logits_indices,
                "sample_rows": np.array([len(self.row_request_ids)], np.int32),
                **({} if self.lora_slots is None else {"lora_slots": self.lora_slots}),
                **({} if self.state_slots is None else {"state_slots": self.state_slots}),
                **({} if self.mm_rows is None else {"mm_rows": self.mm_rows}),
                **({} if self.span_end is None else {"span_end": self.span_end}),
                **({} if self.rope_positions is None
                   else {"rope_positions": self.rope_positions})}


def build_step_arrays(out: SchedulerOutput, num_tokens: int, num_rows: int, page_size: int,
                      max_pages_per_seq: int,
                      prev_rows: dict[str, int] | None = None,
                      num_sample_rows: int | None = None,
                      tables: BlockTableRows | Sequence[BlockTableRows] | None = None,
                      num_groups: int = 1, state_slots: bool = False) -> StepArrays:
    """Packs the scheduled requests' tokens in order and pads everything to the bucket.

    Requests occupy attention rows 0..len(scheduled)-1. Sampling rows list each request
    with samples `num_samples` times (fan-out rows repeat the request's last token); a
    request verifying s proposals has 1 + s rows, on its last 1 + s tokens (the target's
    next token after each prefix). Each array is built in one NumPy pass; the per-request
    Python work is only gathering each request's fields and lists (`chain` flattens the
    lists in C).

    Args:
        out: The step; its requests' tokens are packed in `out.scheduled` order.
        num_tokens: Token bucket (length of the token arrays).
        num_rows: Row bucket of attention (requests).
        page_size: Slots per KV page.
        max_pages_per_seq: Width of the block tables.
        prev_rows: `{request_id: first sampling row}` of the previous step, when this one
            holds placeholders for what that step samples.
        num_sample_rows: Sampling-row bucket (default `num_rows`).
        tables: The runner's persistent block tables, which apply the entries' deltas
            (`ScheduledRequest.pages_from`): one `BlockTableRows`, or with a hybrid KV
            cache one per KV cache group (group g's applies `group_pages[g - 1]`); None:
            fresh ones (whole tables only).
        num_groups: KV cache groups when `tables` is None.
        state_slots: Also fill `StepArrays.state_slots` (a model with linear-attention
            layers): each request's `ScheduledRequest.state_slot`, padding rows 0.

    Returns:
        The step's host arrays; padding tokens and rows point at the null page 0. With
        several groups, the slot mapping and block tables have a leading group axis.

    Raises:
        ValueError: The step does not fit `num_tokens` tokens or `num_rows` rows, a block
            table is wider than `max_pages_per_seq`, a delta does not apply to the table
            kept, an entry carries the tables of another number of KV cache groups, a
            token's position lies past its request's block table (in any group), or a
            placeholder's request sampled nothing in the previous step.
    """
    sched = out.scheduled
    r = len(sched)
    num_sample_rows = num_rows if num_sample_rows is None else num_sample_rows
    n = np.fromiter((len(s.token_ids) for s in sched), np.int32, r)  # i32[r]
    starts = np.fromiter((s.start_pos for s in sched), np.int32, r)  # i32[r]
    samples = np.fromiter((s.num_samples for s in sched), np.int64, r)  # i64[r]
    spec = np.fromiter((s.num_spec_tokens for s in sched), np.int64, r)  # i64[r]
    t = int(n.sum())
    num_real_rows = int(np.maximum(samples, 1).sum() + spec.sum())  # `out.num_rows`
    if t > num_tokens or r > num_rows or num_real_rows > num_sample_rows:
        raise ValueError(f"step of {t} tokens / {r} requests / {num_real_rows} sampling rows "
                         f"does not fit bucket ({num_tokens}, {num_rows}, {num_sample_rows})")
    if tables is None:
        tables = [BlockTableRows(max_pages_per_seq, r) for _ in range(num_groups)]
    elif isinstance(tables, BlockTableRows):
        tables = [tables]
    for kept in tables:
        if kept.width != max_pages_per_seq:
            raise ValueError(f"block tables of width {kept.width} for max_pages_per_seq="
                             f"{max_pages_per_seq}")
    groups = len(tables)
    for s in sched:
        if len(s.group_pages) != groups - 1:
            raise ValueError(f"request {s.request_id!r}: group_pages holds "
                             f"{len(s.group_pages)} block tables; a KV cache of {groups} "
                             f"group(s) needs {groups - 1} (groups 1..)")
    # i32[G, num_rows, max_pages], i64[G, r]
    per_group = [kept.gather(sched, num_rows, g) for g, kept in enumerate(tables)]
    cu = np.zeros(num_rows + 1, np.int32)  # i32[num_rows + 1]
    np.cumsum(n, out=cu[1:r + 1])
    cu[r + 1:] = t
    row_of_token = np.repeat(np.arange(r), n)  # i64[t]
    input_ids = np.zeros(num_tokens, np.int32)  # i32[num_tokens]
    input_ids[:t] = np.fromiter(chain.from_iterable(s.token_ids for s in sched), np.int32, t)
    src = np.full(num_tokens, -1, np.int32)  # i32[num_tokens]
    holes = np.flatnonzero(input_ids[:t] == PLACEHOLDER)
    if holes.size:
        prev_rows = prev_rows or {}
        owners = [sched[i].request_id for i in row_of_token[holes]]
        src[holes] = [prev_rows.get(o, -1) for o in owners]
        if (src[holes] < 0).any():
            raise ValueError("a placeholder token's request sampled nothing in the previous "
                             "step")
        input_ids[holes] = 0
    positions = np.zeros(num_tokens, np.int32)  # i32[num_tokens]
    pos = positions[:t]  # i32[t], a view
    pos[:] = np.arange(t, dtype=np.int32) - cu[row_of_token] + starts[row_of_token]
    page_of_token = pos // page_size  # i32[t]
    slots = np.zeros((groups, num_tokens), np.int32)  # i32[G, num_tokens]
    for g, (table, num_pages) in enumerate(per_group):
        if t and (page_of_token >= num_pages[row_of_token]).any():
            raise ValueError("a scheduled token's position lies past its request's block "
                             "table" + (f" of KV cache group {g}" if groups > 1 else ""))
        slots[g, :t] = table[row_of_token, page_of_token] * page_size + pos % page_size
    kv_lens = np.zeros(num_rows, np.int32)  # i32[num_rows]
    kv_lens[:r] = starts + n
    logits_indices = np.zeros(num_sample_rows, np.int32)  # i32[num_sample_rows]
    rows_per = samples + spec  # i64[r]: a verifying request's 1 + s rows
    last = np.repeat(cu[1:r + 1] - 1, rows_per)  # i32[sampling rows]
    if spec.any():  # row j of a verifying request reads position last - (s - j)
        first_row = np.repeat(np.cumsum(rows_per) - rows_per, rows_per)  # i64[rows]
        s_of_row = np.repeat(spec, rows_per)  # i64[rows]
        last = last - np.where(s_of_row > 0, s_of_row - (np.arange(last.size) - first_row), 0)
    logits_indices[:last.size] = last
    row_ids = [s.request_id for s in sched for _ in range(s.num_samples + s.num_spec_tokens)]
    if groups == 1:
        slot_mapping, block_tables = slots[0], per_group[0][0]
    else:
        slot_mapping, block_tables = slots, np.stack([table for table, _ in per_group])
    slots_of_rows = None
    if state_slots:
        slots_of_rows = np.zeros(num_rows, np.int32)  # i32[num_rows]; padding: null slot 0
        slots_of_rows[:r] = np.fromiter((s.state_slot for s in sched), np.int32, r)
    return StepArrays(input_ids, src, positions, slot_mapping, block_tables, kv_lens, cu,
                      logits_indices, row_ids, state_slots=slots_of_rows)


def rope_rows(scheduled, positions: np.ndarray) -> np.ndarray:
    """i32[3, num_tokens] the multimodal rotary rows of a step: each token's position on all
    three, but the entries' own `ScheduledRequest.rope_positions` where they have them
    (packed in order, as `build_step_arrays` packs the tokens)."""
    rows = np.broadcast_to(positions, (3, positions.shape[0])).copy()
    t = 0
    for s in scheduled:
        n = s.num_new_tokens
        if s.rope_positions is not None:
            rows[:, t:t + n] = s.rope_positions
        t += n
    return rows
