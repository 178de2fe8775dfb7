"""EAGLE-3 draft heads: the config, the target's auxiliary hidden states, the head's forward.

An EAGLE-3 head (Li et al. 2025; vLLM's `Eagle3LlamaForCausalLM`) is one Llama decoder layer
fed from two sides. For position p it reads the target's residual stream entering three of
its layers (`aux_layer_ids`: low, middle, high; vLLM's numbering, 0 the embedding), which
`fc` projects from 3 * target hidden to its own hidden g, and the embedding e of the token
at p + 1. The layer then runs:

    x = [input_layernorm(e), hidden_norm(g)]                    # [T, 2H]: q/k/v read 2H
    r = g + o_proj(attention(x))                                # residual: g itself
    prenorm = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(prenorm))                             # [T, draft_vocab]

(`norm_before_residual`: the residual is hidden_norm(g), not g.) A draft id d is the
target's token d + d2t[d] (a reduced draft vocabulary). Each later step feeds the head its
own `prenorm` in place of g (no `fc`) with the embedding of the token it proposed.

The head's weights are a flat dict (`HEAD_WEIGHTS`, the PyTorch [out, in] layout); its K/V
is one layer in a page pool of its own (`pallas_kernels.metadata.kv_pages_shape` with one
slot), written and read through the `AttentionOps` given.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from models.config import ArchConfig
from models.layers import apply_rope, rope_cos_sin
from pallas_kernels import AttentionMetadata

# Weight name -> what it is ([out, in] matrices). "embed_tokens" (f[V, H]) is optional: a
# head without its own embedding reads the target's.
HEAD_WEIGHTS = ("fc", "input_layernorm", "hidden_norm", "q_proj", "k_proj", "v_proj",
                "o_proj", "post_attention_layernorm", "gate_proj", "up_proj", "down_proj",
                "norm", "lm_head", "d2t")


@dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 head's shapes.

    Attributes:
        layer: The head's decoder layer as an `ArchConfig` (hidden size, heads, head_dim,
            intermediate size, RMSNorm epsilon, rotary; one layer).
        vocab_size: The target's vocabulary (d2t maps into it).
        draft_vocab_size: Rows of `lm_head` (the draft vocabulary).
        target_hidden_size: The target's hidden size (`fc` reads n of them).
        aux_layer_ids: The target layers whose input residual stream the head reads, as
            the checkpoint names them; None: vLLM's default (`default_aux_layers`).
        norm_before_residual: The residual is the normed g (the `speculators` option).
    """

    layer: ArchConfig
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None = None
    norm_before_residual: bool = False

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default auxiliary layers of a target of `num_layers` layers (low, middle,
    high): `(2, L // 2, L - 3)`."""
    return (2, num_layers // 2, num_layers - 3)


def start_aux(layer_ids: tuple[int, ...], hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The empty capture a decoder's layer scan carries: ([n, T, H] zeros, i32[n] ids)."""
    buf = jnp.zeros((len(layer_ids),) + hidden.shape, hidden.dtype)  # [n, T, H]
    return buf, jnp.asarray(layer_ids, jnp.int32)


def capture_aux(aux: tuple[jax.Array, jax.Array], hidden: jax.Array, layer) -> tuple:
    """`aux` with the residual stream `hidden` [T, H] entering `layer` (traced) written to
    every entry naming that layer (the same layer may be named twice)."""
    buf, ids = aux
    hit = (ids == layer)[:, None, None]  # bool[n, 1, 1]
    return jnp.where(hit, hidden[None].astype(buf.dtype), buf), ids


def _rms(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Llama's RMSNorm: in float32, cast back, then scaled."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def _linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [T, in] times a PyTorch-layout weight [out, in]."""
    return x @ w.T.astype(x.dtype)


def combine_aux(params: dict, aux: jax.Array) -> jax.Array:
    """The head's hidden input g [T, H] from the target's aux states [T, n, Ht] (`fc`)."""
    return _linear(aux.reshape(aux.shape[0], -1), params["fc"])


def head_forward(cfg: Eagle3Config, ops, params: dict, embeds: jax.Array, g: jax.Array,
                 positions: jax.Array, kv_pages: jax.Array, md: AttentionMetadata):
    """One step of the head over a step's tokens end to end (any mix of requests, as the target).

    Args:
        cfg: The head's config.
        ops: The `pallas_kernels.AttentionOps` its attention runs on.
        params: Its weights (`HEAD_WEIGHTS`).
        embeds: [T, H] embeddings of each position's next token.
        g: [T, H] the hidden input: `combine_aux` of the target's states, or the head's
            own `prenorm` of the step before.
        positions: i32[T] each token's position (its rotary).
        kv_pages: The head's pool [1, 2, Hkv, num_pages, page_size, D].
        md: Its metadata (slot mapping, block tables, lengths over the head's pages).

    Returns:
        (kv_pages, normed [T, H], prenorm [T, H]).
    """
    lc = cfg.layer
    eps, num_tokens = lc.rms_norm_eps, embeds.shape[0]
    e = _rms(embeds, params["input_layernorm"], eps)
    normed_g = _rms(g, params["hidden_norm"], eps)
    residual = normed_g if cfg.norm_before_residual else g
    x = jnp.concatenate([e, normed_g], axis=-1)  # [T, 2H]
    q = _linear(x, params["q_proj"]).reshape(num_tokens, lc.num_heads, lc.head_dim)
    k = _linear(x, params["k_proj"]).reshape(num_tokens, lc.num_kv_heads, lc.head_dim)
    v = _linear(x, params["v_proj"]).reshape(num_tokens, lc.num_kv_heads, lc.head_dim)
    cos, sin = rope_cos_sin(positions, lc)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv_pages = ops.write_kv(kv_pages, 0, k, v, md.slot_mapping)
    attn = ops.attend(q, kv_pages, 0, md, sm_scale=lc.head_dim ** -0.5)  # [T, Hq, D]
    residual = residual + _linear(attn.reshape(num_tokens, -1), params["o_proj"])
    h = _rms(residual, params["post_attention_layernorm"], eps)
    mlp = _linear(jax.nn.silu(_linear(h, params["gate_proj"])) * _linear(h, params["up_proj"]),
                  params["down_proj"])
    prenorm = residual + mlp
    return kv_pages, _rms(prenorm, params["norm"], eps), prenorm


def head_logits(params: dict, normed: jax.Array) -> jax.Array:
    """f32[R, draft_vocab] the head's logits over its draft vocabulary."""
    return _linear(normed, params["lm_head"]).astype(jnp.float32)


def to_target_ids(params: dict, draft_ids: jax.Array) -> jax.Array:
    """i32[R] the target-vocabulary ids of draft ids i32[R] (d + d2t[d])."""
    return draft_ids + params["d2t"][draft_ids]
