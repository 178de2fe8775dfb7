"""Reproducibility checks (`jaxserve verify`): a prompt set's greedy tokens and raw logprobs
from two runs (each prompt alone vs in a crowded batch, or two attention backends), every
divergence classified as a near-tie or a real difference.

A record is one output position: the greedy token and the top-K raw logprobs (vLLM's
"raw_logprobs": log-softmax of the model's logits), compared bit for bit. At the first
position where two runs differ, the reference run's top-2 logprob gap (equal to the top-2
logit gap) says what kind of divergence it is: "near-tie" (a different token where the two
best were within `epsilon`: float32 noise in a different arithmetic order may flip it),
"real" (a different token where the top-2 gap is wider), or "logprobs" (the same tokens
with different logprob bits; harmless in the default mode, a failure under
`batch_invariant`, which promises identical bits).
"""

from __future__ import annotations

import dataclasses
import random

from jaxserve.sampling_params import SamplingParams

KINDS = ("identical", "near-tie", "logprobs", "real")
CHAT = "chat:"  # a prompt starting so is rendered through the chat template
# Eight prompts of different kinds: chat-templated, code, long, non-English.
DEFAULT_PROMPTS = (
    CHAT + "Name three fruits and say which one is the sweetest.",
    CHAT + "Wie spät ist es in Tokio, wenn es in Berlin Mittag ist?",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n",
    "#include <stdio.h>\nint main(void) {\n    for (int i = 0; i < 10; ++i)",
    "The history of the city begins with a small fishing village on the river bank. Over "
    "the centuries, merchants arrived from distant lands, bringing spices, silk and new "
    "ideas. The village grew into a town with a market square, a stone bridge and a "
    "cathedral whose bells could be heard for miles. During the industrial era, factories "
    "rose along the water, and workers from the countryside filled new neighborhoods of "
    "brick houses. Today the city is known for its museums, its universities and its "
    "festivals. In summary, the city's story is one of",
    "北京是中国的首都，也是一座历史悠久的城市。",
    "Москва — столица России, а Санкт-Петербург",
    "1, 1, 2, 3, 5, 8, 13,",
)


@dataclasses.dataclass(frozen=True)
class Divergence:
    """How one prompt's two runs compare.

    Attributes:
        index: The prompt's index in the set.
        kind: One of `KINDS`.
        position: The first output position that differs (None when identical).
        gap: The reference run's top-1 minus top-2 logprob there (None when identical).
        max_abs: Largest difference of a logprob both runs list there (0 when none).
    """

    index: int
    kind: str
    position: int | None = None
    gap: float | None = None
    max_abs: float = 0.0


def prompt_ids(tokenizer, texts) -> list[list[int]]:
    """Token ids of each prompt text (`CHAT`-prefixed ones through the chat template)."""
    out = []
    for text in texts:
        if text.startswith(CHAT):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text[len(CHAT):]}], add_generation_prompt=True,
                tokenize=True, return_dict=False)
        else:
            ids = tokenizer(text).input_ids
        out.append(list(ids))
    return out


def random_prompts(count: int, vocab_size: int, seed: int = 0, max_len: int = 100
                   ) -> list[list[int]]:
    """`count` prompts of random token ids (lengths 1 to `max_len`): the crowd."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(rng.randint(1, max_len))]
            for _ in range(count)]


def records(outputs) -> list[list[tuple]]:
    """Per request: per output position (token id, ((id, logprob), ...) sorted by id)."""
    return [[(tok, tuple(sorted((i, lp.logprob) for i, lp in d.items())))
             for tok, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
            for o in outputs]


def greedy_params(max_tokens: int, num_logprobs: int = 5) -> SamplingParams:
    """Greedy decoding that returns `num_logprobs` (at least 2) raw logprobs per token."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          logprobs=max(2, num_logprobs))


def run_alone(llm, prompts, params) -> list[list[tuple]]:
    """Each prompt in a `generate` call of its own."""
    return [records(llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False))[0]
            for p in prompts]


def run_crowded(llm, prompts, others, params, seed: int = 0) -> list[list[tuple]]:
    """The prompts shuffled among `others` in one `generate` call; the prompts' records."""
    batch = [(i, p) for i, p in enumerate(prompts)] + [(None, p) for p in others]
    random.Random(seed).shuffle(batch)
    outs = records(llm.generate([{"prompt_token_ids": p} for _, p in batch], params,
                                use_tqdm=False))
    got = {i: r for (i, _), r in zip(batch, outs, strict=True) if i is not None}
    return [got[i] for i in range(len(prompts))]


def classify(index: int, ref: list[tuple], other: list[tuple], epsilon: float) -> Divergence:
    """Compares two runs of one prompt (`records` rows; `ref` the reference run).

    Raises:
        ValueError: `epsilon` is negative.
    """
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}")
    if ref == other:
        return Divergence(index, "identical")
    pos = next((i for i, (a, b) in enumerate(zip(ref, other, strict=False)) if a != b),
               min(len(ref), len(other)))
    if pos >= min(len(ref), len(other)):  # one run stopped earlier: a different token
        return Divergence(index, "real", pos)
    (tok_a, lps_a), (tok_b, lps_b) = ref[pos], other[pos]
    best = sorted((lp for _, lp in lps_a), reverse=True)
    gap = best[0] - best[1] if len(best) > 1 else float("inf")
    b = dict(lps_b)
    shared = [abs(lp - b[i]) for i, lp in lps_a if i in b]
    max_abs = max(shared, default=0.0)
    if tok_a == tok_b:
        return Divergence(index, "logprobs", pos, gap, max_abs)
    return Divergence(index, "near-tie" if gap < epsilon else "real", pos, gap, max_abs)


def compare(ref_runs, other_runs, epsilon: float) -> list[Divergence]:
    """`classify` of every prompt."""
    return [classify(i, a, b, epsilon)
            for i, (a, b) in enumerate(zip(ref_runs, other_runs, strict=True))]


def failed(divergences: list[Divergence], strict: bool) -> bool:
    """Whether the check fails: a real difference, or under `strict` (bitwise promised)
    any divergence."""
    bad = ("near-tie", "logprobs", "real") if strict else ("real",)
    return any(d.kind in bad for d in divergences)


def summary(divergences: list[Divergence], epsilon: float, what: str) -> str:
    """Lines for people: one per divergent prompt, then the counts."""
    lines = []
    for d in divergences:
        if d.kind == "identical":
            continue
        where = f"output token {d.position}"
        gap = "" if d.gap is None else f", top-2 logprob gap {d.gap:.3g}"
        lines.append(f"prompt {d.index}: {d.kind} at {where}{gap}, "
                     f"max |logprob difference| {d.max_abs:.3g}")
    counts = {k: sum(d.kind == k for d in divergences) for k in KINDS}
    lines.append(f"{what}: " + ", ".join(f"{counts[k]} {k}" for k in KINDS)
                 + f" of {len(divergences)} prompts (near-tie: top-2 gap < {epsilon:g})")
    return "\n".join(lines)
