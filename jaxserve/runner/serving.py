"""What a worker serves: the model's local source, its weights loaded and moved into their
serving form (`serving_model`: the attention backend, batch invariance, the `cpu` backend's
panels, a mixture of experts' whole stacks: `models.linear.ServingChoice`), and the KV
cache layout (`serving_kv_layout`). Everything here that depends on the platform is decided
once, when the `Worker` is built.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os

import jax

from jaxserve.config import EngineConfig
from jaxserve.parallel.layouts import tensor_parallel_layout
from jaxserve.parallel.sharding import TensorParallel
from jaxserve.utils import trim_memory
from models.kv_groups import KVGroupLayout, kv_group_layout
from models.model import Model
from pallas_kernels.kv_quant import KV_CACHE_FLOATS

logger = logging.getLogger("jaxserve")


def local_model_config(config: EngineConfig) -> EngineConfig:
    """`config` with its model a local path: a hub id fetched at `revision` into
    `download_dir` (the hub's cache), an fsspec URL copied to a local cache
    (`models.loaders.model_source`); a local path or the default model is kept.

    Raises:
        ValueError: A name that resolves to nothing (the message names what was tried).
    """
    from models.loaders.model_source import local_model_path

    mc = config.model
    if mc.model is None or os.path.exists(mc.model):
        return config
    path = local_model_path(mc.model, mc.revision, mc.download_dir)
    return dataclasses.replace(config, model=dataclasses.replace(mc, model=path))


def tokenizer_path(config: EngineConfig) -> str | None:
    """The tokenizer's own local directory when `tokenizer_revision` names one for a hub id
    (`local_tokenizer_path`), else None (the tokenizer beside the weights)."""
    from models.loaders.model_source import local_tokenizer_path

    mc = config.model
    return local_tokenizer_path(mc.model, mc.tokenizer_revision, mc.download_dir)


def load_weights(config: EngineConfig, shardings=None) -> Model:
    """The weights `config.model` names, in its dtype, backend and quantization (placed by
    `shardings` when given); every engine kind loads through here."""
    from models.linear import ServingChoice
    from models.loaders import load_model

    mc = config.model
    return load_model(mc.model, mc.dtype, serving=ServingChoice(mc.attention_backend),
                      shardings=shardings, quantization=mc.quantization,
                      hf_overrides=mc.hf_overrides, convert=mc.convert)


def release_loader_memory(source: str) -> None:
    """Frees what loading `source` left on the host once its weights are on their devices
    and the tokenizer is built: a GGUF file's reader and mapping (`close_gguf`) and the
    C heap's free blocks, where the host copies of the weights were (`trim_memory`)."""
    from models.loaders.gguf_file import close_gguf

    close_gguf(source)
    gc.collect()
    trim_memory()


def serving_model(config: EngineConfig, model: Model | None
                  ) -> tuple[Model, TensorParallel | None]:
    """The model in the form it serves in, and its tensor-parallel layout.

    Loads the weights when `model` is None (already placed by the layout's shardings),
    applies the configured attention backend to a given model, falls back from the `cpu`
    backend to `xla` across a mesh (the C++ decode kernel reads one device's whole pool),
    and serves float32 or q8/q4 weights from the `cpu` backend's packed panels where they
    can (`models.linear.can_panel`; `JAXSERVE_CPU_PANELS=0` keeps XLA's matmuls, for
    comparison and debugging); a mixture of experts on one device reads its experts
    whole (`ServingChoice.whole_experts`). A given model may come in any serving form:
    its weights are moved into the one chosen here (`models.linear.serving_form`).

    Raises:
        ValueError: The `cpu` backend asked for over a tensor-parallel mesh; errors of
            loading and of the layout (`tensor_parallel_layout`).
    """
    from models.linear import can_panel, serving_form
    from models.loaders import read_arch_config

    mc = config.model
    if model is None:
        layout = tensor_parallel_layout(config, read_arch_config(mc.model, mc.hf_overrides,
                                                                    mc.convert))
        model = load_weights(config, layout.param_shardings if layout is not None else None)
    else:
        layout = tensor_parallel_layout(config, model.cfg)
    backend = model.serving.backend if mc.attention_backend == "auto" else mc.attention_backend
    if backend == "cpu" and layout is not None and layout.num_devices > 1:
        if mc.attention_backend == "cpu":
            raise ValueError("attention_backend 'cpu' serves one device's page pool; with "
                             f"tensor_parallel_size {config.parallel.tensor_parallel_size} use "
                             "'xla' (or 'auto', which picks it)")
        backend = "xla"
    if backend != model.serving.backend:  # panels serve one backend: their form is undone
        model = serving_form(model, backend=backend, panels=False)
    ranks = None if layout is None else layout.attention_ranks
    if ranks != model.serving.attention_ranks:  # data-parallel attention's per-rank kernels
        model = serving_form(model, attention_ranks=ranks)
    if mc.batch_invariant or model.serving.batch_invariant:
        check_batch_invariant(config, model, layout)
        model = serving_form(model, batch_invariant=mc.batch_invariant)
    warn_emulated_dtypes(config)
    one_device = on_one_device(model.params)
    panels = (os.environ.get("JAXSERVE_CPU_PANELS", "1") != "0"
              and can_panel(model.cfg, model.quant, model.dtype, model.serving.backend,
                            one_device))
    return serving_form(model, panels=panels, whole_experts=one_device), layout


def on_one_device(params) -> bool:
    """Whether no leaf of `params` is split or copied over several devices."""
    leaves = jax.tree_util.tree_leaves(params)
    return not any(len(x.sharding.device_set) > 1 for x in leaves if isinstance(x, jax.Array))


def warn_emulated_dtypes(config: EngineConfig) -> None:
    """Logs a warning when the config asks the CPU backend for a dtype XLA emulates there
    (bfloat16 weights, fp8 or bfloat16 KV pages): honoured, but far slower than float32
    (`dtype="auto"` picks float32 on the CPU)."""
    if jax.default_backend() != "cpu":
        return
    if config.model.dtype == "bfloat16":
        logger.warning("jaxserve: dtype='bfloat16' on the CPU backend: XLA emulates bfloat16 "
                       "matmuls there, far slower than float32 (dtype='auto', the default, "
                       "serves float32 on the CPU)")
    if config.cache.kv_cache_dtype.startswith("fp8"):
        logger.warning("jaxserve: kv_cache_dtype=%r on the CPU backend: XLA emulates fp8 "
                       "there, far slower than float32 or int8 pages (kv_cache_dtype='int8' "
                       "saves the same memory)", config.cache.kv_cache_dtype)
    if config.cache.kv_cache_dtype == "bfloat16":
        # NOTE: measured: a 32-token write into a 380 MB bfloat16 pool took 379 ms (float16
        # and float32: 0.05 ms); XLA:CPU widens the whole pool around the scatter.
        logger.warning("jaxserve: kv_cache_dtype='bfloat16' on the CPU backend: XLA converts "
                       "the whole page pool to write bfloat16 pages there, thousands of times "
                       "slower than float16 pages (kv_cache_dtype='float16' saves the same "
                       "memory)")


def check_batch_invariant(config: EngineConfig, model: Model,
                          layout: TensorParallel | None) -> None:
    """Refuses `batch_invariant` where it is not built.

    Raises:
        ValueError: naming what is not built in batch-invariant mode: the "pallas"
            backend, a tensor-parallel mesh, a mixture of experts, LoRA adapters, or an
            8-bit KV cache.
    """
    if not config.model.batch_invariant:
        return
    why = None
    if model.serving.backend not in ("xla", "cpu"):
        why = (f"attention backend {model.serving.backend!r} (built for 'xla' and 'cpu'; a GPU/TPU "
               "kernel would need splits and tiles that do not follow the step)")
    elif layout is not None and layout.num_devices > 1:
        why = f"tensor_parallel_size {config.parallel.tensor_parallel_size} (one device only)"
    elif model.cfg.is_moe:
        why = "a mixture of experts (its expert loop's row chunks follow the step's routing)"
    elif config.lora.enable_lora:
        why = "enable_lora (the adapters' matmuls are not tiled)"
    elif config.cache.kv_cache_dtype not in ("auto", *KV_CACHE_FLOATS):
        why = f"kv_cache_dtype {config.cache.kv_cache_dtype!r} (float KV pages only)"
    if why is not None:
        raise ValueError(f"batch_invariant=True is not built for {why}")


def serving_kv_layout(model: Model, max_model_len: int,
                      kv_layout: KVGroupLayout | bool | None) -> KVGroupLayout | None:
    """The KV cache layout a model serves with.

    Args:
        model: The serving model.
        max_model_len: The longest sequence served (windows this long or longer never
            give a page back: such layers count as full attention).
        kv_layout: True: the model's own groups by window (`kv_group_layout` of its
            full-attention layers' windows, `ArchConfig.attention_windows`; one group when
            every layer is alike); False: one group; a
            `KVGroupLayout`: that one; None: the model's `kv_layout` (one group unless
            the model was given one).

    Returns:
        The layout (one group of a window when every layer has it alike: the plain pool
        on the device, pages given back on the host), or None: one group, every page kept.
    """
    if isinstance(kv_layout, KVGroupLayout):
        return kv_layout
    if kv_layout is None:
        return model.kv_layout
    if not kv_layout:
        return None
    # NOTE: one group of sliding layers (Mistral) keeps its window here: the KV cache
    # manager gives its pages back too; the device serves it as the plain pool.
    return kv_group_layout(model.cfg.attention_windows, max_model_len)


def encoder_serving_config(config: EngineConfig, model: Model) -> EngineConfig:
    """`config` as an encoder-only model (`models.encoder.EncoderModel`) serves: each prompt
    whole in one step, since every token attends to the whole sequence (chunked prefill
    off) and prompts share no computed pages (prefix caching off), as vLLM does for
    encoder-only models; other models' `config` unchanged.

    Raises:
        ValueError: An encoder or a sequence classifier under runner='generate', an encoder
            with LoRA adapters or speculation.
    """
    if getattr(model, "num_labels", 0) and config.model.runner != "pooling":
        raise ValueError(f"runner={config.model.runner!r}: {model.source or 'the model'} is a "
                         "sequence classifier (no LM head); serve it with runner='pooling'")
    if getattr(model, "encoder", None) is None:
        return config
    what = f"{model.cfg.architecture} is an encoder-only model"
    if config.model.runner != "pooling":
        raise ValueError(f"runner={config.model.runner!r}: {what}; serve it with "
                         "runner='pooling' (embeddings, classification, scores)")
    if config.lora.enable_lora:
        raise ValueError(f"enable_lora: {what}; it serves no LoRA adapters")
    if config.speculative_config is not None:
        raise ValueError(f"speculative_config: {what}; it generates nothing to speculate")
    if config.scheduler.chunked or config.cache.enable_prefix_caching:
        logger.info("jaxserve: %s: chunked prefill and prefix caching off (each prompt "
                    "is computed whole in one step)", what)
    return dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, enable_chunked_prefill=False),
        cache=dataclasses.replace(config.cache, enable_prefix_caching=False))
