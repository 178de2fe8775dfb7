"""EAGLE-3 proposals: a one-layer draft head reading the target's own hidden states.

The target's steps also return the residual stream entering the layers the head names
(`StepPrograms.capture_aux`). After each target step the engine hands the step to
`observe`: for every request it ran, the head computes the positions the step made valid
(a prompt chunk; a decode's token, the accepted proposals), each from the target's aux
states there and the embedding of the token after it, writing its own K/V, and keeps the
request's last row (its greedy draft token and hidden state) on the device. Before the next
step `propose` runs k - 1 more single-token steps from those rows (one jitted loop) and
brings the k proposals to the host. They are greedy (one-hot drafts), so they are verified
as n-gram proposals are (`speculator`): the output is the target's whatever the head.

The head's K/V is one layer in a page pool of its own with its own allocator and prefix cache
(`eagle_pages`). A request's head pages cover its positions from `base` on: 0, or where the
head first saw it when a prefix-cache hit skipped the target's computing (and so its hidden
states) of the prompt's start and the head's cache lacks those pages. Tokens never change,
so the head's K/V stays valid across the target's preemption (recompute or swap): positions
it holds are skipped when the target computes them again, except the last, whose output
makes proposal 1.
Proposals' slots are written again by the next `observe`. A request that finished, or
whose head pages ran out, is dropped; one whose positions the head missed (pages ran out,
or the gate paused proposals, when `observe` does nothing) starts again from there.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable

import jax
import numpy as np

from jaxserve.config import SpeculativeConfig
from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.request import Request
from jaxserve.runner import compile_counter
from jaxserve.runner.buckets import pick_bucket
from jaxserve.spec_decode.eagle_pages import HeadPages, HeadSeq
from jaxserve.spec_decode.eagle_programs import HeadProgramSpec, observe, propose_loop
from jaxserve.spec_decode.eagle_setup import head_for_target, program_spec, target_embedding
from jaxserve.spec_decode.speculator import Speculator
from jaxserve.utils import cdiv
from pallas_kernels.metadata import kv_pages_shape


class Eagle3Speculator(Speculator):
    """Proposes with an EAGLE-3 head (see the module docstring).

    Args:
        config: `SpeculativeConfig` of method "eagle3" (`model`: the head's directory or a
            loaded `models.loaders.eagle3.Eagle3Head`).
        target: The target `Model`.
        dtype: Dtype to load a head given by path in.
        num_pages, page_size, max_model_len, max_num_seqs: Sizes of the head's pool (the
            target's) and its programs' rows.
        target_params: The target's weight bytes (the head's relative cost, for the gate).

    Raises:
        ValueError: A head that does not fit the target (`head_for_target`).
    """

    own_device_calls = True  # the head's programs

    def __init__(self, config: SpeculativeConfig, *, target, dtype: str = "float32",
                 num_pages: int, page_size: int, max_model_len: int, max_num_seqs: int,
                 target_params: int = 0, **_runner_sizes):
        self.head, self.aux_layers = self.fit_head(config, target, dtype)
        super().__init__(config, draft_cost=min(1.0, self.head.weight_bytes / target_params)
                         if target_params else 1.0)
        self.page_size, self.max_model_len, self.max_rows = page_size, max_model_len, max_num_seqs
        self.width = cdiv(max_model_len + self.k, page_size)  # a head block table's pages
        self.kv_pages = self.empty_pool(num_pages, page_size)
        self.pages = HeadPages(num_pages, page_size, self.k - 1, self.width)
        self._observe = self._loop = None  # jitted at `attach`
        self._last = None  # (i32[R] proposal 1, [R, H] hidden, {request_id: (row, position)})
        self._runner = self._target_embed = None
        self.row_buckets: list[int] = []
        self._compilations = 0

    # ------------------------------------------------------------ the head's kind
    def fit_head(self, config: SpeculativeConfig, target, dtype: str) -> tuple:
        """(the head, the target layers whose aux states it reads): EAGLE-3's, checked
        against the target (`head_for_target`)."""
        return head_for_target(config, target, dtype)

    def empty_pool(self, num_pages: int, page_size: int) -> jax.Array:
        """The head's zeroed page pool: one layer's K/V."""
        lc = self.head.cfg.layer
        return jax.numpy.zeros(kv_pages_shape(1, lc.num_kv_heads, num_pages, page_size,
                                              lc.head_dim), self.head.params["norm"].dtype)

    def program_spec(self, target) -> HeadProgramSpec:
        """The head's programs' static part for a runner serving `target` (its `Model`)."""
        return program_spec(self.head, target, self.k - 1, self.page_size, self.max_rows)

    # ------------------------------------------------------------ engine hooks
    def attach(self, runner) -> None:
        """Makes `runner`'s steps return the aux states the head reads; call before warm-up.

        Raises:
            ValueError: A runner over a device mesh (the head runs on one device).
        """
        if runner.layout is not None:
            raise ValueError(f"speculative_config.method: {self.config.method} runs on one "
                             "device; tensor and data parallelism are not supported with it")
        self._runner = runner
        runner.programs.capture_aux(self.aux_layers)
        # Row counts of the loop: the token buckets below max_num_seqs, then max_num_seqs
        # (an `observe` of a bucket of T tokens has min(T, max_num_seqs) rows).
        self.row_buckets = sorted({min(b, self.max_rows) for b in runner.buckets})
        spec = self.program_spec(runner.model)
        self._observe = jax.jit(functools.partial(observe, spec), donate_argnums=2)
        self._loop = jax.jit(functools.partial(propose_loop, spec), donate_argnums=2)
        self._target_embed = target_embedding(runner.model)

    def warmup(self, make_dummy_sampling) -> float:
        start = time.perf_counter()
        # NOTE: the aux states have the dtype of the target's embeddings (the scan's carry).
        aux_dtype = jax.eval_shape(self._target_embed, self._runner.params,
                                   np.zeros(1, np.int32)).dtype
        n, ht = len(self.aux_layers), self._runner.model.cfg.hidden_size
        for bucket in self._runner.buckets:
            aux = jax.numpy.zeros((bucket, n, ht), aux_dtype)
            first, hidden = self._observe_call(aux, self._rows(bucket))
        for num_rows in self.row_buckets if self.k > 1 else ():
            jax.block_until_ready(self._loop_call(first, hidden, [], num_rows))
        jax.block_until_ready(self.kv_pages)
        self._compilations = 0
        return time.perf_counter() - start

    @property
    def num_compilations(self) -> int:
        return self._compilations

    def observe(self, out: SchedulerOutput, requests: dict[str, Request],
                sampled: dict[str, list[int]], aux) -> None:
        """After a target step: the head computes the positions it made valid.

        Args:
            out: The step (its entries in packed order).
            requests: The requests it ran, by id.
            sampled: Each entry's tokens after verification (accepted proposals and the
                token after them), as the scheduler took them.
            aux: The step's aux states [Tb, n, Ht] (`StepResult.aux_hidden`).
        """
        self.pages.release_finished()
        # NOTE: while the gate pauses proposals the head costs nothing (it was a third of
        # a SmolLM2 decode step); a request it meets again restarts from there.
        if aux is None or not self.gate.active:
            return
        rows = self._rows(aux.shape[0])
        offset = 0
        for s in out.scheduled:
            start_row, offset = offset, offset + s.num_new_tokens
            request = requests.get(s.request_id)
            if request is None or request.is_finished() or rows.full or (
                    s.num_samples and s.request_id not in sampled):
                continue  # ended, or no verdict (its tokens failed)
            accepted = len(sampled[s.request_id]) - 1 if s.num_spec_tokens else 0
            last = s.start_pos + s.num_new_tokens - s.num_spec_tokens + accepted - 1
            seq = self.pages.reserve(request, s.start_pos, last)
            if seq is None or last < seq.base:
                continue  # out of pages, or positions before those the head holds
            # NOTE: at least the last position: its output is proposal 1.
            first = min(max(s.start_pos, seq.next), last)
            tokens = request.all_token_ids[first + 1:last + 2]
            if len(tokens) != last + 1 - first:
                continue
            rows.add(request.request_id, tokens, first, seq, start_row + first - s.start_pos,
                     self.page_size)
            seq.next = max(seq.next, last + 1)
            self.pages.cache_full(seq)
        if rows.num_rows:
            first, hidden = self._observe_call(aux, rows)
            self._last = (first, hidden, rows.last_of)

    def propose(self, requests: Iterable[Request]) -> dict[str, list[int]]:
        if self._last is None:
            return {}
        first, hidden, last_of = self._last
        todo = [(r, last_of[r.request_id][0]) for r in requests if self.wants_proposals(r)
                and last_of.get(r.request_id, (0, -1))[1] == r.num_tokens - 2
                and r.num_tokens - 1 + self.k <= self.max_model_len]
        if not todo:
            return {}
        if self.k == 1:
            ids = np.asarray(first)
            return {r.request_id: [int(ids[row])] for r, row in todo}
        out = np.asarray(self._loop_call(first, hidden, todo))
        return {r.request_id: out[i].tolist() for i, (r, _) in enumerate(todo)}

    # ------------------------------------------------------------ device calls
    def _observe_call(self, aux, rows: _ObserveRows):
        start = compile_counter.num_compilations()
        self.kv_pages, first, hidden = self._observe(
            self.head.params, self._runner.params, self.kv_pages, aux, *rows.arrays())
        self._compilations += compile_counter.num_compilations() - start
        return first, hidden

    def _rows(self, num_tokens: int) -> _ObserveRows:
        """An empty `observe` call for a target step of `num_tokens` (its bucket): as many
        rows as it can hold requests (each has a token), at most `max_num_seqs`."""
        return _ObserveRows(num_tokens, min(num_tokens, self.max_rows), self.width)

    def _loop_call(self, first, hidden, todo: list[tuple[Request, int]],
                   num_rows: int | None = None):
        """The k - 1 step program on `todo`'s rows of `observe`'s outputs, padded to a row
        bucket (`row_buckets`)."""
        num = len(todo)
        num_rows = num_rows or pick_bucket(self.row_buckets, num)
        rows = np.zeros(num_rows, np.int32)  # i32[R]
        positions = np.zeros(num_rows, np.int32)  # i32[R]
        local = np.zeros(num_rows, np.int32)  # i32[R]
        tables = np.zeros((num_rows, self.width), np.int32)  # i32[R, W]
        for i, (request, row) in enumerate(todo):
            seq = self.pages.seqs[request.request_id]
            rows[i], positions[i] = row, request.num_tokens - 1
            local[i] = positions[i] - seq.base
            tables[i, :len(seq.pages)] = [p.page_id for p in seq.pages]
        start = compile_counter.num_compilations()
        self.kv_pages, out = self._loop(self.head.params, self._runner.params, self.kv_pages,
                                        first, hidden, rows, positions, local, tables,
                                        np.int32(num))
        self._compilations += compile_counter.num_compilations() - start
        return out


class _ObserveRows:
    """The host arrays of one `observe` call, filled request by request."""

    def __init__(self, num_tokens: int, num_rows: int, width: int):
        self.gather = np.zeros(num_tokens, np.int32)  # i32[Tb]
        self.ids = np.zeros(num_tokens, np.int32)  # i32[Tb]
        self.positions = np.zeros(num_tokens, np.int32)  # i32[Tb]
        self.slots = np.zeros(num_tokens, np.int32)  # i32[Tb]
        self.tables = np.zeros((num_rows, width), np.int32)  # i32[R, W]
        self.kv_lens = np.zeros(num_rows, np.int32)  # i32[R]
        self.cu_q_lens = np.zeros(num_rows + 1, np.int32)  # i32[R + 1]
        self.last = np.zeros(num_rows, np.int32)  # i32[R]
        self.num_rows = self.num_tokens = 0
        self.max_rows = num_rows
        self.last_of: dict[str, tuple[int, int]] = {}  # request id -> (row, last position)

    @property
    def full(self) -> bool:
        return self.num_rows == self.max_rows

    def add(self, req_id: str, tokens: list[int], first: int, seq: HeadSeq, step_row: int,
            page_size: int) -> None:
        """Request `req_id`'s positions first.. (their next tokens `tokens`), whose target
        states are the step's rows from `step_row` on."""
        r, t, n = self.num_rows, self.num_tokens, len(tokens)
        local = np.arange(first, first + n) - seq.base  # i64[n]
        pages = np.array([p.page_id for p in seq.pages], np.int32)
        self.gather[t:t + n] = np.arange(step_row, step_row + n)
        self.ids[t:t + n] = tokens
        self.positions[t:t + n] = np.arange(first, first + n)
        self.slots[t:t + n] = pages[local // page_size] * page_size + local % page_size
        self.tables[r, :len(pages)] = pages
        self.kv_lens[r] = local[-1] + 1
        self.cu_q_lens[r + 1:] = t + n
        self.last[r] = t + n - 1
        self.last_of[req_id] = (r, first + n - 1)
        self.num_rows, self.num_tokens = r + 1, t + n

    def arrays(self) -> tuple[np.ndarray, ...]:
        return (self.gather, self.ids, self.positions, self.slots, self.tables, self.kv_lens,
                self.cu_q_lens, self.last)
