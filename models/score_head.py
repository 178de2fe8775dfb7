"""Decoder sequence classifiers (`LlamaForSequenceClassification`,
`Qwen3ForSequenceClassification`, ... of any served decoder family): the decoder's final
states through the checkpoint's `score` head, read at each prompt's last token by the
pooling runner (`ScoreHeadModel`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.encoder_config import cross_encoder_activation
from models.model import Model
from models.registry import FAMILIES

SEQ_CLS = "ForSequenceClassification"


def decoder_classifier_view(hf: dict) -> dict | None:
    """The `*ForCausalLM` config a decoder classifier's `config.json` loads as (its decoder
    is the causal model's, named the same; its LM head is absent and tied), or None when
    `hf` names no classifier of a served family."""
    for name in hf.get("architectures") or ():
        causal = name[:-len(SEQ_CLS)] + "ForCausalLM"
        if name.endswith(SEQ_CLS) and causal in FAMILIES:
            return {**hf, "architectures": [causal], "tie_word_embeddings": True}
    return None


def classifier_fields(hf: dict) -> dict:
    """`ScoreHeadModel`'s head fields from a classifier's `config.json`.

    Raises:
        ValueError: No class (`num_labels` below 1), or an activation other than
            Sigmoid or Identity (`cross_encoder_activation`).
    """
    labels = hf.get("id2label")
    num_labels = int(hf.get("num_labels") or (len(labels) if labels else 2))
    if num_labels < 1:
        raise ValueError(f"num_labels={num_labels}: a classification head needs a class")
    st = hf.get("sentence_transformers") or {}
    act = st.get("activation_fn") or hf.get("sbert_ce_default_activation_function")
    return dict(num_labels=num_labels, problem_type=hf.get("problem_type"),
                score_activation=cross_encoder_activation(act),
                use_pad_token=bool(hf.get("use_pad_token", True)))


@dataclasses.dataclass
class ScoreHeadModel(Model):
    """A decoder with a sequence-classification head: its forward returns each token's
    class logits (the final-normed states times `score`), of which the pooling runner
    keeps each prompt's last (LAST pooling, as transformers reads the last token).

    Attributes:
        score: f32[hidden_size, num_labels], the checkpoint's `score.weight` transposed.
        num_labels: Classes.
        problem_type: transformers' `problem_type`.
        score_activation: A sentence-transformers cross-encoder's activation name, or None.
        use_pad_token: vLLM's: a pair is the tokenizer's pair encoding (a cross-encoder);
            False: the two texts concatenated (an LLM reranker, `models.seq_cls_convert`).
    """

    score: jax.Array | None = None
    num_labels: int = 0
    problem_type: str | None = None
    score_activation: str | None = None
    use_pad_token: bool = True

    def forward(self, params, *args, **kwargs):
        """(kv_pages, f32[num_tokens, num_labels], ...): `Model.forward`'s, whatever it takes,
        with the hidden states turned into class logits."""
        kv_pages, hidden, *rest = super().forward(params, *args, **kwargs)
        logits = hidden.astype(jnp.float32) @ self.score.astype(jnp.float32)
        return (kv_pages, logits, *rest)

    def compute_logits(self, params, hidden):
        """Zeros f32[rows, vocab]: the classifier has no LM head; the pooling runner's one
        dropped sample reads them."""
        return jnp.zeros((hidden.shape[0], self.cfg.vocab_size), jnp.float32)


def with_score_head(model: Model, hf: dict, score_weight) -> ScoreHeadModel:
    """`model` (the decoder, loaded as its causal view) with the head of `hf`'s classifier
    and the checkpoint's `score.weight` (numpy [num_labels, hidden_size]).

    Raises:
        ValueError: A `score.weight` of another shape than the config gives.
    """
    fields = classifier_fields(hf)
    want = (fields["num_labels"], model.cfg.hidden_size)
    if tuple(score_weight.shape) != want:
        raise ValueError(f"tensor 'score.weight' has shape {tuple(score_weight.shape)}; the "
                         f"config gives {want}")
    base = {f.name: getattr(model, f.name) for f in dataclasses.fields(Model)}
    out = ScoreHeadModel(**base, score=jax.device_put(jnp.asarray(score_weight.T, model.dtype)),
                         **fields)
    out.load_seconds = getattr(model, "load_seconds", 0.0)
    return out
