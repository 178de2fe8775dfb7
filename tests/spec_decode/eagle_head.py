"""Random EAGLE-3 heads written as checkpoint directories (both layouts), and a NumPy
reference of the head's forward written from the EAGLE-3 paper's and vLLM's description."""

from __future__ import annotations

import json
import os

import numpy as np
from safetensors.numpy import save_file

HEAD_LAYER = dict(hidden_size=72, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                  max_position_embeddings=4096, hidden_act="silu")


def random_head(vocab_size: int, target_hidden: int, num_aux: int = 3, draft_vocab: int = 512,
                seed: int = 0, embed: bool = False, scale: float = 0.2) -> dict[str, np.ndarray]:
    """A random head's tensors by our names (`models.eagle3.HEAD_WEIGHTS`), [out, in]."""
    rng = np.random.default_rng(seed)
    h, i = HEAD_LAYER["hidden_size"], HEAD_LAYER["intermediate_size"]
    q = HEAD_LAYER["num_attention_heads"] * HEAD_LAYER["head_dim"]
    kv = HEAD_LAYER["num_key_value_heads"] * HEAD_LAYER["head_dim"]
    w = lambda *shape: (rng.standard_normal(shape) * scale).astype(np.float32)  # noqa: E731
    norm = lambda: (1.0 + 0.1 * rng.standard_normal(h)).astype(np.float32)  # noqa: E731
    targets = np.sort(rng.choice(vocab_size, draft_vocab, replace=False))
    out = {"fc": w(h, num_aux * target_hidden), "input_layernorm": norm(),
           "hidden_norm": norm(), "q_proj": w(q, 2 * h), "k_proj": w(kv, 2 * h),
           "v_proj": w(kv, 2 * h), "o_proj": w(h, q), "post_attention_layernorm": norm(),
           "gate_proj": w(i, h), "up_proj": w(i, h), "down_proj": w(h, i), "norm": norm(),
           "lm_head": w(draft_vocab, h),
           "d2t": (targets - np.arange(draft_vocab)).astype(np.int64)}
    if embed:
        out["embed_tokens"] = w(vocab_size, h)
    return out


_LAYER = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def write_head_dir(directory: str, tensors: dict[str, np.ndarray], vocab_size: int,
                   target_hidden: int, layout: str = "eagle3", aux_ids=None,
                   norm_before_residual: bool = False) -> str:
    """Writes `tensors` as an EAGLE-3 head directory in `layout` ("eagle3": midlayer.*,
    top-level Llama config; "speculators": layers.0.*, the config nested)."""
    prefix = "midlayer." if layout == "eagle3" else "layers.0."
    names = {}
    for key, value in tensors.items():
        if key in _LAYER:
            name = f"{prefix}{key}.weight"
        elif key in _ATTN:
            name = f"{prefix}self_attn.{key}.weight"
        elif key in _MLP:
            name = f"{prefix}mlp.{key}.weight"
        elif key == "d2t":
            name = "d2t"
        else:
            name = f"{key}.weight"
        names[name] = np.ascontiguousarray(value)
    draft_vocab = tensors["lm_head"].shape[0]
    names["t2d"] = np.zeros(vocab_size, bool)
    layer = {**HEAD_LAYER, "vocab_size": vocab_size, "num_hidden_layers": 1}
    extra = {"draft_vocab_size": draft_vocab, "target_hidden_size": target_hidden}
    if aux_ids is not None:
        extra["eagle_aux_hidden_state_layer_ids"] = list(aux_ids)
    if layout == "eagle3":
        config = {**layer, **extra, "architectures": ["LlamaForCausalLMEagle3"],
                  "model_type": "llama"}
    else:
        config = {**extra, "architectures": ["Eagle3Speculator"],
                  "speculators_model_type": "eagle3", "norm_before_residual": norm_before_residual,
                  "transformer_layer_config": {**layer, "model_type": "llama"}}
    os.makedirs(directory, exist_ok=True)
    save_file(names, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return directory


def _rms(x, w, eps=HEAD_LAYER["rms_norm_eps"]):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x, positions, theta=HEAD_LAYER["rope_theta"]):
    """Half-split rotary of x [T, heads, D] (Llama's `rotate_half`)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)  # [D/2]
    ang = positions[:, None] * inv[None]  # [T, D/2]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def reference_fc(t: dict[str, np.ndarray], aux: np.ndarray) -> np.ndarray:
    """The head's hidden input g [T, H] from the target's aux states [T, n, Ht] (float64)."""
    return np.asarray(aux, np.float64).reshape(len(aux), -1) @ np.asarray(t["fc"], np.float64).T


def reference_head(t: dict[str, np.ndarray], embeds: np.ndarray, g: np.ndarray,
                   positions: np.ndarray, norm_before_residual: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The head over one sequence (float64): embeds [T, H] of each position's next token,
    g [T, H] its hidden input (`reference_fc` of the target's states, or the head's own
    prenorm); `norm_before_residual`: the residual is the normed g. Returns (logits
    [T, draft_vocab] over the draft vocabulary, prenorm [T, H])."""
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    embeds, g = np.asarray(embeds, np.float64), np.asarray(g, np.float64)
    n_tok, hq = len(embeds), HEAD_LAYER["num_attention_heads"]
    hk, d = HEAD_LAYER["num_key_value_heads"], HEAD_LAYER["head_dim"]
    x = np.concatenate([_rms(embeds, t["input_layernorm"]), _rms(g, t["hidden_norm"])], -1)
    q = _rope((x @ t["q_proj"].T).reshape(n_tok, hq, d), positions)
    k = _rope((x @ t["k_proj"].T).reshape(n_tok, hk, d), positions)
    v = (x @ t["v_proj"].T).reshape(n_tok, hk, d)
    k, v = np.repeat(k, hq // hk, axis=1), np.repeat(v, hq // hk, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((n_tok, n_tok), bool))[None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    attn = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v).reshape(n_tok, -1)
    residual = (_rms(g, t["hidden_norm"]) if norm_before_residual else g) + attn @ t["o_proj"].T
    h = _rms(residual, t["post_attention_layernorm"])
    gate = h @ t["gate_proj"].T
    prenorm = residual + (gate / (1 + np.exp(-gate)) * (h @ t["up_proj"].T)) @ t["down_proj"].T
    return _rms(prenorm, t["norm"]) @ t["lm_head"].T, prenorm
