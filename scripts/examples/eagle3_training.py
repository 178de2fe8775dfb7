"""Training an EAGLE-3 head in JAX: its forward over whole sequences, unrolled, and the loss.

The serving forward (`models.eagle3.head_forward`) runs one step over paged K/V. Training
runs the head over every position of a batch of sequences at once, for `steps` unrolled
draft steps (EAGLE-3's "training-time test"): step 1 at position r reads the target's aux
states at r (through `fc`); step s > 1 reads the head's own `prenorm` of step s - 1 at
r - 1, as `propose_loop` feeds it. Every step embeds the token at r + 1 (the data's: on the
target's own generations those are the proposals that get accepted) and predicts the token
at r + 2. Attention is what the serving loop sees: step s at r attends to step 1's keys at
positions <= r - s + 1 and to step i's key at r - s + i for i = 2..s (the K/V that
`observe` and the loop's earlier steps wrote there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.eagle3 import Eagle3Config
from models.layers import apply_rope, rope_cos_sin


def _rms(x, w, eps):
    x32 = x.astype(jnp.float32)
    return w * (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps))


def _shift(x: jax.Array, n: int) -> jax.Array:
    """x [B, L, ...] moved n positions later along L (the first n rows zero)."""
    if n == 0:
        return x
    return jnp.pad(x, [(0, 0), (n, 0)] + [(0, 0)] * (x.ndim - 2))[:, :x.shape[1]]


def unrolled_logits(cfg: Eagle3Config, params: dict, aux: jax.Array, embeds: jax.Array,
                    steps: int) -> list[jax.Array]:
    """The head's logits of every unrolled step over a batch of sequences.

    Args:
        cfg: The head's config.
        params: Its weights (`models.eagle3.HEAD_WEIGHTS`, float).
        aux: [B, L, n, Ht] the target's aux states at each position.
        embeds: [B, L, H] the embedding of the token after each position.
        steps: Unrolled draft steps (1: teacher forcing alone).

    Returns:
        `steps` arrays f32[B, L, draft_vocab]: step s's logits at position r predict the
        token at r + 2 (valid from r = s - 1 on).
    """
    lc = cfg.layer
    eps, (b, length) = lc.rms_norm_eps, embeds.shape[:2]
    hq, hk, d = lc.num_heads, lc.num_kv_heads, lc.head_dim
    cos, sin = rope_cos_sin(jnp.tile(jnp.arange(length, dtype=jnp.int32), b), lc)
    e = _rms(embeds, params["input_layernorm"], eps)
    g = aux.reshape(b, length, -1) @ params["fc"].T  # [B, L, H]
    keys, values, out = [], [], []
    for s in range(steps):
        normed_g = _rms(g, params["hidden_norm"], eps)
        residual = normed_g if cfg.norm_before_residual else g
        x = jnp.concatenate([e, normed_g], -1).reshape(b * length, -1)  # [B*L, 2H]
        q = apply_rope((x @ params["q_proj"].T).reshape(-1, hq, d), cos, sin)
        k = apply_rope((x @ params["k_proj"].T).reshape(-1, hk, d), cos, sin)
        v = (x @ params["v_proj"].T).reshape(-1, hk, d)
        q = q.reshape(b, length, hq, d)
        keys.append(jnp.repeat(k.reshape(b, length, hk, d), hq // hk, axis=2))
        values.append(jnp.repeat(v.reshape(b, length, hk, d), hq // hk, axis=2))
        scale = d ** -0.5
        # Step 1's keys at positions <= r - s; then one key of each later step (diagonals).
        first = jnp.einsum("bqhd,bkhd->bhqk", q, keys[0]) * scale  # [B, Hq, L, L]
        allowed = jnp.tril(jnp.ones((length, length), bool), -s)
        first = jnp.where(allowed, first, -jnp.inf)
        diag = [jnp.einsum("bqhd,bqhd->bhq", q, _shift(keys[i], s - i)) * scale
                for i in range(1, s + 1)]  # each [B, Hq, L]
        scores = jnp.concatenate([first] + [x[..., None] for x in diag], -1)
        p = jax.nn.softmax(scores, -1)
        attn = jnp.einsum("bhqk,bkhd->bqhd", p[..., :length], values[0])
        for i in range(1, s + 1):
            attn = attn + p[..., length + i - 1].transpose(0, 2, 1)[..., None] * _shift(
                values[i], s - i)
        residual = residual + attn.reshape(b, length, -1) @ params["o_proj"].T
        h = _rms(residual, params["post_attention_layernorm"], eps)
        mlp = (jax.nn.silu(h @ params["gate_proj"].T) * (h @ params["up_proj"].T)
               ) @ params["down_proj"].T
        prenorm = residual + mlp
        out.append((_rms(prenorm, params["norm"], eps) @ params["lm_head"].T
                    ).astype(jnp.float32))
        g = _shift(prenorm, 1)  # step s + 1 at r reads this step's prenorm at r - 1
    return out


def loss_and_accuracy(cfg: Eagle3Config, params: dict, aux, embeds, labels, weights,
                      steps: int):
    """Mean cross-entropy of the unrolled steps (step s weighted `weights[s]`) and each
    step's top-1 accuracy.

    Args:
        labels: i32[B, L] the draft id of the token at r + 2, or -1 where no loss is taken
            (prompt tokens, padding, tokens outside the draft vocabulary).

    Returns:
        (loss, f32[steps] accuracy on the positions each step is scored).
    """
    logits = unrolled_logits(cfg, params, aux, embeds, steps)
    total, accuracy = 0.0, []
    for s, lg in enumerate(logits):
        # Every step at r predicts the token at r + 2 (`labels[r]`); step s is scored from
        # r = s on, where its chain of earlier steps exists.
        mask = (labels >= 0) & (jnp.arange(labels.shape[1]) >= s)[None]
        logp = jax.nn.log_softmax(lg, -1)
        nll = -jnp.take_along_axis(logp, jnp.maximum(labels, 0)[..., None], -1)[..., 0]
        n = jnp.maximum(mask.sum(), 1)
        total = total + weights[s] * jnp.sum(jnp.where(mask, nll, 0.0)) / n
        hit = (jnp.argmax(lg, -1) == labels) & mask
        accuracy.append(hit.sum() / n)
    return total / sum(weights[:steps]), jnp.stack(accuracy)


def init_params(cfg: Eagle3Config, lm_head_rows: np.ndarray | None, seed: int = 0) -> dict:
    """A head to start from: small random matrices; `fc` reading the highest aux layer
    (its residual stream is nearly the target's last) where widths allow; the LM head from
    `lm_head_rows` ([draft_vocab, H]: the target's LM head rows of the draft tokens) if
    given."""
    lc, h = cfg.layer, cfg.hidden_size
    ht = cfg.target_hidden_size
    rng = np.random.default_rng(seed)
    w = lambda *shape, s=0.02: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    n_aux = len(cfg.aux_layer_ids or (0, 0, 0))
    fc = w(h, n_aux * ht)
    if ht == h:
        fc[:, (n_aux - 1) * ht:] += np.eye(h, dtype=np.float32)
    ones = lambda: np.ones(h, np.float32)  # noqa: E731
    q, kv = lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
    return {"fc": fc, "input_layernorm": ones(), "hidden_norm": ones(),
            "q_proj": w(q, 2 * h), "k_proj": w(kv, 2 * h), "v_proj": w(kv, 2 * h),
            "o_proj": w(h, q, s=0.002), "post_attention_layernorm": ones(),
            "gate_proj": w(lc.intermediate_size, h), "up_proj": w(lc.intermediate_size, h),
            "down_proj": w(h, lc.intermediate_size, s=0.002), "norm": ones(),
            "lm_head": (np.asarray(lm_head_rows, np.float32) if lm_head_rows is not None
                        else w(cfg.draft_vocab_size, h))}
