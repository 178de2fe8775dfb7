"""BERT / XLM-RoBERTa encoders' configuration (`EncoderConfig`), read from a Hugging Face
`config.json`, and the `ArchConfig` view the engine sizes its pool and steps by."""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ArchConfig
from models.modernbert import ModernBertFields, modernbert_fields

# architecture -> (model_type family, classification head): "bert" heads are BERT's pooler
# (dense + tanh on the CLS token) then `classifier`; "roberta" heads are RoBERTa's
# `classifier.dense` + tanh then `classifier.out_proj` on the <s> token; "modernbert" heads
# `head.dense`, its activation and `head.norm` then `classifier` (`models.modernbert`);
# None: no head.
ENCODER_ARCHITECTURES = {
    "BertModel": ("bert", None),
    "BertForSequenceClassification": ("bert", "bert"),
    "XLMRobertaModel": ("roberta", None),
    "XLMRobertaForSequenceClassification": ("roberta", "roberta"),
    "RobertaModel": ("roberta", None),
    "RobertaForSequenceClassification": ("roberta", "roberta"),
    "ModernBertModel": ("modernbert", None),
    "ModernBertForSequenceClassification": ("modernbert", "modernbert"),
}
# Their activations (transformers' ACT2FN names): the exact (erf) GELU and its tanh form.
ENCODER_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh")
# transformers' `problem_type` values: how class logits become probabilities (vLLM's rule).
PROBLEM_TYPES = (None, "regression", "single_label_classification",
                 "multi_label_classification")


def is_encoder(hf: dict) -> bool:
    """Whether a Hugging Face config names one of `ENCODER_ARCHITECTURES`."""
    return bool(set(hf.get("architectures") or ()) & set(ENCODER_ARCHITECTURES))


@dataclass(frozen=True)
class EncoderConfig:
    """An encoder-only transformer (post-LayerNorm blocks, learned absolute positions).

    Attributes:
        architecture: The HF architecture name.
        family: "bert", "roberta" or "modernbert" (`ENCODER_ARCHITECTURES`).
        head: The classification head's kind (its family's), or None.
        vocab_size: Token ids.
        hidden_size: Residual width.
        intermediate_size: The MLP's width.
        num_layers: Blocks.
        num_heads: Attention heads (head width `hidden_size / num_heads`).
        max_position_embeddings: Rows of the position table.
        type_vocab_size: Rows of the token-type table.
        layer_norm_eps: Every LayerNorm's epsilon.
        hidden_act: One of `ENCODER_ACTIVATIONS`.
        position_offset: Added to each token's position before the table lookup (RoBERTa's
            `padding_idx + 1`; 0 for BERT).
        pair_token_types: Token types follow BERT's pair layout: 0 up to and including the
            first `sep_token_id`, 1 after it (False: every token is type 0, as RoBERTa's
            tokenizers give).
        sep_token_id: The separator id that starts a pair's second segment (None: none).
        num_labels: Classes of the head (0 without one).
        problem_type: transformers' `problem_type` (`PROBLEM_TYPES`).
        score_activation: A sentence-transformers cross-encoder's activation
            ("sigmoid", "identity"), or None (vLLM's default for the class count).
        modern: ModernBERT's own fields (rotary, local layers, its head), else None.
    """

    architecture: str
    family: str
    head: str | None
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    position_offset: int = 0
    pair_token_types: bool = False
    sep_token_id: int | None = None
    num_labels: int = 0
    problem_type: str | None = None
    score_activation: str | None = None
    modern: ModernBertFields | None = None

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_attention_heads ({self.num_heads})")
        if self.hidden_act not in ENCODER_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} for "
                             f"{self.architecture}; supported: {', '.join(ENCODER_ACTIVATIONS)}")
        if self.modern is not None and self.modern.classifier_activation not in \
                ENCODER_ACTIVATIONS:
            raise ValueError(f"unsupported classifier_activation "
                             f"{self.modern.classifier_activation!r}; supported: "
                             f"{', '.join(ENCODER_ACTIVATIONS)}")
        if self.problem_type not in PROBLEM_TYPES:
            raise ValueError(f"unsupported problem_type {self.problem_type!r}; supported: "
                             f"{PROBLEM_TYPES[1:]}")
        if self.max_context < 1:
            raise ValueError(f"max_position_embeddings={self.max_position_embeddings} leaves "
                             f"no position past the offset {self.position_offset}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_context(self) -> int:
        """The longest prompt the position table covers (RoBERTa's offset taken off)."""
        return self.max_position_embeddings - self.position_offset

    @property
    def output_size(self) -> int:
        """Width of what each token's forward returns: the classes with a head, else the
        hidden size."""
        return self.num_labels if self.head else self.hidden_size

    def arch_view(self) -> ArchConfig:
        """The `ArchConfig` the engine sizes steps and the (unused) page pool by: the
        encoder's widths and context; its numerics fields are the decoder defaults and
        mean nothing here (the encoder never runs `models.decoder`)."""
        return ArchConfig(architecture=self.architecture, vocab_size=self.vocab_size,
                          hidden_size=self.output_size, intermediate_size=self.intermediate_size,
                          num_layers=self.num_layers, num_heads=self.num_heads,
                          num_kv_heads=self.num_heads, head_dim=self.head_dim,
                          max_position_embeddings=self.max_context, tie_word_embeddings=True)


def encoder_config_from_hf(hf: dict, sep_token_id: int | None = None) -> EncoderConfig:
    """An `EncoderConfig` from a Hugging Face `config.json` dict (`sep_token_id`: the
    tokenizer's separator, which the config does not hold).

    Raises:
        ValueError: Not an encoder architecture, relative position embeddings, an
            unsupported activation or `problem_type`, or a head without labels.
    """
    names = [a for a in hf.get("architectures") or () if a in ENCODER_ARCHITECTURES]
    if not names:
        raise ValueError(f"architectures {hf.get('architectures')} names no encoder; "
                         f"supported: {sorted(ENCODER_ARCHITECTURES)}")
    family, head = ENCODER_ARCHITECTURES[names[0]]
    kind = hf.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"position_embedding_type={kind!r}: only 'absolute' position "
                         "embeddings are served")
    num_labels = 0
    if head is not None:
        labels = hf.get("id2label")
        num_labels = int(hf.get("num_labels") or (len(labels) if labels else 2))
        if num_labels < 1:
            raise ValueError(f"num_labels={num_labels}: a classification head needs a class")
    pad = hf.get("pad_token_id")
    if family == "roberta" and pad is None:
        raise ValueError("pad_token_id: RoBERTa's positions start past the padding index, "
                         "which the config must give")
    st = hf.get("sentence_transformers") or {}
    act = st.get("activation_fn") or hf.get("sbert_ce_default_activation_function")
    modern = family == "modernbert"
    return EncoderConfig(
        architecture=names[0], family=family, head=head, vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
        max_position_embeddings=hf.get("max_position_embeddings", 8192 if modern else 512),
        type_vocab_size=0 if modern else hf.get("type_vocab_size", 2),
        layer_norm_eps=hf.get("norm_eps", 1e-5) if modern else hf.get("layer_norm_eps", 1e-12),
        hidden_act=hf.get("hidden_activation" if modern else "hidden_act", "gelu"),
        position_offset=pad + 1 if family == "roberta" else 0,
        pair_token_types=family == "bert" and hf.get("type_vocab_size", 2) >= 2
        and sep_token_id is not None,
        sep_token_id=sep_token_id, num_labels=num_labels,
        problem_type=hf.get("problem_type"), score_activation=cross_encoder_activation(act),
        modern=modernbert_fields(hf, hf["num_hidden_layers"]) if modern else None)


def cross_encoder_activation(qualname: str | None) -> str | None:
    """A sentence-transformers cross-encoder's `activation_fn` ("torch.nn.modules.
    activation.Sigmoid") as "sigmoid" / "identity"; None when not given.

    Raises:
        ValueError: Another activation (vLLM loads only torch.nn's; these two are served).
    """
    if qualname is None:
        return None
    name = qualname.rsplit(".", 1)[-1].lower()
    if name not in ("sigmoid", "identity"):
        raise ValueError(f"sentence_transformers.activation_fn={qualname!r}: served are "
                         "torch.nn's Sigmoid and Identity")
    return name
