"""ModernBERT's encoder (`ModernBertModel`, `ModernBertForSequenceClassification`): pre-norm
blocks with rotary positions, alternating global and local (sliding-window) bidirectional
attention, a GeGLU MLP, and its classification head; the fields it adds to `EncoderConfig`
(`ModernBertFields`) and the ragged forward `modernbert_encode`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

CLASSIFIER_POOLINGS = ("cls", "mean")


@dataclass(frozen=True)
class ModernBertFields:
    """What ModernBERT sets beyond `EncoderConfig`'s widths.

    Attributes:
        layer_sliding: Per layer, whether it attends locally (a token sees the tokens of its
            sequence at most `window` positions away) or globally.
        window: Half the local window (`local_attention // 2`, transformers' `sliding_window`).
        global_theta: Rotary base of the global layers.
        local_theta: Rotary base of the local layers.
        classifier_pooling: "cls" (the first token) or "mean" (the sequence's mean) feeds
            the head.
        classifier_activation: The head's activation (`models.encoder.activation` names).
    """

    layer_sliding: tuple[bool, ...]
    window: int
    global_theta: float = 160000.0
    local_theta: float = 10000.0
    classifier_pooling: str = "cls"
    classifier_activation: str = "gelu"


def modernbert_fields(hf: dict, num_layers: int) -> ModernBertFields:
    """`ModernBertFields` from a Hugging Face `config.json` (transformers 4's
    `global_attn_every_n_layers` and `*_rope_theta`, or 5's `layer_types` and
    `rope_parameters`).

    Raises:
        ValueError: Layer types of another count or kind, a rotary type other than the
            default, or an unknown `classifier_pooling` (each named).
    """
    types = hf.get("layer_types")
    if types is None:
        every = hf.get("global_attn_every_n_layers", 3)
        types = ["sliding_attention" if i % every else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(f"layer_types={types}: one of 'full_attention' or "
                         f"'sliding_attention' per layer ({num_layers})")
    rope = hf.get("rope_parameters") or {}
    thetas = {}
    for kind, old, default in (("full_attention", "global_rope_theta", 160000.0),
                               ("sliding_attention", "local_rope_theta", 10000.0)):
        params = rope.get(kind) or {}
        if params.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.{kind}.rope_type={params['rope_type']!r}: "
                             "ModernBERT is served with the default rotary")
        thetas[kind] = float(params.get("rope_theta", hf.get(old, default)))
    pooling = hf.get("classifier_pooling", "cls")
    if pooling not in CLASSIFIER_POOLINGS:
        raise ValueError(f"classifier_pooling={pooling!r}: one of {CLASSIFIER_POOLINGS}")
    for name in ("norm_bias", "attention_bias", "mlp_bias", "classifier_bias"):
        if hf.get(name):
            raise ValueError(f"{name}=true: ModernBERT is served without biases (as released)")
    return ModernBertFields(tuple(t == "sliding_attention" for t in types),
                            int(hf.get("local_attention", 128)) // 2,
                            thetas["full_attention"], thetas["sliding_attention"], pooling,
                            hf.get("classifier_activation", "gelu"))


def _norm(x, scale, eps: float):
    """transformers' bias-free LayerNorm, in float32."""
    h = x.astype(jnp.float32)
    h = h - h.mean(-1, keepdims=True)
    h = h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + eps)
    return (h * scale.astype(jnp.float32)).astype(x.dtype)


def _rotary(positions, head_dim: int, theta: float):
    """(cos, sin) f32[T, 1, head_dim] of each token's position (halves repeated)."""
    inv = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    freqs = positions.astype(jnp.float32)[:, None] * inv  # f32[T, head_dim / 2]
    emb = jnp.concatenate([freqs, freqs], -1)[:, None]
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    turned = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x.astype(jnp.float32) * cos + turned.astype(jnp.float32) * sin).astype(x.dtype)


def modernbert_encode(cfg, params: dict, input_ids, positions, row, cu_q_lens, act):
    """ModernBERT over one step's ragged tokens (each sequence whole; `row` i32[T] each
    token's sequence, `act` the activation by name): f32[T, hidden] final states, or with a
    head f32[T, num_labels], each sequence's class logits at its first token."""
    mf, eps, h, d = cfg.modern, cfg.layer_norm_eps, cfg.num_heads, cfg.head_dim
    t = input_ids.shape[0]
    x = _norm(params["embed"]["word"][input_ids], params["embed"]["norm"], eps)
    same = row[:, None] == row[None, :]  # bool[T, T]
    near = same & (jnp.abs(positions[:, None] - positions[None, :]) <= mf.window)
    rot_global, rot_local = _rotary(positions, d, mf.global_theta), _rotary(positions, d,
                                                                            mf.local_theta)
    xs = (params["layers"], jnp.asarray(mf.layer_sliding),
          jnp.arange(cfg.num_layers) > 0)  # layer 0 has no attention norm (Identity)

    def body(x, layer):
        p, sliding, normed = layer
        a = jnp.where(normed, _norm(x, p["attn_norm"], eps), x)
        q, k, v = (a @ p["wqkv"]).reshape(t, 3, h, d).transpose(1, 0, 2, 3)  # [T, H, D] each
        cos, sin = (jnp.where(sliding, lo, gl) for lo, gl in zip(rot_local, rot_global,
                                                                  strict=True))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        s = jnp.einsum("qhd,khd->hqk", q, k).astype(jnp.float32) / math.sqrt(d)  # f32[H, T, T]
        s = jnp.where(jnp.where(sliding, near, same)[None], s, -jnp.inf)
        o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1).astype(x.dtype), v)
        x = x + o.reshape(t, h * d) @ p["wo"]
        gate_in, gate = jnp.split(_norm(x, p["mlp_norm"], eps) @ p["wi"], 2, axis=-1)
        return x + (act(gate_in, cfg.hidden_act) * gate) @ p["wout"], None

    x, _ = jax.lax.scan(body, x, xs)
    x = _norm(x, params["final_norm"], eps)
    if cfg.head is None:
        return x.astype(jnp.float32)
    first = cu_q_lens[:-1]  # i32[rows]
    if mf.classifier_pooling == "cls":
        pooled = x[jnp.clip(first, 0, t - 1)]
    else:  # each sequence's mean (padding tokens are a row of their own, dropped)
        num_rows = first.shape[0]
        sums = jnp.zeros((num_rows, x.shape[1]), jnp.float32).at[row].add(
            x.astype(jnp.float32), mode="drop")
        pooled = (sums / jnp.maximum(cu_q_lens[1:] - first, 1)[:, None]).astype(x.dtype)
    head = params["head"]
    z = _norm(act(pooled @ head["dense_w"], mf.classifier_activation), head["norm"], eps)
    logits = (z @ head["out_w"] + head["out_b"]).astype(jnp.float32)  # f32[rows, labels]
    return jnp.zeros((t, cfg.num_labels), jnp.float32).at[first].set(logits, mode="drop")
