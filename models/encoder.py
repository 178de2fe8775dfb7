"""Encoder-only models for the pooling runner: BERT and XLM-RoBERTa here (bidirectional
attention over a step's ragged batch, learned absolute positions, token types, post-LayerNorm
blocks, their sequence-classification heads), ModernBERT in `models.modernbert`;
`EncoderModel` serves them where a `Model` goes.

Each prompt must be whole in its step (the engine turns chunked prefill and prefix caching
off for an encoder, `jaxserve.runner.encoder_serving`): a token attends to every token of
its own sequence, read from the step's `cu_q_lens`, and the page pool is never written.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from models.encoder_config import EncoderConfig
from models.linear import ServingChoice, choose_methods
from models.model import Model
from models.modernbert import modernbert_encode
from models.quant import NO_QUANT
from pallas_kernels import AttentionMetadata

# The layer stack's leaves, each [num_layers, ...] (matrices stored [in, out]).
LAYER_LEAVES = ("wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo", "ln1_scale", "ln1_bias",
                "wi", "bi", "wout", "bout", "ln2_scale", "ln2_bias")


def layer_norm(x, scale, bias, eps: float):
    """LayerNorm over the last axis, computed in float32, returned in `x`'s dtype."""
    h = x.astype(jnp.float32)
    mean = h.mean(-1, keepdims=True)
    var = jnp.square(h - mean).mean(-1, keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(var + eps)
    return (h * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def activation(x, name: str):
    """BERT's `hidden_act`: the exact (erf) GELU, or its tanh form."""
    return jax.nn.gelu(x, approximate=name != "gelu")


def token_rows(cu_q_lens, num_tokens: int):
    """Each token's row (i32[num_tokens]; padding tokens past `cu_q_lens[-1]` get the row
    count, a row of their own) from the step's i32[num_rows + 1] `cu_q_lens`."""
    num_rows = cu_q_lens.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=cu_q_lens.dtype)
    row = jnp.searchsorted(cu_q_lens, t, side="right") - 1
    return jnp.where(t < cu_q_lens[-1], row, num_rows)


def token_types(cfg: EncoderConfig, input_ids, row, cu_q_lens):
    """i32[num_tokens]: BERT's pair types (1 after the first separator of the token's own
    sequence) when `cfg.pair_token_types`, else 0."""
    if not cfg.pair_token_types:
        return jnp.zeros_like(input_ids)
    is_sep = (input_ids == cfg.sep_token_id).astype(jnp.int32)
    before = jnp.cumsum(is_sep) - is_sep  # separators before each token, over the step
    first = jnp.clip(cu_q_lens[jnp.minimum(row, cu_q_lens.shape[0] - 1)], 0,
                     input_ids.shape[0] - 1)  # i32[num_tokens]: the row's first token
    return (before > before[first]).astype(jnp.int32)


def encoder_layer(cfg: EncoderConfig, x, mask, p):
    """One post-LayerNorm block: self-attention over `mask` (bool[T, T], same sequence),
    then the GELU MLP; `x` [T, hidden], `p` one layer's leaves."""
    t, h, d = x.shape[0], cfg.num_heads, cfg.head_dim
    q = (x @ p["wq"] + p["bq"]).reshape(t, h, d)  # [T, heads, head_dim]
    k = (x @ p["wk"] + p["bk"]).reshape(t, h, d)
    v = (x @ p["wv"] + p["bv"]).reshape(t, h, d)
    s = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32) / math.sqrt(d)  # f32[H, T, T]
    s = jnp.where(mask[None], s, -jnp.inf)
    a = jax.nn.softmax(s, axis=-1).astype(x.dtype)
    o = jnp.einsum("hqk,khd->qhd", a, v).reshape(t, h * d)
    x = layer_norm(x + o @ p["wo"] + p["bo"], p["ln1_scale"], p["ln1_bias"], cfg.layer_norm_eps)
    m = activation(x @ p["wi"] + p["bi"], cfg.hidden_act) @ p["wout"] + p["bout"]
    return layer_norm(x + m, p["ln2_scale"], p["ln2_bias"], cfg.layer_norm_eps)


def classify_head(cfg: EncoderConfig, head: dict, h):
    """Class logits f32[rows, num_labels] of the first tokens' states `h` [rows, hidden]:
    BERT's pooler (dense, tanh) then `classifier`, or RoBERTa's dense, tanh, `out_proj`."""
    z = jnp.tanh(h @ head["dense_w"] + head["dense_b"])
    return (z @ head["out_w"] + head["out_b"]).astype(jnp.float32)


def encode(cfg: EncoderConfig, params: dict, input_ids, positions, cu_q_lens):
    """The encoder over one step's ragged tokens (i32[T] ids and per-sequence positions,
    each sequence whole): f32[T, hidden] final states, or with a head f32[T, num_labels]
    holding each sequence's class logits at its first token (zero elsewhere)."""
    num_tokens = input_ids.shape[0]
    row = token_rows(cu_q_lens, num_tokens)
    if cfg.modern is not None:  # ModernBERT: rotary, local layers (`models.modernbert`)
        return modernbert_encode(cfg, params, input_ids, positions, row, cu_q_lens, activation)
    emb = params["embed"]
    pos = jnp.clip(positions + cfg.position_offset, 0, cfg.max_position_embeddings - 1)
    x = (emb["word"][input_ids] + emb["position"][pos]
         + emb["token_type"][token_types(cfg, input_ids, row, cu_q_lens)])
    x = layer_norm(x, emb["ln_scale"], emb["ln_bias"], cfg.layer_norm_eps)
    mask = row[:, None] == row[None, :]  # bool[T, T]: the same sequence (padding apart)

    def body(x, p):
        return encoder_layer(cfg, x, mask, p), None

    x, _ = jax.lax.scan(body, x, params["layers"])
    if cfg.head is None:
        return x.astype(jnp.float32)
    first = cu_q_lens[:-1]  # i32[rows]: each sequence's first token (padding rows: the end)
    logits = classify_head(cfg, params["head"], x[jnp.clip(first, 0, num_tokens - 1)])
    return jnp.zeros((num_tokens, cfg.num_labels), jnp.float32).at[first].set(
        logits, mode="drop")


@dataclasses.dataclass
class EncoderModel(Model):
    """An encoder with its weights, served by the pooling runner like a `Model`: `cfg` is
    its sizing view (`EncoderConfig.arch_view`), `encoder` its numerics, `params` the tree
    `load_encoder` builds ({"embed", "layers", "head"}).

    Its forward returns the final states (or class logits) as the hidden states the pooling
    program reads; it keeps nothing in the page pool. The weights stay in XLA's plain form
    whatever serving form the engine picks (they are not a decoder's layer matmuls).
    """

    encoder: EncoderConfig | None = None

    def __post_init__(self):
        if self.encoder is None:
            raise ValueError("EncoderModel needs its EncoderConfig (encoder=)")
        self.serving = self.serving or ServingChoice()
        # NOTE: the plain XLA methods whatever `serving` says, so a change of serving form
        # never moves these params into a decoder's panels (`serving_form` compares forms).
        self.methods = choose_methods(self.cfg, NO_QUANT, self.dtype, ServingChoice("xla"))
        self.module = None

    @property
    def num_labels(self) -> int:
        """Classes of its classification head (0: an embedding model)."""
        return self.encoder.num_labels if self.encoder.head else 0

    @property
    def problem_type(self) -> str | None:
        return self.encoder.problem_type

    @property
    def score_activation(self) -> str | None:
        return self.encoder.score_activation

    def forward(self, params, input_ids, positions, kv_pages, md: AttentionMetadata,
                lora=None, lora_slots=None, routing: bool = False, mm_embeds=None,
                rope_positions=None, aux_layers=()):
        """(kv_pages unchanged, f32[num_tokens, output_size]) of one step (`encode`).

        Raises:
            ValueError: LoRA stacks, routed experts, image rows (`mm_embeds`), multimodal
                rotary rows or EAGLE-3's `aux_layers` given (an encoder has none of them).
        """
        if (lora is not None or routing or mm_embeds is not None or rope_positions is not None
                or aux_layers):
            raise ValueError(f"{self.source or 'an encoder'}: an encoder serves no LoRA "
                             "adapters, routes no experts and reads no images")
        return kv_pages, encode(self.encoder, params, input_ids, positions, md.cu_q_lens)

    def compute_logits(self, params, hidden):
        """Zeros f32[rows, vocab]: an encoder has no LM head; the pooling runner's one
        dropped sample reads them."""
        return jnp.zeros((hidden.shape[0], self.cfg.vocab_size), jnp.float32)
