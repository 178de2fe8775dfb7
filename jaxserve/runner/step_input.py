"""Builds a step's model inputs on the host (NumPy) from a `SchedulerOutput`, padded to a bucket."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput


@dataclass
class StepArrays:
    """Host arrays of one step (before packing).

    Attributes:
        input_ids: i32[num_tokens] token ids; padding 0.
        positions: i32[num_tokens] absolute positions; padding 0.
        slot_mapping: i32[num_tokens] KV slots; padding 0 (null page, not written).
        block_tables: i32[num_rows, max_pages_per_seq] page ids; padding 0.
        kv_lens: i32[num_rows] context length after the step; padded rows 0.
        cu_q_lens: i32[num_rows + 1] cumulative new-token counts.
        logits_indices: i32[num_rows] token whose logits each sampling row uses.
        row_request_ids: Request id of each real sampling row (host only, not sent).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    kv_lens: np.ndarray
    cu_q_lens: np.ndarray
    logits_indices: np.ndarray
    row_request_ids: list[str]

    def device_tree(self) -> dict:
        """The arrays the jitted step receives."""
        return {"input_ids": self.input_ids, "positions": self.positions,
                "slot_mapping": self.slot_mapping, "block_tables": self.block_tables,
                "kv_lens": self.kv_lens, "cu_q_lens": self.cu_q_lens,
                "logits_indices": self.logits_indices}


def build_step_arrays(out: SchedulerOutput, num_tokens: int, num_rows: int, page_size: int,
                      max_pages_per_seq: int) -> StepArrays:
    """Packs the scheduled requests' tokens in order and pads everything to the bucket.

    Requests occupy attention rows 0..len(scheduled)-1. Sampling rows list each request
    with samples `num_samples` times (fan-out rows repeat the request's last token).

    Raises:
        ValueError: The step does not fit `num_tokens` tokens or `num_rows` rows.
    """
    if out.total_num_scheduled_tokens > num_tokens or len(out.scheduled) > num_rows \
            or out.num_rows > num_rows:
        raise ValueError(f"step of {out.total_num_scheduled_tokens} tokens / {out.num_rows} "
                         f"rows does not fit bucket ({num_tokens}, {num_rows})")
    input_ids = np.zeros(num_tokens, np.int32)  # i32[num_tokens]
    positions = np.zeros(num_tokens, np.int32)  # i32[num_tokens]
    slots = np.zeros(num_tokens, np.int32)  # i32[num_tokens]
    tables = np.zeros((num_rows, max_pages_per_seq), np.int32)  # i32[num_rows, max_pages]
    kv_lens = np.zeros(num_rows, np.int32)  # i32[num_rows]
    cu = np.zeros(num_rows + 1, np.int32)  # i32[num_rows + 1]
    logits_indices = np.zeros(num_rows, np.int32)  # i32[num_rows]
    row_ids: list[str] = []
    t = 0
    for i, s in enumerate(out.scheduled):
        n = s.num_new_tokens
        pos = np.arange(s.start_pos, s.start_pos + n, dtype=np.int32)
        block_ids = np.asarray(s.block_ids, np.int32)
        input_ids[t:t + n] = s.token_ids
        positions[t:t + n] = pos
        slots[t:t + n] = block_ids[pos // page_size] * page_size + pos % page_size
        tables[i, :len(block_ids)] = block_ids
        kv_lens[i] = s.start_pos + n
        t += n
        cu[i + 1] = t
        for _ in range(s.num_samples):
            logits_indices[len(row_ids)] = t - 1
            row_ids.append(s.request_id)
    cu[len(out.scheduled) + 1:] = t
    return StepArrays(input_ids, positions, slots, tables, kv_lens, cu, logits_indices, row_ids)
