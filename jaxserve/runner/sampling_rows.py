"""The runner's persistent sampling rows: one per request, written when it joins, gathered per step.

A request's sampling settings do not change while it runs, so they are written once, into
NumPy columns, the first time the request is scheduled (vLLM's persistent `InputBatch`).
A step gathers the rows of its scheduled requests with one NumPy indexing per column
block; only rows that read their output history (penalties, bad words, `min_tokens`) or
carry token lists (logit bias, allowed ids) touch per-row data, and their output tokens
are kept as a buffer extended by what is new since the last step. Rows are forgotten with
the block tables (`SchedulerOutput.released_request_ids`: finished, aborted, preempted,
swapped out) and written again when the request comes back. The arrays equal what
`build_sampling_metadata` builds from scratch (tests/runner/test_sampling_rows.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.request import Request
from jaxserve.sample.metadata import (
    SamplingMetadata,
    logprobs_bucket,
    pack_bitmasks,
    pad_rows,
    padded_len,
    row_banned_ids,
)
from jaxserve.sampling_params import SAMPLING_EPS, SamplingParams, resolve_num_logprobs

# Columns of `floats` (f32) and `ints` (i64) per row.
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(6)
_TOP_K, _SEED, _LOGPROBS, _FLAGS = range(4)
# Bits of the `_FLAGS` column.
_GREEDY, _PENALTIES, _REPETITION_ON, _MAY_BAN, _BAD_WORDS, _CONTROLS = (
    1 << i for i in range(6))
# The float columns of a row with every stage off (the padding and the inert row).
_FLOAT_PADS = (0.0, 1.0, 0.0, 0.0, 0.0, 1.0)
INERT_SLOT = 0  # a greedy row with every stage off: padding, and rows that failed to join


class SamplingRows:
    """Sampling rows kept between steps, by request id.

    Args:
        vocab_size: V; also the pad id of the token id arrays.
        eos_token_id: Banned with `stop_token_ids` below `min_tokens` (None: no EOS).
        num_rows: Rows to start with (more are added when requests outnumber them).
        wide_logprobs: The engine's wide top-logprobs width (`logprobs_widths`), for steps
            with a request asking for more than MAX_LOGPROBS; None: the request's count.
    """

    def __init__(self, vocab_size: int, eos_token_id: int | None = None, num_rows: int = 64,
                 wide_logprobs: int | None = None):
        self.vocab_size = int(vocab_size)
        self.eos_token_id = eos_token_id
        self.wide_logprobs = wide_logprobs
        n = max(2, num_rows + 1)
        self.floats = np.tile(np.array(_FLOAT_PADS, np.float32), (n, 1))  # f32[n, 6]
        self.ints = np.zeros((n, 4), np.int64)  # i64[n, 4]: top_k, seed, logprobs, flags
        self.ints[:, _LOGPROBS] = -1
        self.ints[:, _FLAGS] = _GREEDY
        self.slot_of: dict[str, int] = {}  # request id -> its row
        self._request: list[Request | None] = [None] * n  # the object each row was written for
        self._params: list[SamplingParams | None] = [None] * n
        self._prompt: list[np.ndarray | None] = [None] * n  # i32[prompt len]
        self._output: list[np.ndarray | None] = [None] * n  # i32[capacity]: output so far
        self._output_len = [0] * n
        self._seeds: list[tuple[int, ...]] = [(0,)] * n  # every completion's seed (fan-out)
        self._prompt_logprobs = [False] * n  # whether the row wants prompt logprobs
        self._prompt_k = [0] * n  # how many top prompt logprobs it wants (-1 resolved)
        self._num_prompt_logprobs = 0  # rows that do
        # (i32[b] logit-bias ids, f32[b] their biases, i32[a] allowed ids or None) of rows
        # with logit controls
        self._controls_of: list[tuple | None] = [None] * n
        self._free = list(range(n - 1, 0, -1))  # rows nobody holds (never the inert row)
        self._released_for: SchedulerOutput | None = None

    @property
    def num_kept(self) -> int:
        """Requests whose rows are kept."""
        return len(self.slot_of)

    @property
    def num_free(self) -> int:
        """Rows nobody holds (with `num_kept` and the inert row, every row: none is lost)."""
        return len(self._free)

    def release(self, out: SchedulerOutput) -> None:
        """Forgets the rows of `out.released_request_ids` (once per step: a second call with
        the same step does nothing, so rows written since stay)."""
        if out is self._released_for:
            return
        self._released_for = out
        for request_id in out.released_request_ids:
            slot = self.slot_of.pop(request_id, None)
            if slot is not None:
                self._clear(slot)

    def gather(self, out: SchedulerOutput, num_rows: int,
               params_of: Callable[[Request], SamplingParams],
               masks: dict[int, np.ndarray] | None = None, inert: Collection[str] = (),
               ) -> tuple[SamplingMetadata, dict[str, BaseException]]:
        """Joins the step's new requests and returns its sampling arrays, padded to `num_rows`.

        A scheduled entry has `num_samples + num_spec_tokens` rows, in `out.scheduled`
        order; row k of a fan-out entry (`num_samples > 1`) draws with the k-th
        completion's seed, and row k of a verifying entry samples after its first k
        proposals (its counter and output history include them).

        Args:
            out: The step (its `requests` hold the scheduled `Request` objects).
            num_rows: R, the sampling-row bucket.
            params_of: The sampling settings of a request, read when it joins.
            masks: `{row: i32[ceil(V / 32)]}` structured-output bitmasks of this step.
            inert: Requests that failed this step already: their rows are inert.

        Returns:
            (SamplingMetadata of NumPy arrays, `{request_id: error}` of requests whose rows
            could not be written; their rows are inert greedy ones).

        Raises:
            ValueError: More rows than `num_rows`.
        """
        self.release(out)
        failed: dict[str, BaseException] = {}
        sched, requests, slot_of, written = out.scheduled, out.requests, self.slot_of, \
            self._request
        slot_list = []
        for s in sched:  # NOTE: the one loop over the entries: a lookup each, mostly
            slot = slot_of.get(s.request_id)
            if slot is None or written[slot] is not requests.get(s.request_id):
                slot = self._slot(s.request_id, requests.get(s.request_id), params_of, failed)
            slot_list.append(slot)
        if inert:
            slot_list = [INERT_SLOT if s.request_id in inert else slot
                         for s, slot in zip(sched, slot_list, strict=True)]
        slots = np.array(slot_list, np.int64)  # i64[entries]
        counts = np.array([s.num_samples + s.num_spec_tokens for s in sched],
                          np.int64)  # i64[entries]: rows of each entry
        counters = np.array([s.sampling_counter for s in sched], np.int64)  # i64[entries]
        counters[slots == INERT_SLOT] = 0  # inert rows are all alike
        # entries whose rows are not copies of one row (fan-out, proposals)
        odd = np.flatnonzero(counts > 1).tolist()
        num_real = int(counts.sum())
        if num_real > num_rows:
            raise ValueError(f"num_rows_padded={num_rows} is smaller than the {num_real} rows")
        row_slots = np.full(num_rows, INERT_SLOT, np.int64)  # i64[R]
        row_slots[:num_real] = np.repeat(slots, counts)
        row_counters = np.zeros(num_rows, np.int32)  # i32[R]
        row_counters[:num_real] = np.repeat(counters, counts)
        floats, ints = self.floats[row_slots], self.ints[row_slots]  # f32[R, 6], i64[R, 4]
        seeds = ints[:, _SEED].astype(np.uint32)  # u32[R]
        starts = np.cumsum(counts) - counts  # i64[entries]: each entry's first row
        for i in odd:
            s, first = sched[i], int(starts[i])
            if int(slots[i]) == INERT_SLOT:
                continue
            k = np.arange(counts[i])
            if s.num_samples > 1:  # fan-out: one seed per completion
                seeds[first:first + counts[i]] = self._seeds[slots[i]][:counts[i]]
            elif s.num_spec_tokens:  # row k samples output position counter + k
                row_counters[first:first + counts[i]] += k.astype(np.int32)
        flags = ints[:, _FLAGS]
        top_k, top_p, min_p = ints[:, _TOP_K].astype(np.int32), floats[:, _TOP_P], floats[:, _MIN_P]
        logprobs = ints[:num_real, _LOGPROBS]
        has_penalties = bool((flags & _PENALTIES).any())
        md = dict(
            temperature=floats[:, _TEMPERATURE].copy(), top_k=top_k, top_p=top_p.copy(),
            min_p=min_p.copy(), presence_penalty=floats[:, _PRESENCE].copy(),
            frequency_penalty=floats[:, _FREQUENCY].copy(),
            repetition_penalty=floats[:, _REPETITION].copy(), seeds=seeds,
            counters=row_counters, all_greedy=bool((flags & _GREEDY).all()),
            needs_filtering=bool((top_k > 0).any() or (top_p < 1.0).any()
                                 or (min_p > 0.0).any()),
            has_penalties=has_penalties,
            max_num_logprobs=min(logprobs_bucket(int(logprobs.max(initial=0)),
                                                 self.wide_logprobs), self.vocab_size),
            needs_logprobs=bool((logprobs >= 0).any()))
        special = np.flatnonzero(flags[:num_real] & (_PENALTIES | _BAD_WORDS))
        history = self._histories(sched, starts, counts, slots, out, special)
        if has_penalties:
            md.update(self._penalty_ids(row_slots, flags, history, num_rows))
        md.update(self._banned(row_slots, flags, row_counters, history, num_rows))
        if (flags[:num_real] & _CONTROLS).any():
            md.update(self._controls(row_slots[:num_real], flags[:num_real], num_rows))
        if masks:
            md.update(self._bitmask(masks, num_rows))
        return SamplingMetadata(**md), failed

    def prompt_targets(self, out: SchedulerOutput, token_starts: np.ndarray) -> np.ndarray | None:
        """i32[step tokens]: the next prompt token at each position of the kept requests that
        asked for prompt logprobs (-1 elsewhere), or None when none did.

        Args:
            out: The step.
            token_starts: i32[>= entries]: each entry's first token in the step.
        """
        if not self._num_prompt_logprobs:
            return None
        wanted = [(i, s, slot) for i, s in enumerate(out.scheduled)
                  if (slot := self.slot_of.get(s.request_id)) is not None
                  and self._prompt_logprobs[slot]
                  and self._request[slot] is out.requests.get(s.request_id)]
        if not wanted:
            return None  # NOTE: the common case, without an array per request
        targets = np.full(out.total_num_scheduled_tokens, -1, np.int32)  # i32[tokens]
        hit = False
        for i, s, slot in wanted:
            prompt = self._prompt[slot]
            pos = np.arange(s.start_pos, s.start_pos + s.num_new_tokens)
            keep = pos + 1 < len(prompt)
            t = int(token_starts[i])
            targets[t:t + s.num_new_tokens][keep] = prompt[pos[keep] + 1]
            hit |= bool(keep.any())
        return targets if hit else None

    def prompt_logprobs_width(self, out: SchedulerOutput) -> int:
        """The most top prompt logprobs a kept, scheduled request of `out` asked for (0 when
        none asked): the step's prompt-logprobs program width is the bucket of it."""
        return max((self._prompt_k[slot] for s in out.scheduled
                    if (slot := self.slot_of.get(s.request_id)) is not None
                    and self._prompt_logprobs[slot]), default=0)

    # ------------------------------------------------------------- joining
    def _slot(self, request_id: str, req: Request | None, params_of, failed: dict) -> int:
        """The request's row, written now if it has none (or one of an earlier request of
        the same id); the inert row when it cannot be written."""
        slot = self.slot_of.get(request_id)
        if slot is not None and self._request[slot] is req:
            return slot
        if slot is not None:
            self._clear(self.slot_of.pop(request_id))
        if req is None:
            return INERT_SLOT  # a hand-built step's entry: no request to read
        slot = self._take_row()
        try:
            self._write(slot, req, params_of(req))
        except Exception as e:  # noqa: BLE001 - this request fails, not the step
            self._clear(slot)
            failed[request_id] = e
            return INERT_SLOT
        self.slot_of[request_id] = slot
        return slot

    def _write(self, slot: int, req: Request, p: SamplingParams) -> None:
        """Row `slot` becomes `req`'s settings (its static fields, written once)."""
        seed = req.seeds[req.sample_index]
        if seed is None and not p.is_greedy:
            raise ValueError("a random row needs a seed (the engine draws one at add_request "
                             "for requests without seed), got seed=None")
        if abs(p.top_k) > np.iinfo(np.int32).max:
            raise ValueError(f"top_k={p.top_k} does not fit the sampler's int32")
        top_k = int(p.top_k)
        self._request[slot], self._params[slot] = req, p
        self._clear_history(slot)
        self.floats[slot] = (p.temperature, p.top_p, p.min_p, p.presence_penalty,
                             p.frequency_penalty, p.repetition_penalty)
        flags = ((_GREEDY if p.temperature < SAMPLING_EPS else 0)
                 | (_PENALTIES if p.has_penalties else 0)
                 | (_REPETITION_ON if p.repetition_penalty != 1.0 else 0)
                 | (_MAY_BAN if p.min_tokens or p.bad_words_token_ids else 0)
                 | (_BAD_WORDS if p.bad_words_token_ids else 0)
                 | (_CONTROLS if p.logit_bias or p.allowed_token_ids is not None else 0))
        self.ints[slot] = (0 if top_k >= self.vocab_size else top_k,
                           int(seed or 0) & 0xFFFFFFFF,
                           -1 if p.logprobs is None
                           else resolve_num_logprobs(p.logprobs, self.vocab_size), flags)
        self._seeds[slot] = tuple(int(x or 0) & 0xFFFFFFFF for x in req.seeds)
        self._prompt_logprobs[slot] = p.prompt_logprobs is not None and req.sample_index == 0
        self._prompt_k[slot] = resolve_num_logprobs(p.prompt_logprobs or 0, self.vocab_size)
        self._num_prompt_logprobs += self._prompt_logprobs[slot]
        if flags & _CONTROLS:
            bias = p.logit_bias or {}
            self._controls_of[slot] = (
                np.array(list(bias), np.int32), np.array(list(bias.values()), np.float32),
                None if p.allowed_token_ids is None
                else np.array(p.allowed_token_ids, np.int32))
        if p.repetition_penalty != 1.0 or self._prompt_logprobs[slot]:
            self._prompt[slot] = np.asarray(req.prompt_token_ids, np.int32)

    # ------------------------------------------------------------ per row
    def _history(self, slot: int, tokens: list[int]) -> np.ndarray:
        """i32[n] the output so far of the row's request: the kept buffer, extended by the
        tokens new since the last step (cut back where the request's output is shorter)."""
        n, have = len(tokens), self._output_len[slot]
        buf = self._output[slot]
        if n > have:
            if buf is None or len(buf) < n:
                grown = np.empty(max(16, 2 * n), np.int32)
                if buf is not None:
                    grown[:have] = buf[:have]
                self._output[slot] = buf = grown
            buf[have:n] = tokens[have:]
        self._output_len[slot] = n
        return buf[:n] if buf is not None else np.zeros(0, np.int32)

    def _histories(self, sched, starts, counts, slots, out, rows) -> dict[int, np.ndarray]:
        """`{row: i32[n] output history}` of the rows that read it (proposals included)."""
        if not len(rows):
            return {}
        entry_of = np.searchsorted(starts, rows, side="right") - 1  # i64[rows]
        history: dict[int, np.ndarray] = {}
        for row, i in zip(rows.tolist(), entry_of.tolist(), strict=True):
            s, slot = sched[i], int(slots[i])
            base = self._history(slot, out.requests[s.request_id].output_token_ids)
            k = row - int(starts[i])
            if s.num_spec_tokens and k:
                base = np.concatenate([base, np.asarray(s.spec_token_ids[:k], np.int32)])
            history[row] = base
        return history

    def _penalty_ids(self, row_slots, flags, history, num_rows) -> dict:
        """(i32[R, Lp] prompt ids, i32[R, Lo] output ids) the penalties read, padded with V."""
        prompt_rows = np.flatnonzero(flags & _REPETITION_ON)
        output_rows = np.flatnonzero(flags & _PENALTIES)
        prompts = {r: self._prompt[row_slots[r]] for r in prompt_rows.tolist()}
        outputs = {r: history[r] for r in output_rows.tolist()}
        return {"prompt_token_ids": self._pad(prompts, num_rows),
                "output_token_ids": self._pad(outputs, num_rows)}

    def _banned(self, row_slots, flags, counters, history, num_rows) -> dict:
        """The banned-id array and flag: stop and EOS ids below `min_tokens`, bad words."""
        lists = {}
        for r in np.flatnonzero(flags & _MAY_BAN).tolist():
            ids = row_banned_ids(self._params[row_slots[r]], history.get(r, ()),
                                 int(counters[r]), self.eos_token_id)
            if ids:
                lists[r] = ids
        if not lists:
            return {"has_banned_tokens": False}
        return {"has_banned_tokens": True, "banned_token_ids": self._pad(lists, num_rows)}

    def _controls(self, row_slots, flags, num_rows) -> dict:
        """The logit-bias and allowed-id arrays of the rows (padded with V)."""
        controls = {r: self._controls_of[row_slots[r]]
                    for r in np.flatnonzero(flags & _CONTROLS).tolist()}
        bias_ids = self._pad({r: c[0] for r, c in controls.items()}, num_rows)
        bias_values = np.zeros(bias_ids.shape, np.float32)  # f32[R, Lx]
        for r, c in controls.items():
            bias_values[r, :len(c[1])] = c[1]
        allowed = {r: c[2] for r, c in controls.items() if c[2] is not None}
        restricted = np.zeros((num_rows,), np.int32)  # i32[R]
        restricted[list(allowed)] = 1
        return {"has_logit_controls": True, "bias_token_ids": bias_ids,
                "bias_values": bias_values, "allowed_token_ids": self._pad(allowed, num_rows),
                "restricted": restricted}

    def _bitmask(self, masks: dict[int, np.ndarray], num_rows: int) -> dict:
        return {"has_bitmask": True,
                "token_bitmask": pack_bitmasks(masks, num_rows, self.vocab_size)}

    def _pad(self, id_lists: dict, num_rows: int) -> np.ndarray:
        """i32[num_rows, padded width] of `{row: ids}` left-aligned, padded with V."""
        width = padded_len(max((len(ids) for ids in id_lists.values()), default=0))
        return pad_rows(id_lists, num_rows, width, self.vocab_size)

    # ------------------------------------------------------------ storage
    def _clear_history(self, slot: int) -> None:
        self._output[slot], self._output_len[slot], self._prompt[slot] = None, 0, None

    def _clear(self, slot: int) -> None:
        self._request[slot] = self._params[slot] = None
        self._clear_history(slot)
        self.floats[slot] = _FLOAT_PADS
        self.ints[slot] = (0, 0, -1, _GREEDY)
        self._num_prompt_logprobs -= self._prompt_logprobs[slot]
        self._seeds[slot], self._prompt_logprobs[slot], self._prompt_k[slot] = (0,), False, 0
        self._controls_of[slot] = None
        self._free.append(slot)

    def _take_row(self) -> int:
        if not self._free:  # NOTE: rows are a few bytes; double them rather than fail
            n = len(self.floats)
            self.floats = np.concatenate([self.floats, np.tile(self.floats[INERT_SLOT], (n, 1))])
            self.ints = np.concatenate([self.ints, np.tile(self.ints[INERT_SLOT], (n, 1))])
            for column in (self._request, self._params, self._prompt, self._output,
                           self._controls_of):
                column.extend([None] * n)
            self._output_len.extend([0] * n)
            self._seeds.extend([(0,)] * n)
            self._prompt_logprobs.extend([False] * n)
            self._prompt_k.extend([0] * n)
            self._free = list(range(2 * n - 1, n - 1, -1))
        return self._free.pop()
