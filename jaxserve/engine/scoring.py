"""Scoring and classification inputs in vLLM's shape: `LLM.score`'s pairs (a cross-encoder's
pair packed as one prompt with BERT's token types, or two embeddings' cosine),
`truncate_prompt_tokens`, and the scores of embedding pairs."""

from __future__ import annotations

import numpy as np

from jaxserve.outputs import EmbeddingRequestOutput, ScoringOutput, ScoringRequestOutput


def score_pairs(data_1, data_2) -> list[tuple]:
    """vLLM's pairing of `LLM.score`'s inputs: one text against each of `data_2` (1 to N),
    or the i-th with the i-th (N to N); a text may be a string or a prompt.

    Raises:
        ValueError: No `data_2`, or lists of other lengths than 1 to N or N to N.
    """
    one = (str, dict)
    first = [data_1] if isinstance(data_1, one) else list(data_1)
    second = [data_2] if isinstance(data_2, one) else list(data_2)
    if not first or not second:
        raise ValueError("data_1 and data_2 must each hold at least one text")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"data_1 has {len(first)} texts and data_2 {len(second)}: score "
                         "pairs one text with each of data_2, or the i-th with the i-th")
    return list(zip(first, second, strict=True))


def check_truncation(truncate_prompt_tokens, max_model_len: int) -> int | None:
    """The token count `truncate_prompt_tokens` keeps (-1: the longest prompt the engine
    takes, `max_model_len - 1`), or None (no truncation).

    Raises:
        ValueError: Not None, -1 or a positive integer, or above `max_model_len - 1`.
    """
    k = truncate_prompt_tokens
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int) or k == 0 or k < -1:
        raise ValueError(f"truncate_prompt_tokens must be -1 or a positive integer, got {k!r}")
    limit = max_model_len - 1  # NOTE: the engine takes prompts shorter than max_model_len
    if k > limit:
        raise ValueError(f"truncate_prompt_tokens={k} exceeds the longest prompt this engine "
                         f"takes ({limit}: max_model_len {max_model_len} - 1)")
    return limit if k == -1 else k


def truncated(tokenizer, prompt, keep: int | None):
    """`prompt` cut to `keep` tokens: a text by the tokenizer (its truncation side, special
    tokens kept, as vLLM's `truncation=True, max_length=keep`), token ids to their last
    `keep` (vLLM's); None keeps it whole."""
    if keep is None:
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" not in prompt and "prompt" in prompt:
        prompt = prompt["prompt"]
    if isinstance(prompt, str):
        return {"prompt_token_ids": tokenizer(prompt, truncation=True, max_length=keep).input_ids,
                "prompt": prompt}
    if isinstance(prompt, dict):
        return {**prompt, "prompt_token_ids": list(prompt["prompt_token_ids"])[-keep:]}
    return list(prompt)[-keep:]


def rule_token_types(ids: list[int], encoder) -> list[int]:
    """The token types `models.encoder.token_types` gives a sequence of `ids` (1 after its
    first separator when `encoder.pair_token_types`, else 0)."""
    if encoder is None or not encoder.pair_token_types:
        return [0] * len(ids)
    seps = np.cumsum(np.asarray(ids) == encoder.sep_token_id)
    return [int(x) for x in (seps - (np.asarray(ids) == encoder.sep_token_id) > 0)]


def pair_prompt(tokenizer, encoder, text_1: str, text_2: str, keep: int | None) -> dict:
    """A cross-encoder's pair as one prompt: the tokenizer's pair encoding (BERT's
    `[CLS] a [SEP] b [SEP]`, RoBERTa's `<s> a </s></s> b </s>`), cut to `keep` tokens
    (longest text first, as the tokenizer's `truncation=True` does).

    Raises:
        ValueError: A text that is not a string, or token types the tokenizer gives that an
            encoder would not read the same (`text_1` holding the separator token; in
            `text_2` it is read as the tokenizer types it).
    """
    for name, text in (("text_1", text_1), ("text_2", text_2)):
        if not isinstance(text, str):
            raise ValueError(f"{name}: a cross-encoder scores texts, got {type(text).__name__}")
    kwargs = {"truncation": True, "max_length": keep} if keep is not None else {}
    enc = tokenizer(text_1, text_2, return_token_type_ids=True, **kwargs)
    ids = list(enc["input_ids"])
    given = list(enc.get("token_type_ids") or [0] * len(ids))
    # NOTE: only BERT reads token types (RoBERTa's table has one row, ModernBERT none).
    reads_types = encoder is not None and encoder.family == "bert" and encoder.type_vocab_size > 1
    if reads_types and given != rule_token_types(ids, encoder):
        raise ValueError("text_1 holds the separator token (or the tokenizer's token types are "
                         "not BERT's pair layout): the model reads a pair's second segment "
                         "from the first separator on")
    return {"prompt_token_ids": ids, "prompt": f"{text_1}\n{text_2}"}


def score_prompt(tokenizer, model, text_1: str, text_2: str, keep: int | None) -> dict:
    """A classifier's pair as one prompt, as vLLM builds it: the tokenizer's pair encoding
    (`pair_prompt`) for a cross-encoder, the two texts concatenated for an LLM reranker
    (`use_pad_token=False`, `models.seq_cls_convert`: the user's own prompt format, cut to
    `keep` tokens by the tokenizer).

    Raises:
        ValueError: As `pair_prompt`'s.
    """
    if getattr(model, "use_pad_token", True):
        return pair_prompt(tokenizer, getattr(model, "encoder", None), text_1, text_2, keep)
    for name, text in (("text_1", text_1), ("text_2", text_2)):
        if not isinstance(text, str):
            raise ValueError(f"{name}: a reranker scores texts, got {type(text).__name__}")
    kwargs = {"truncation": True, "max_length": keep} if keep is not None else {}
    return {"prompt_token_ids": list(tokenizer(text_1 + text_2, **kwargs).input_ids),
            "prompt": text_1 + text_2}


def cosine_scores(pairs: list[tuple[EmbeddingRequestOutput, EmbeddingRequestOutput]]
                  ) -> list[ScoringRequestOutput]:
    """Each pair of embeddings' cosine similarity as a `ScoringRequestOutput` (id
    `"{id_1}_{id_2}"`, both prompts' ids, as vLLM's embedding-model scores)."""
    out = []
    for a, b in pairs:
        error = a.error or b.error
        score = float("nan")
        if error is None:
            x, y = (np.asarray(e.outputs.embedding, np.float64) for e in (a, b))
            score = float(x @ y / max(np.linalg.norm(x) * np.linalg.norm(y), 1e-12))
        out.append(ScoringRequestOutput(f"{a.request_id}_{b.request_id}", ScoringOutput(score),
                                        a.prompt_token_ids + b.prompt_token_ids, True, None,
                                        error))
    return out
