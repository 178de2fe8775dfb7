"""Loads an EAGLE-3 draft head from a directory (the EAGLE-3 and the `speculators` layouts);
saves one in the EAGLE-3 layout.

EAGLE-3's own layout (`LlamaForCausalLMEagle3`, `Eagle3LlamaForCausalLM`): a Llama config
with `draft_vocab_size`, `target_hidden_size` and optionally
`eagle_aux_hidden_state_layer_ids`; weights `fc.weight`, `midlayer.*` (the decoder layer),
`norm.weight`, `lm_head.weight`, `d2t` (and `t2d`, unused), maybe `embed_tokens.weight`.
The `speculators` layout (`Eagle3Speculator`, `speculators_model_type: eagle3`) nests the
Llama config under `transformer_layer_config` and names the layer `layers.0.*`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from models.eagle3 import Eagle3Config
from models.loaders.safetensors_dir import SafetensorsDir, read_config
from models.registry import arch_config_from_hf

_FIELD = "speculative_config.model"
# Our weight name -> the checkpoint's, after the layer's prefix ("midlayer." or "layers.0.").
_LAYER_NAMES = {
    "input_layernorm": "input_layernorm.weight", "hidden_norm": "hidden_norm.weight",
    "q_proj": "self_attn.q_proj.weight", "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight", "o_proj": "self_attn.o_proj.weight",
    "post_attention_layernorm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight"}
_TOP_NAMES = {"fc": "fc.weight", "norm": "norm.weight", "lm_head": "lm_head.weight",
              "embed_tokens": "embed_tokens.weight", "d2t": "d2t"}


@dataclass
class Eagle3Head:
    """A loaded head: its config, weights (`models.eagle3.HEAD_WEIGHTS`, plus
    "embed_tokens" when it has its own) and where it came from."""

    cfg: Eagle3Config
    params: dict
    source: str = ""

    @property
    def weight_bytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in self.params.values())


def head_config(hf: dict) -> Eagle3Config:
    """The head's config from its `config.json` (either layout).

    Raises:
        ValueError: Not an EAGLE-3 head's config (message names the field).
    """
    layer_hf = hf.get("transformer_layer_config", hf)  # speculators nest the layer's
    if "draft_vocab_size" not in hf and "draft_vocab_size" not in layer_hf:
        raise ValueError(f"{_FIELD}: config.json is not an EAGLE-3 head's (no "
                         "draft_vocab_size; architectures "
                         f"{hf.get('architectures')})")
    get = lambda key, default=None: hf.get(key, layer_hf.get(key, default))  # noqa: E731
    layer = arch_config_from_hf({**layer_hf, "architectures": ["LlamaForCausalLM"],
                                 "model_type": "llama", "num_hidden_layers": 1})
    ids = get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(layer, int(layer_hf["vocab_size"]), int(get("draft_vocab_size")),
                        int(get("target_hidden_size") or layer.hidden_size),
                        None if ids is None else tuple(int(i) for i in ids),
                        bool(get("norm_before_residual", False)))


def load_eagle3(path: str, dtype) -> Eagle3Head:
    """Reads a head from directory `path` into `dtype` (d2t as int32).

    Raises:
        ValueError: No head at `path`, a weight missing or of the wrong shape, or a d2t
            that maps outside the vocabulary (messages name `speculative_config.model`).
    """
    if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"{_FIELD}: no EAGLE-3 head at {path!r} (a directory with "
                         "config.json and *.safetensors)")
    cfg = head_config(read_config(path))
    try:
        src = SafetensorsDir(path)
    except ValueError as e:
        raise ValueError(f"{_FIELD}: {e}") from None
    names = set(src.names())
    prefix = next((p for p in ("midlayer.", "layers.0.", "model.layers.0.")
                   if p + "input_layernorm.weight" in names), None)
    if prefix is None:
        raise ValueError(f"{_FIELD}: {path} holds no decoder layer (midlayer.* or layers.0.*)")
    wanted = {k: prefix + v for k, v in _LAYER_NAMES.items()}
    wanted.update({k: next((n for n in (v, "model." + v) if n in names), v)
                   for k, v in _TOP_NAMES.items()})
    lc, h = cfg.layer, cfg.hidden_size
    shapes = {"fc": None, "lm_head": (cfg.draft_vocab_size, h), "d2t": (cfg.draft_vocab_size,),
              "q_proj": (lc.num_heads * lc.head_dim, 2 * h),
              "k_proj": (lc.num_kv_heads * lc.head_dim, 2 * h),
              "v_proj": (lc.num_kv_heads * lc.head_dim, 2 * h),
              "embed_tokens": (cfg.vocab_size, h)}
    params = {}
    for key, name in wanted.items():
        if name not in names:
            if key == "embed_tokens":
                continue
            if key == "d2t" and cfg.draft_vocab_size == cfg.vocab_size:
                params[key] = jnp.zeros(cfg.vocab_size, jnp.int32)  # the same vocabulary
                continue
            raise ValueError(f"{_FIELD}: {path} has no {name!r}")
        value = src.get(name)
        want = shapes.get(key)
        if want is not None and value.shape != want:
            raise ValueError(f"{_FIELD}: {name} of {path} is {value.shape}, the config "
                             f"makes it {want}")
        params[key] = (jnp.asarray(value, jnp.int32) if key == "d2t"
                       else jnp.asarray(value.astype(np.float32), dtype))
    targets = np.arange(cfg.draft_vocab_size) + np.asarray(params["d2t"])
    if targets.min() < 0 or targets.max() >= cfg.vocab_size:
        raise ValueError(f"{_FIELD}: d2t of {path} maps draft ids outside the "
                         f"{cfg.vocab_size}-token vocabulary")
    if params["fc"].shape[0] != h or params["fc"].shape[1] % cfg.target_hidden_size:
        raise ValueError(f"{_FIELD}: fc.weight of {path} is {params['fc'].shape}; it must "
                         f"be [{h}, n * target_hidden_size={cfg.target_hidden_size}]")
    return Eagle3Head(cfg, params, path)


def llama_layer_config(lc, vocab_size: int) -> dict:
    """A one-layer Llama `config.json` of an `ArchConfig`'s widths (no rope scaling): what a
    head's layer is saved as, and read back through `arch_config_from_hf`."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "num_hidden_layers": 1, "hidden_size": lc.hidden_size,
            "intermediate_size": lc.intermediate_size, "num_attention_heads": lc.num_heads,
            "num_key_value_heads": lc.num_kv_heads, "head_dim": lc.head_dim,
            "rms_norm_eps": lc.rms_norm_eps, "rope_theta": lc.rope_theta,
            "max_position_embeddings": lc.max_position_embeddings, "hidden_act": "silu",
            "vocab_size": vocab_size}


def save_eagle3(directory: str, cfg: Eagle3Config, params: dict) -> str:
    """Writes a head in the EAGLE-3 layout `load_eagle3` (and vLLM) reads: `config.json`
    (a one-layer Llama config with `draft_vocab_size`, `target_hidden_size` and the aux
    layer ids) and `model.safetensors` (`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t` as
    int64 and the `t2d` mask).

    Args:
        directory: Where to write (made if missing).
        cfg: The head's config (its `layer` a Llama layer: no rope scaling is written).
        params: Its weights by `models.eagle3.HEAD_WEIGHTS` names ([out, in]), any arrays.

    Returns:
        `directory`.
    """
    names = {}
    for key, value in params.items():
        value = np.asarray(value)
        if key == "d2t":
            names["d2t"] = value.astype(np.int64)
        elif key in _LAYER_NAMES:
            names["midlayer." + _LAYER_NAMES[key]] = value.astype(np.float32)
        else:
            names[_TOP_NAMES[key]] = value.astype(np.float32)
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[np.arange(cfg.draft_vocab_size) + names["d2t"]] = True
    names["t2d"] = t2d
    config = {**llama_layer_config(cfg.layer, cfg.vocab_size),
              "architectures": ["LlamaForCausalLMEagle3"],
              "draft_vocab_size": cfg.draft_vocab_size,
              "target_hidden_size": cfg.target_hidden_size,
              "norm_before_residual": cfg.norm_before_residual}
    if cfg.aux_layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = list(cfg.aux_layer_ids)
    os.makedirs(directory, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in names.items()},
              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return directory
