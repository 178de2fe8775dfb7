"""A runner's step shapes and host arrays: the token bucket of a step, its request and
sampling rows, and its arrays built by `build_step_arrays` (or, under data-parallel
attention, one block per attention rank: `rank_steps`)."""

from __future__ import annotations

import dataclasses

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.runner.block_table_rows import BlockTableRows
from jaxserve.runner.buckets import pick_bucket, rows_for_bucket
from jaxserve.runner.rank_steps import build_rank_step_arrays, rank_bucket
from jaxserve.runner.step_input import StepArrays, build_step_arrays


@dataclasses.dataclass
class StepPacking:
    """The sizes a runner pads its steps to, and the block tables it keeps between steps.

    Attributes:
        buckets: Token buckets (`token_buckets`), of one rank's block under data-parallel
            attention.
        max_num_seqs: Most requests per step.
        num_spec_tokens: Most proposals a request verifies per step (each request then
            needs up to 1 + that many sampling rows).
        page_size: Slots per page.
        max_pages_per_seq: Width of the block tables.
        group_tables: The kept block tables, one per KV cache group (group 0's first).
        state_slots: Steps carry each request's state slot (linear-attention layers).
        num_ranks: Data-parallel attention's ranks (1: none).
    """

    buckets: list[int]
    max_num_seqs: int
    num_spec_tokens: int
    page_size: int
    max_pages_per_seq: int
    group_tables: list[BlockTableRows]
    state_slots: bool = False
    num_ranks: int = 1

    def sample_rows(self, num_tokens: int) -> int:
        """Sampling rows of a token bucket (its attention rows are
        `rows_for_bucket(num_tokens, max_num_seqs)`)."""
        return rows_for_bucket(num_tokens, self.max_num_seqs * (1 + self.num_spec_tokens))

    def shape(self, out: SchedulerOutput) -> tuple[int, int]:
        """(num_tokens, num_sample_rows) of a step: its token bucket (every rank's blocks
        together under data-parallel attention) and its sampling rows."""
        if self.num_ranks > 1:
            per_rank, _ = rank_bucket(out, self.num_ranks, self.buckets, self.max_num_seqs)
            num_tokens = self.num_ranks * per_rank
        else:
            num_tokens = pick_bucket(self.buckets, max(out.total_num_scheduled_tokens,
                                                       out.num_rows))
        return num_tokens, self.sample_rows(num_tokens)

    def arrays(self, out: SchedulerOutput, prev_rows: dict[str, int] | None
               ) -> tuple[StepArrays, int, int]:
        """(host arrays, token bucket, row bucket) of a step, the kept tables updated.

        Raises:
            ValueError: As `build_step_arrays` (and `rank_steps.rank_parts`).
        """
        if self.num_ranks > 1:
            tokens, rows = rank_bucket(out, self.num_ranks, self.buckets, self.max_num_seqs)
            num_tokens = self.num_ranks * tokens
            arrays = build_rank_step_arrays(out, self.num_ranks, tokens, rows, self.page_size,
                                            self.max_pages_per_seq, prev_rows,
                                            self.sample_rows(num_tokens), self.group_tables)
            return arrays, num_tokens, self.num_ranks * rows
        num_tokens, num_sample_rows = self.shape(out)
        num_rows = rows_for_bucket(num_tokens, self.max_num_seqs)
        arrays = build_step_arrays(out, num_tokens, num_rows, self.page_size,
                                   self.max_pages_per_seq, prev_rows, num_sample_rows,
                                   self.group_tables, state_slots=self.state_slots)
        return arrays, num_tokens, num_rows
