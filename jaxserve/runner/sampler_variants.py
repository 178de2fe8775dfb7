"""Folds the sampler's static flags into three compiled variants per request bucket.

`build_sampling_metadata` sets five static flags; compiled naively that is 32 programs
per bucket. The runner instead promotes each step to one of three variants:

    "greedy":   every row greedy, no penalties, banned tokens or logprobs.
    "sample":   random rows with top-k/top-p/min-p filtering; nothing else.
    "full":     everything on (filtering, penalties, banned tokens, 20 logprobs).

Promotion only adds stages that are identities for rows that do not use them (penalty 0,
repetition 1, pad token ids, top-k 0, top-p 1), so every variant samples the same tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.sample.metadata import MAX_LOGPROBS, SamplingMetadata

VARIANTS = ("greedy", "sample", "full")


def variant_of(md: SamplingMetadata) -> str:
    """The cheapest variant that covers every stage `md` needs."""
    if md.has_penalties or md.has_banned_tokens or md.max_num_logprobs:
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
        penalty_len: Fixed width of the prompt/output id arrays in "full".
        banned_len: Fixed width of the banned id array in "full".

    Raises:
        ValueError: `variant` lacks a stage `md` needs, or the ids exceed a fixed width.
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

    def widen(ids: np.ndarray | None, width: int, name: str) -> np.ndarray:
        out = np.full((num_rows, width), vocab_size, np.int32)  # i32[num_rows, width]
        if ids is not None:
            if ids.shape[1] > width:
                # Columns past the fixed width must be padding only.
                if (ids[:, width:] != vocab_size).any():
                    raise ValueError(f"{name} needs {ids.shape[1]} columns, over {width}")
                ids = ids[:, :width]
            out[:, :ids.shape[1]] = ids
        return out

    return dataclasses.replace(
        md, all_greedy=False, needs_filtering=True, has_penalties=True,
        has_banned_tokens=True, max_num_logprobs=min(MAX_LOGPROBS, vocab_size),
        prompt_token_ids=widen(md.prompt_token_ids, penalty_len, "prompt_token_ids"),
        output_token_ids=widen(md.output_token_ids, penalty_len, "output_token_ids"),
        banned_token_ids=widen(md.banned_token_ids, banned_len, "banned_token_ids"))
