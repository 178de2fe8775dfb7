"""vLLM's online conversion of a causal LM into a sequence classifier: `hf_overrides` merged
into `config.json`, `convert`, and a score head taken from the LM head's rows of
`classifier_from_token` (Qwen3-Reranker's yes/no logits: `from_2_way_softmax`)."""

from __future__ import annotations

import numpy as np

from models.score_head import SEQ_CLS

# `convert` values (vLLM's `--convert`): "classify" serves a `*ForCausalLM` as its
# `*ForSequenceClassification`, "embed" a classifier's decoder as an embedding model.
CONVERTS = ("auto", "none", "embed", "classify")
# vLLM's `method`s: a score head made of LM head rows. "from_2_way_softmax": one class, the
# row of the second token minus the first's (sigmoid(yes - no) = softmax([no, yes])[yes]);
# "no_post_processing": one class per token, the rows themselves.
SEQ_CLS_METHODS = ("from_2_way_softmax", "no_post_processing")


def overridden_config(hf: dict, hf_overrides: dict | None, convert: str = "auto") -> dict:
    """`hf` (a `config.json`) as vLLM reads it under `hf_overrides` and `convert`.

    `is_original_qwen3_reranker` sets `method` to "from_2_way_softmax" (vLLM's
    `Qwen3ForSequenceClassificationConfig`); a `method` sets `num_labels` (1, or one per
    token) and `use_pad_token` to False unless given (an LLM reranker scores the two texts
    concatenated, `jaxserve.engine.scoring.score_prompt`).

    Raises:
        ValueError: `hf_overrides` not a dict, an unknown `convert` or `method`, or
            `classifier_from_token` missing or of the wrong length for the method.
    """
    if hf_overrides is not None and not isinstance(hf_overrides, dict):
        raise ValueError(f"hf_overrides must be a dict of config.json fields, got "
                         f"{type(hf_overrides).__name__}")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {CONVERTS}, got {convert!r}")
    hf = {**hf, **(hf_overrides or {})}
    archs = list(hf.get("architectures") or ())
    if convert == "classify":
        archs = [a.replace("ForCausalLM", SEQ_CLS) for a in archs]
    elif convert == "embed":
        archs = [a.replace(SEQ_CLS, "ForCausalLM") for a in archs]
    hf["architectures"] = archs
    tokens = hf.get("classifier_from_token")
    if hf.get("is_original_qwen3_reranker"):
        if not isinstance(tokens, list) or len(tokens) != 2:
            raise ValueError("classifier_from_token: is_original_qwen3_reranker needs the two "
                             f"tokens ['no', 'yes'], got {tokens!r}")
        hf["method"] = "from_2_way_softmax"
    method = hf.get("method")
    if method is None:
        return hf
    if method not in SEQ_CLS_METHODS:
        raise ValueError(f"method must be one of {SEQ_CLS_METHODS}, got {method!r}")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token: method={method!r} needs a list of tokens, "
                         f"got {tokens!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"classifier_from_token: from_2_way_softmax takes two tokens (the "
                         f"'false' one, then the 'true' one), got {len(tokens)}")
    hf["num_labels"] = 1 if method == "from_2_way_softmax" else len(tokens)
    hf.pop("id2label", None)  # NOTE: the checkpoint's labels do not count these classes
    hf.setdefault("use_pad_token", False)
    return hf


def token_ids(tokenizer, tokens: list[str]) -> list[int]:
    """The vocabulary ids of `classifier_from_token`'s tokens.

    Raises:
        ValueError: A token the vocabulary lacks (naming it).
    """
    vocab = tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(f"classifier_from_token: {missing} not in the tokenizer's vocabulary")
    return [vocab[t] for t in tokens]


def token_score_weight(hf: dict, lm_head: np.ndarray, tokenizer) -> np.ndarray:
    """The score head of `hf`'s `method` (f32[num_labels, hidden]) from the LM head's rows
    (`lm_head`: [vocab, hidden]) of its `classifier_from_token`."""
    ids = token_ids(tokenizer, hf["classifier_from_token"])
    rows = np.asarray(lm_head[ids], np.float32)  # f32[len(tokens), hidden]
    if hf["method"] == "from_2_way_softmax":
        return rows[1:2] - rows[0:1]
    return rows
