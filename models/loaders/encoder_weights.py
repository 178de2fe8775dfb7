"""Loads a BERT / XLM-RoBERTa safetensors directory into an `EncoderModel` (transformers'
tensor names, with or without the `bert.` / `roberta.` prefix of a task model)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from models.encoder import LAYER_LEAVES, EncoderModel
from models.encoder_config import EncoderConfig, encoder_config_from_hf
from models.loaders.safetensors_dir import SafetensorsDir, read_config

# Each layer leaf's tensor under `encoder.layer.{i}.` (matrices transposed to [in, out]).
LAYER_NAMES = dict(zip(LAYER_LEAVES, (
    "attention.self.query.weight", "attention.self.query.bias",
    "attention.self.key.weight", "attention.self.key.bias",
    "attention.self.value.weight", "attention.self.value.bias",
    "attention.output.dense.weight", "attention.output.dense.bias",
    "attention.output.LayerNorm.weight", "attention.output.LayerNorm.bias",
    "intermediate.dense.weight", "intermediate.dense.bias",
    "output.dense.weight", "output.dense.bias",
    "output.LayerNorm.weight", "output.LayerNorm.bias"), strict=True))
EMBED_NAMES = {"word": "embeddings.word_embeddings.weight",
               "position": "embeddings.position_embeddings.weight",
               "token_type": "embeddings.token_type_embeddings.weight",
               "ln_scale": "embeddings.LayerNorm.weight", "ln_bias": "embeddings.LayerNorm.bias"}
# The classification heads' tensors: beside the `bert.` / `roberta.` body, but for BERT's
# pooler, which is part of the body (`BODY_HEAD_LEAVES`).
HEAD_NAMES = {"bert": {"dense_w": "pooler.dense.weight", "dense_b": "pooler.dense.bias",
                       "out_w": "classifier.weight", "out_b": "classifier.bias"},
              "roberta": {"dense_w": "classifier.dense.weight",
                          "dense_b": "classifier.dense.bias",
                          "out_w": "classifier.out_proj.weight",
                          "out_b": "classifier.out_proj.bias"}}
BODY_HEAD_LEAVES = {"bert": ("dense_w", "dense_b"), "roberta": ()}
BODY_PREFIXES = ("", "bert.", "roberta.", "model.")
# ModernBERT's tensors: per layer under `layers.{i}.` ([out, in] as saved), and the rest.
MODERN_LAYER_NAMES = {"attn_norm": "attn_norm.weight", "wqkv": "attn.Wqkv.weight",
                      "wo": "attn.Wo.weight", "mlp_norm": "mlp_norm.weight",
                      "wi": "mlp.Wi.weight", "wout": "mlp.Wo.weight"}


def separator_id(path: str) -> int | None:
    """The tokenizer's `sep_token_id` in directory `path` (None: no tokenizer or none)."""
    if not any(os.path.exists(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).sep_token_id


def read_encoder_config(path: str) -> EncoderConfig:
    """The `EncoderConfig` of a Hugging Face directory (its tokenizer's separator included)."""
    return encoder_config_from_hf(read_config(path), separator_id(path))


class _Tensors:
    """A directory's tensors by name, the body's under whichever prefix it was saved with."""

    def __init__(self, path: str, word: str):
        self.path = path
        self.files = SafetensorsDir(path)
        names = set(self.files.names())
        self.prefix = next((p for p in BODY_PREFIXES if f"{p}{word}" in names), None)
        if self.prefix is None:
            raise ValueError(f"{path}: no tensor {word!r} (with or without a 'bert.', "
                             "'roberta.' or 'model.' prefix): not an encoder of this kind")
        self.names = names

    def get(self, name: str, body: bool = True) -> np.ndarray:
        full = f"{self.prefix}{name}" if body else name
        if full not in self.names:
            raise ValueError(f"{self.path}: missing tensor {full!r}")
        return np.asarray(self.files.get(full), np.float32)


def load_encoder(path: str, dtype=jnp.float32) -> EncoderModel:
    """An `EncoderModel` of the directory `path`, its weights in `dtype` on the default
    device.

    Raises:
        ValueError: The config's errors (`encoder_config_from_hf`), a missing tensor (named),
            or a tensor of another shape than the config gives (named).
    """
    cfg = read_encoder_config(path)
    if cfg.modern is not None:
        t = _Tensors(path, "embeddings.tok_embeddings.weight")
        params = _modernbert_params(cfg, t)
    else:
        t = _Tensors(path, EMBED_NAMES["word"])
        params = _bert_params(cfg, t)
    params = jax.device_put(jax.tree.map(lambda x: jnp.asarray(x, dtype), params))
    return EncoderModel(cfg.arch_view(), params, jnp.dtype(dtype), source=path,
                        encoder=cfg, checkpoint_bytes=t.files.tensor_bytes())


def _bert_params(cfg: EncoderConfig, t: _Tensors) -> dict:
    """BERT's / RoBERTa's host tree ({"embed", "layers", "head"}, `models.encoder`)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    want = {"word": (cfg.vocab_size, h), "position": (cfg.max_position_embeddings, h),
            "token_type": (cfg.type_vocab_size, h), "ln_scale": (h,), "ln_bias": (h,)}
    embed = {k: _shaped(t.get(n), want[k], n) for k, n in EMBED_NAMES.items()}
    layer_shapes = {"wq": (h, h), "wk": (h, h), "wv": (h, h), "wo": (h, h), "wi": (i, h),
                    "wout": (h, i)}
    layers = {}
    for leaf, name in LAYER_NAMES.items():
        stack = []
        for n in range(cfg.num_layers):
            full = f"encoder.layer.{n}.{name}"
            x = t.get(full)
            shape = layer_shapes.get(leaf, (i,) if leaf == "bi" else (h,))
            stack.append(_shaped(x, shape, full).T)  # [in, out] for matrices
        layers[leaf] = np.stack(stack)
    params = {"embed": embed, "layers": layers}
    if cfg.head is not None:
        names = HEAD_NAMES[cfg.head]
        shapes = {"dense_w": (h, h), "dense_b": (h,), "out_w": (cfg.num_labels, h),
                  "out_b": (cfg.num_labels,)}
        body = BODY_HEAD_LEAVES[cfg.head]
        params["head"] = {k: _shaped(t.get(n, body=k in body), shapes[k], n).T
                          for k, n in names.items()}
    return params


def _modernbert_params(cfg: EncoderConfig, t: _Tensors) -> dict:
    """ModernBERT's host tree (`models.modernbert.modernbert_encode`); layer 0's missing
    attention norm is ones (the layer skips it)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = {"attn_norm": (h,), "wqkv": (3 * h, h), "wo": (h, h), "mlp_norm": (h,),
              "wi": (2 * i, h), "wout": (h, i)}
    layers = {}
    for leaf, name in MODERN_LAYER_NAMES.items():
        stack = []
        for n in range(cfg.num_layers):
            full = f"layers.{n}.{name}"
            x = np.ones(h, np.float32) if (leaf == "attn_norm" and n == 0) else t.get(full)
            stack.append(_shaped(x, shapes[leaf], full).T)
        layers[leaf] = np.stack(stack)
    params = {"embed": {"word": _shaped(t.get("embeddings.tok_embeddings.weight"),
                                        (cfg.vocab_size, h), "embeddings.tok_embeddings.weight"),
                        "norm": _shaped(t.get("embeddings.norm.weight"), (h,),
                                        "embeddings.norm.weight")},
              "layers": layers,
              "final_norm": _shaped(t.get("final_norm.weight"), (h,), "final_norm.weight")}
    if cfg.head is not None:
        names = {"dense_w": ("head.dense.weight", (h, h)), "norm": ("head.norm.weight", (h,)),
                 "out_w": ("classifier.weight", (cfg.num_labels, h)),
                 "out_b": ("classifier.bias", (cfg.num_labels,))}
        params["head"] = {k: _shaped(t.get(n, body=False), shape, n).T
                          for k, (n, shape) in names.items()}
    return params


def _shaped(x: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
    if x.shape != shape:
        raise ValueError(f"tensor {name!r} has shape {x.shape}; the config gives {shape}")
    return x
