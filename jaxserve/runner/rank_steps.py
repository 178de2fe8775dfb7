"""A step's host arrays laid out rank by rank, for data-parallel attention.

Each attention rank gets an equal block of the token axis (`tokens_per_rank`) and of the
request rows (`rows_per_rank`): rank r's requests (`ScheduledRequest.rank`) are packed by
`build_step_arrays` into its block as if they were a step of their own, so every rank's
`cu_q_lens` counts from its first token and its padding lies at the end of its block
(`pallas_kernels.rank_split` reads this layout). Page ids and slots stay global: each rank
makes them local on its device. The sampling rows are not split: they follow
`out.scheduled` (ranks in order, `SchedulerOutput.decodes_first`), and each row's
`logits_indices` entry points into its rank's block.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.runner.block_table_rows import BlockTableRows
from jaxserve.runner.buckets import pick_bucket, rows_for_bucket
from jaxserve.runner.step_input import StepArrays, build_step_arrays


def rank_parts(out: SchedulerOutput, num_ranks: int) -> list[list]:
    """Each rank's scheduled entries, in step order.

    Raises:
        ValueError: The entries are not grouped by rank in order (`decodes_first`), or an
            entry names a rank past `num_ranks`.
    """
    ranks = [s.rank for s in out.scheduled]
    if ranks != sorted(ranks) or (ranks and not 0 <= ranks[-1] < num_ranks):
        raise ValueError(f"a data-parallel step needs its requests grouped by rank 0.."
                         f"{num_ranks - 1} in order; got ranks {ranks}")
    parts: list[list] = [[] for _ in range(num_ranks)]
    for s in out.scheduled:
        parts[s.rank].append(s)
    return parts


def rank_bucket(out: SchedulerOutput, num_ranks: int, buckets: list[int],
                max_num_seqs: int) -> tuple[int, int]:
    """(tokens, rows) of each rank's block: the bucket of the busiest rank's tokens (or
    rows, whichever is more), its rows `rows_for_bucket`."""
    need = max([max(sum(s.num_new_tokens for s in part), len(part), 1)
                for part in rank_parts(out, num_ranks)])
    tokens = pick_bucket(buckets, need)
    return tokens, rows_for_bucket(tokens, max_num_seqs)


def build_rank_step_arrays(out: SchedulerOutput, num_ranks: int, tokens_per_rank: int,
                           rows_per_rank: int, page_size: int, max_pages_per_seq: int,
                           prev_rows: dict[str, int] | None, num_sample_rows: int,
                           tables: list[BlockTableRows]) -> StepArrays:
    """The step's arrays, each rank's block built by `build_step_arrays`.

    Args:
        out: The step (requests grouped by rank).
        num_ranks: Attention ranks.
        tokens_per_rank: Tokens of each rank's block.
        rows_per_rank: Request rows of each rank's block.
        page_size: Slots per page.
        max_pages_per_seq: Width of the block tables.
        prev_rows: As `build_step_arrays`'s (sampling rows are not split by ranks).
        num_sample_rows: Sampling rows of the whole step.
        tables: The runner's kept block tables, one per KV cache group.

    Returns:
        `StepArrays` with i32[R * T] tokens, i32[R * rows] tables and lengths, i32[R * (rows
        + 1)] cumulative query lengths (each rank's from 0), i32[num_sample_rows] logits
        indices into the whole token axis (R: num_ranks, T: tokens_per_rank).

    Raises:
        ValueError: As `rank_parts` and `build_step_arrays` (a rank's share that does not
            fit its block).
    """
    blocks = [build_step_arrays(dataclasses.replace(out, scheduled=part), tokens_per_rank,
                                rows_per_rank, page_size, max_pages_per_seq, prev_rows,
                                num_sample_rows, tables)
              for part in rank_parts(out, num_ranks)]
    row_ids = [rid for b in blocks for rid in b.row_request_ids]
    if len(row_ids) > num_sample_rows:
        raise ValueError(f"{len(row_ids)} sampling rows do not fit {num_sample_rows}")
    logits_indices = np.zeros(num_sample_rows, np.int32)  # i32[num_sample_rows]
    logits_indices[:len(row_ids)] = np.concatenate(
        [b.logits_indices[:len(b.row_request_ids)] + r * tokens_per_rank
         for r, b in enumerate(blocks)])
    cat = lambda name, axis=0: np.concatenate([getattr(b, name) for b in blocks], axis)  # noqa: E731
    return StepArrays(cat("input_ids"), cat("prev_rows"), cat("positions"),
                      cat("slot_mapping", -1), cat("block_tables", -2), cat("kv_lens"),
                      cat("cu_q_lens"), logits_indices, row_ids)
