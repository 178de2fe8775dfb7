"""Per-row sampling arrays (a pytree) and their host-side NumPy builder."""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxserve.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    SAMPLING_EPS,
    SamplingParams,
    device_seed,
    resolve_num_logprobs,
)
from jaxserve.structured.grammar import bitmask_width

# The top-logprobs width the sampler compiles for any request asking for up to this many
# (see `logprobs_bucket`); an engine whose `max_logprobs` is larger has one more width.
MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS
# Smallest padded width of the penalty / banned token id arrays.
MIN_TOKEN_IDS_LEN = 16
# Width of the banned token id array that warm-up compiles: stop and EOS ids banned below
# `min_tokens`. The engine refuses requests that would need more (no compile mid-serving).
MAX_BANNED_TOKEN_IDS = 64
# Widths of the logit-bias and allowed-id arrays in the compiled "full" sampler.
LOGIT_BIAS_LEN = 1 << (MAX_LOGIT_BIAS - 1).bit_length()
ALLOWED_LEN = MAX_ALLOWED_TOKEN_IDS


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature", "top_k", "top_p", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seeds", "counters",
                 "prompt_token_ids", "output_token_ids", "banned_token_ids",
                 "bias_token_ids", "bias_values", "allowed_token_ids", "restricted",
                 "token_bitmask"],
    meta_fields=["all_greedy", "needs_filtering", "has_penalties", "has_banned_tokens",
                 "max_num_logprobs", "needs_logprobs", "has_logit_controls",
                 "has_bitmask"],
)
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Sampling settings of R rows (R is a padded bucket size) as arrays.

    Data fields are traced: new temperatures, top-k/top-p/min-p values, penalties, seeds and
    counters reuse the compiled sampler. Meta fields are static and decide the program's
    shape: which stages exist and how many top logprobs are returned.

    Padded rows are greedy with every filter and penalty off and pad token ids, so they
    cost nothing and never touch real rows (every stage is row-wise).

    Token id arrays are padded with `vocab_size`, which the sampler's scatters drop
    (`mode="drop"`). They are None when their stage is off.

    Attributes:
        temperature: f32[R]; below 1e-5 means greedy.
        top_k: i32[R]; 0 means off.
        top_p: f32[R]; 1.0 means off.
        min_p: f32[R]; 0.0 means off.
        presence_penalty: f32[R]; 0.0 means off.
        frequency_penalty: f32[R]; 0.0 means off.
        repetition_penalty: f32[R]; 1.0 means off.
        seeds: u32[R]; the request's seed as `device_seed` maps it to 32 bits.
        counters: i32[R]; tokens the request generated so far. The row's random key is
            `fold_in(key(seed), counter)`, so a seeded request draws the same tokens
            whatever its row index and whatever else shares the batch.
        prompt_token_ids: i32[R, Lp] or None; for the repetition penalty.
        output_token_ids: i32[R, Lo] or None; for all three penalties.
        banned_token_ids: i32[R, Lb] or None; ids set to -inf before anything else (stop
            and EOS ids of rows that have not reached `min_tokens`, and the last token of
            each bad word whose other tokens end the output).
        bias_token_ids: i32[R, Lx] or None; `logit_bias` ids, padded with V.
        bias_values: f32[R, Lx] or None; the biases added to those ids' logits.
        allowed_token_ids: i32[R, La] or None; `allowed_token_ids`, padded with V.
        restricted: i32[R] or None; 1 where the row samples only its allowed ids.
        token_bitmask: i32[R, ceil(V / 32)] or None; structured outputs: bit `t % 32` of
            word `t // 32` set where token t is allowed (all ones for free rows).
        all_greedy: Static; every real row is greedy, so no random draws are compiled.
        needs_filtering: Static; some row uses top-k, top-p or min-p (compiles the filters).
        has_penalties: Static; the penalty arrays are present.
        has_banned_tokens: Static; `banned_token_ids` is present.
        max_num_logprobs: Static; top alternatives returned per row: 0, MAX_LOGPROBS or
            the engine's wide width (`logprobs_widths`), capped at V.
        needs_logprobs: Static; the sampled tokens' logprobs and ranks are computed (some
            row asked for logprobs). Off, the sampler skips the log-softmax over [R, V].
        has_logit_controls: Static; the logit-bias and allowed-id arrays are present.
        has_bitmask: Static; `token_bitmask` is present.
    """

    temperature: Any
    top_k: Any
    top_p: Any
    min_p: Any
    presence_penalty: Any
    frequency_penalty: Any
    repetition_penalty: Any
    seeds: Any
    counters: Any
    prompt_token_ids: Any = None
    output_token_ids: Any = None
    banned_token_ids: Any = None
    bias_token_ids: Any = None
    bias_values: Any = None
    allowed_token_ids: Any = None
    restricted: Any = None
    token_bitmask: Any = None
    all_greedy: bool = True
    needs_filtering: bool = False
    has_penalties: bool = False
    has_banned_tokens: bool = False
    max_num_logprobs: int = 0
    needs_logprobs: bool = True
    has_logit_controls: bool = False
    has_bitmask: bool = False

    @property
    def num_rows(self) -> int:
        """R, the padded number of rows."""
        return self.temperature.shape[0]


class RowSpec(NamedTuple):
    """One real row of a sampling batch.

    Attributes:
        params: The request's settings.
        prompt_token_ids: Its prompt (read only when repetition_penalty != 1).
        output_token_ids: Tokens it generated so far (read only when a penalty is on).
        seed: The seed to use; defaults to `params.seed`. NOTE: the engine draws a seed
            from its own seeded RNG at add_request for requests without one, so every
            random row has a seed; a random row with neither raises ValueError.
        counter: Tokens generated so far; defaults to `len(output_token_ids)`.
        token_bitmask: i32[ceil(V / 32)] or None; the tokens a structured-output
            constraint allows next (see `jaxserve.structured`).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    seed: int | None = None
    counter: int | None = None
    token_bitmask: np.ndarray | None = None


def logprobs_bucket(num_logprobs: int, wide: int | None = None) -> int:
    """Static top-logprobs width for a batch whose largest request is `num_logprobs`.

    NOTE: few buckets keep compile variants few: 0, MAX_LOGPROBS (top-k of 20 over the
    vocab costs little next to the model; rows asking for fewer are sliced on the host),
    and for more than that the engine's one wide width (`logprobs_widths`).

    Args:
        num_logprobs: The batch's largest request (a count: -1 already resolved).
        wide: The engine's wide width; None: `num_logprobs` itself (no engine to bound it).
    """
    if num_logprobs <= 0:
        return 0
    if num_logprobs <= MAX_LOGPROBS:
        return MAX_LOGPROBS
    return num_logprobs if wide is None else max(wide, num_logprobs)


def logprobs_widths(max_logprobs: int, vocab_size: int) -> tuple[int, ...]:
    """The top-logprobs widths an engine compiles: MAX_LOGPROBS, and when `max_logprobs`
    (-1: the whole vocabulary) is larger, one wide width (max_logprobs capped at V); each
    capped at V."""
    limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
    base = min(MAX_LOGPROBS, vocab_size)
    return (base,) if limit <= base else (base, limit)


def padded_len(n: int, minimum: int = MIN_TOKEN_IDS_LEN) -> int:
    """Smallest power of two >= max(n, minimum), to bound compile variants."""
    n = max(int(n), minimum, 1)
    return 1 << (n - 1).bit_length()


def pad_rows(id_lists: Mapping[int, Sequence[int]], num_rows: int, width: int,
             pad: int) -> np.ndarray:
    """i32[num_rows, width] holding `{row: ids}` left-aligned, padded with `pad`."""
    out = np.full((num_rows, width), pad, np.int32)
    for i, ids in id_lists.items():
        if ids is not None and len(ids):
            out[i, :len(ids)] = np.asarray(ids, np.int32)
    return out


def _pad_ids(id_lists: list[Sequence[int] | None], num_rows: int, width: int,
             pad: int) -> np.ndarray:
    """i32[num_rows, width] holding each list left-aligned, padded with `pad`."""
    return pad_rows(dict(enumerate(id_lists)), num_rows, width, pad)


def build_sampling_metadata(rows: Sequence[RowSpec | tuple], num_rows_padded: int,
                            vocab_size: int, *, eos_token_id: int | None = None,
                            prompt_len_padded: int | None = None,
                            output_len_padded: int | None = None,
                            wide_logprobs: int | None = None) -> SamplingMetadata:
    """Builds the NumPy sampling arrays of one step (the caller transfers them).

    Args:
        rows: One `RowSpec` (or a tuple of its fields) per real row, in row order.
        num_rows_padded: R, the request bucket; rows past `len(rows)` are padding.
        vocab_size: V; also the pad value of the token id arrays.
        eos_token_id: Banned together with `stop_token_ids` while a row (without
            `ignore_eos`) has generated fewer than `min_tokens` tokens.
        prompt_len_padded: Width Lp of `prompt_token_ids`; defaults to a power of two.
        output_len_padded: Width Lo of `output_token_ids`; defaults to a power of two.
        wide_logprobs: The engine's wide top-logprobs width (`logprobs_bucket`), if any.

    Returns:
        A SamplingMetadata of NumPy arrays and static flags.

    Raises:
        ValueError: More rows than `num_rows_padded`, a random row without a seed, or a
            padded width too small for the ids.
    """
    rows = [r if isinstance(r, RowSpec) else RowSpec(*r) for r in rows]
    num_real, num_rows = len(rows), int(num_rows_padded)
    if num_real > num_rows:
        raise ValueError(f"num_rows_padded={num_rows} is smaller than the {num_real} rows")
    params = [r.params for r in rows]
    # NOTE: one pass over the rows per group of fields (C-level attribute reads), then
    # column arithmetic: this runs every step for every running request.
    values = np.array(list(map(_COLUMN_VALUES, params)), np.float64).reshape(num_real, 7)
    columns = np.array(_COLUMN_PADS, np.float64).repeat(num_rows).reshape(7, num_rows)
    columns[:, :num_real] = values.T
    temperature, top_p, min_p, presence, frequency, repetition = (
        columns[i].astype(np.float32) for i in (0, 2, 3, 4, 5, 6))
    too_big = np.abs(values[:, 1]) > np.iinfo(np.int32).max
    if too_big.any():
        i = int(too_big.argmax())
        raise ValueError(f"row {i}: top_k={params[i].top_k} does not fit the sampler's int32")
    top_k = columns[1].astype(np.int32)
    top_k[top_k >= vocab_size] = 0  # NOTE: k >= V keeps everything, same as off

    seeds, counters = _seeds_and_counters(rows, num_rows)
    has_penalties = bool((values[:, 4:6] != 0.0).any() or (values[:, 6] != 1.0).any())
    prompt_ids = output_ids = None
    if has_penalties:
        prompt_ids, output_ids = _penalty_ids(rows, num_rows, vocab_size, prompt_len_padded,
                                              output_len_padded)
    banned_lists = [None] * num_real
    for i in [i for i, (low, bad) in enumerate(map(_BAN_FIELDS, params)) if low or bad]:
        # NOTE: only rows with min_tokens or bad words can ban anything
        banned_lists[i] = _banned_ids(rows[i], int(counters[i]), eos_token_id)
    has_banned = any(banned_lists)
    banned_ids = None
    if has_banned:
        banned_ids = _pad_ids(banned_lists, num_rows, _width("banned", None, banned_lists),
                              vocab_size)

    bias, allowed, logprobs = (zip(*map(_CONTROL_FIELDS, params), strict=True) if params
                               else ((), (), ()))
    controls = _logit_controls(params, num_rows, vocab_size) \
        if any(bias) or any(a is not None for a in allowed) else {}
    max_logprobs = max([resolve_num_logprobs(n, vocab_size) or 0 for n in logprobs],
                       default=0)
    bitmask = _bitmask(rows, num_rows, vocab_size)
    return SamplingMetadata(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        presence_penalty=presence, frequency_penalty=frequency,
        repetition_penalty=repetition, seeds=seeds, counters=counters,
        prompt_token_ids=prompt_ids, output_token_ids=output_ids, banned_token_ids=banned_ids,
        all_greedy=bool((values[:, 0] < SAMPLING_EPS).all()),
        needs_filtering=bool((top_k > 0).any() or (top_p < 1.0).any() or (min_p > 0.0).any()),
        has_penalties=has_penalties, has_banned_tokens=has_banned,
        max_num_logprobs=min(logprobs_bucket(max_logprobs, wide_logprobs), int(vocab_size)),
        needs_logprobs=any(n is not None for n in logprobs),
        has_logit_controls=bool(controls), **controls,
        token_bitmask=bitmask, has_bitmask=bitmask is not None)


# The per-row columns in SamplingMetadata order, and the values of their padded rows.
_COLUMN_VALUES = operator.attrgetter("temperature", "top_k", "top_p", "min_p",
                                     "presence_penalty", "frequency_penalty",
                                     "repetition_penalty")
_COLUMN_PADS = (0.0, 0, 1.0, 0.0, 0.0, 0.0, 1.0)
_BAN_FIELDS = operator.attrgetter("min_tokens", "bad_words_token_ids")
_CONTROL_FIELDS = operator.attrgetter("logit_bias", "allowed_token_ids", "logprobs")


def _bitmask(rows: list[RowSpec], num_rows: int, vocab_size: int) -> np.ndarray | None:
    """i32[R, ceil(V / 32)] token bitmask of the rows (all ones for unconstrained rows), or
    None when no row is constrained."""
    masks = {i: r.token_bitmask for i, r in enumerate(rows) if r.token_bitmask is not None}
    return pack_bitmasks(masks, num_rows, vocab_size) if masks else None


def pack_bitmasks(masks: Mapping[int, np.ndarray], num_rows: int,
                  vocab_size: int) -> np.ndarray:
    """i32[R, ceil(V / 32)]: `{row: i32[ceil(V / 32)]}` bitmasks, all ones elsewhere.

    Raises:
        ValueError: A mask of another width.
    """
    width = bitmask_width(vocab_size)
    out = np.full((num_rows, width), -1, np.int32)  # i32[R, W]
    for i, mask in masks.items():
        if np.shape(mask) != (width,):
            raise ValueError(f"row {i}: token_bitmask has shape {np.shape(mask)}, "
                             f"expected ({width},) for vocab_size {vocab_size}")
        out[i] = mask
    return out


def _banned_ids(row: RowSpec, counter: int, eos_token_id: int | None) -> list[int] | None:
    return row_banned_ids(row.params, row.output_token_ids, counter, eos_token_id)


def row_banned_ids(params: SamplingParams, output_token_ids: Sequence[int], counter: int,
                   eos_token_id: int | None) -> list[int] | None:
    """Ids banned for a row's next token: stop and EOS ids below `min_tokens`, and the last
    token of each bad word whose earlier tokens end the output (vLLM's rule).

    Args:
        params: The row's settings.
        output_token_ids: Its output so far (proposals before the row included).
        counter: Tokens generated before the row's token.
        eos_token_id: Banned with `stop_token_ids` (unless `ignore_eos`).

    Returns:
        The sorted ids, or None when nothing is banned.
    """
    p, out = params, output_token_ids
    banned = set(p.all_stop_token_ids(eos_token_id)) if counter < p.min_tokens else set()
    for seq in p.bad_words_token_ids or ():
        head = len(seq) - 1
        if head == 0 or (len(out) >= head
                         and [int(t) for t in out[len(out) - head:]] == list(seq[:-1])):
            banned.add(seq[-1])
    return sorted(banned) or None


def _logit_controls(params: list[SamplingParams], num_rows: int, vocab_size: int) -> dict:
    """The logit-bias and allowed-id arrays of the rows (padded with V)."""
    biases = [p.logit_bias or {} for p in params]
    width = _width("logit_bias", None, [list(b) for b in biases])
    bias_ids = _pad_ids([list(b) for b in biases], num_rows, width, vocab_size)
    bias_values = np.zeros((num_rows, width), np.float32)  # f32[R, Lx]
    for i, b in enumerate(biases):
        bias_values[i, :len(b)] = list(b.values())
    allowed = [p.allowed_token_ids for p in params]
    restricted = np.zeros((num_rows,), np.int32)  # i32[R]
    restricted[:len(params)] = [a is not None for a in allowed]
    return {"bias_token_ids": bias_ids, "bias_values": bias_values,
            "allowed_token_ids": _pad_ids(allowed, num_rows, _width("allowed", None, allowed),
                                          vocab_size),
            "restricted": restricted}


def _seeds_and_counters(rows: list[RowSpec], num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """u32[num_rows] seeds (`device_seed`) and i32[num_rows] counters of the rows.

    Raises:
        ValueError: A random row without a seed.
    """
    seeds = np.zeros((num_rows,), np.uint32)
    counters = np.zeros((num_rows,), np.int32)
    row_seeds = [r.params.seed if r.seed is None else r.seed for r in rows]
    if None in row_seeds:
        for i, (seed, r) in enumerate(zip(row_seeds, rows, strict=True)):
            if seed is None and not r.params.is_greedy:
                raise ValueError(f"row {i}: a random row needs a seed (the engine draws one "
                                 "at add_request for requests without seed), got seed=None")
        row_seeds = [0 if seed is None else seed for seed in row_seeds]
    seeds[:len(rows)] = [device_seed(int(seed)) for seed in row_seeds]
    counters[:len(rows)] = [len(r.output_token_ids) if r.counter is None else int(r.counter)
                            for r in rows]
    return seeds, counters


def _penalty_ids(rows: list[RowSpec], num_rows: int, vocab_size: int,
                 prompt_len_padded: int | None, output_len_padded: int | None):
    """(i32[R, Lp] prompt ids, i32[R, Lo] output ids) the penalties read, padded with V."""
    prompt_lists = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else None
                    for r in rows]
    output_lists = [r.output_token_ids if r.params.has_penalties else None for r in rows]
    prompt_ids = _pad_ids(prompt_lists, num_rows,
                          _width("prompt_len_padded", prompt_len_padded, prompt_lists),
                          vocab_size)
    output_ids = _pad_ids(output_lists, num_rows,
                          _width("output_len_padded", output_len_padded, output_lists),
                          vocab_size)
    return prompt_ids, output_ids


def _width(name: str, requested: int | None, id_lists: list[Sequence[int] | None]) -> int:
    """Padded width for `id_lists`: `requested` if given (checked), else a power of two."""
    longest = max((len(ids) for ids in id_lists if ids is not None), default=0)
    if requested is None:
        return padded_len(longest)
    if requested < longest:
        raise ValueError(f"{name}={requested} is shorter than the longest row ({longest})")
    return int(requested)
