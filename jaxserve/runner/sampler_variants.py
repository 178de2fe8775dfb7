"""Folds the sampler's static flags into three compiled variants per request bucket.

`build_sampling_metadata` sets five static flags; compiled naively that is 32 programs
per bucket. The runner instead promotes each step to one of three variants:

    "greedy":   every row greedy, no penalties, banned tokens or logprobs.
    "sample":   random rows with top-k/top-p/min-p filtering; nothing else.
    "full":     everything on (filtering, penalties, banned tokens, logit bias and allowed
                ids, structured-output bitmask, the sampled tokens' logprobs and 20 top
                logprobs, or the engine's wide width where a request asks for more).

Promotion only adds stages that are identities for rows that do not use them (penalty 0,
repetition 1, pad token ids, top-k 0, top-p 1), so every variant samples the same tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.sample.metadata import (
    ALLOWED_LEN,
    LOGIT_BIAS_LEN,
    MAX_LOGPROBS,
    SamplingMetadata,
)
from jaxserve.structured.grammar import bitmask_width

VARIANTS = ("greedy", "sample", "full")


def variant_of(md: SamplingMetadata) -> str:
    """The cheapest variant that covers every stage `md` needs."""
    if md.has_penalties or md.has_banned_tokens or md.max_num_logprobs \
            or md.needs_logprobs or md.has_logit_controls or md.has_bitmask:
        return "full"
    if md.all_greedy and not md.needs_filtering:
        return "greedy"
    return "sample"


def promote(md: SamplingMetadata, variant: str, vocab_size: int, penalty_len: int,
            banned_len: int) -> SamplingMetadata:
    """Returns `md` with the static flags (and arrays) of `variant`.

    Args:
        md: Metadata as built for this step (NumPy arrays).
        variant: One of VARIANTS, at least as capable as `variant_of(md)`.
        vocab_size: Pad id of the token id arrays.
        penalty_len: Width of the prompt/output id arrays in "full".
        banned_len: Width of the banned id array in "full" (grown, at the cost of a
            compile, for a step that bans more ids).

    Raises:
        ValueError: `variant` lacks a stage `md` needs.
    """
    need = VARIANTS.index(variant_of(md))
    if VARIANTS.index(variant) < need:
        raise ValueError(f"variant {variant!r} cannot serve a step that needs "
                         f"{variant_of(md)!r}")
    if variant == "greedy":
        return md
    if variant == "sample":
        return dataclasses.replace(md, all_greedy=False, needs_filtering=True)
    num_rows = md.temperature.shape[0]

    def widen(ids: np.ndarray | None, width: int) -> np.ndarray:
        if ids is not None and ids.shape[1] > width:
            if (ids[:, width:] != vocab_size).any():
                # NOTE: wider than warm-up compiled (say, a min_tokens request with many
                # stop_token_ids): a one-off compile of this width, not a failed step.
                width = ids.shape[1]
            else:
                ids = ids[:, :width]  # the extra columns are padding only
        out = np.full((num_rows, width), vocab_size, np.int32)  # i32[num_rows, width]
        if ids is not None:
            out[:, :ids.shape[1]] = ids
        return out

    bias_values = np.zeros((num_rows, LOGIT_BIAS_LEN), np.float32)  # f32[R, Lx]
    if md.bias_values is not None:
        bias_values[:, :md.bias_values.shape[1]] = md.bias_values
    restricted = md.restricted if md.restricted is not None \
        else np.zeros((num_rows,), np.int32)  # i32[R]
    bitmask = md.token_bitmask if md.token_bitmask is not None \
        else np.full((num_rows, bitmask_width(vocab_size)), -1, np.int32)  # i32[R, W]
    return dataclasses.replace(
        md, all_greedy=False, needs_filtering=True, has_penalties=True,
        has_banned_tokens=True,
        # NOTE: a step with a request above MAX_LOGPROBS keeps the engine's wide width.
        max_num_logprobs=max(md.max_num_logprobs, min(MAX_LOGPROBS, vocab_size)),
        needs_logprobs=True,
        prompt_token_ids=widen(md.prompt_token_ids, penalty_len),
        output_token_ids=widen(md.output_token_ids, penalty_len),
        banned_token_ids=widen(md.banned_token_ids, banned_len),
        has_logit_controls=True, bias_token_ids=widen(md.bias_token_ids, LOGIT_BIAS_LEN),
        bias_values=bias_values, restricted=restricted,
        allowed_token_ids=widen(md.allowed_token_ids, ALLOWED_LEN),
        has_bitmask=True, token_bitmask=bitmask)
