"""`Worker`: the model on its devices (loading, backend, layout, weight transforms, pool, runner).

The engine asks the worker for three things, in vLLM's order: the loaded model and its
tokenizer (`Worker(config, ...)`), the sizes the devices allow (`Worker.limits`: the
context length, the token budget and the KV page count), and, once the scheduler has its
sizes, the device state (`Worker.init_device`: the page pool and the compiled step
programs, owned by a `ModelRunner`). Everything that depends on the platform is decided
when it is built (`jaxserve.runner.serving`): which attention backend serves, which
tensor-parallel layout the weights take, and which serving form the weights take
(`models.linear.ServingChoice`: the `cpu` backend's packed panels, a mixture of experts'
whole stacks).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import numpy as np

from jaxserve.compilation_cache import enable_compilation_cache
from jaxserve.config import EngineConfig
from jaxserve.core.state_slots import StateGroupSpec
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.runner.serving import (
    encoder_serving_config,
    local_model_config,
    release_loader_memory,
    serving_kv_layout,
    serving_model,
    tokenizer_path,
)
from jaxserve.runner.sizing import (
    Limits,
    fit_max_model_len,
    resolve_limits,
    resolve_max_model_len,
    state_group,
)
from models.kv_groups import KVGroupLayout
from models.mla import kv_bytes_report
from models.model import Model
from models.vision.towers import SERVED as SERVED_VISION

logger = logging.getLogger("jaxserve")


class Worker:
    """Owns the model on its devices and the runner that steps it.

    Args:
        config: Engine configuration (a hub id or URL model is fetched to a local path
            first: `local_model_config`; `Worker.config` holds that path).
        model: An already loaded model (else loaded from `config.model`).
        tokenizer: Its tokenizer (else loaded from the model's source).
        kv_layout: The KV cache groups (`serving_kv_layout`): True groups the model's
            layers by window (a hybrid KV cache for Gemma 2/3-like models), False keeps
            one group, a `KVGroupLayout` is used as given, None keeps the given model's
            (one group for a model loaded here). It sets the pool's
            layers per page, hence `limits.num_pages`, and the runner's block tables.

    Attributes:
        model: The model in its serving form (`serving_model`), with its `kv_layout`.
        kv_layout: The resolved layout (`Model.kv_groups`: one group when not hybrid); the
            KV cache manager must use the same groups.
        layout: Its tensor-parallel layout, or None for the default device.
        tokenizer: The tokenizer.
        limits: The engine's sizes (`resolve_limits`).
        runner: The `ModelRunner`, once `init_device` has run.

    Raises:
        ValueError: A model, layout or size the config cannot serve (naming the setting).
    """

    def __init__(self, config: EngineConfig, model: Model | None = None, tokenizer=None,
                 kv_layout: KVGroupLayout | bool | None = None):
        from models.loaders import load_tokenizer

        tokenizer_dir = None
        if model is None:
            tokenizer_dir = tokenizer_path(config) if tokenizer is None else None
            config = local_model_config(config)
        self.config = config
        # NOTE: a cache directory the process already configured (tests, a host program)
        # is kept unless the config names one.
        if config.compilation_cache_dir or not jax.config.jax_compilation_cache_dir:
            enable_compilation_cache(config.compilation_cache_dir)
        self.model, self.layout = serving_model(config, model)
        # An encoder computes each prompt whole: `Worker.config` is what the engine schedules by.
        self.config = config = encoder_serving_config(config, self.model)
        max_model_len = resolve_max_model_len(config, self.model)
        self._set_kv_layout(max_model_len, kv_layout)
        # NOTE: the default (the model's context length) is lowered to what the pool holds.
        # A shorter length may group the layers otherwise (a window as long as it counts
        # as full attention), which changes the page size and count: fit again until it
        # holds (the length only goes down).
        while (fitted := fit_max_model_len(config, self.model, max_model_len)) \
                != max_model_len:
            max_model_len = fitted
            self._set_kv_layout(max_model_len, kv_layout)
        # NOTE: LongRoPE's factor set is fixed per engine by the longest context served
        # (as vLLM): a request's KV is never recomputed when it passes the original length.
        cfg = self.model.cfg.for_max_model_len(max_model_len)
        if cfg != self.model.cfg:
            self.model = dataclasses.replace(self.model, cfg=cfg)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(
            tokenizer_dir or self.model.source)
        if model is None:
            release_loader_memory(self.model.source)
        self.limits: Limits = resolve_limits(config, self.model, max_model_len)
        self.vision = load_vision_tower(self.model) if model is None else None
        if config.lora.enable_lora and jax.process_count() > 1:
            raise ValueError("enable_lora: LoRA adapters are served on one host only (the "
                             "adapter slots are not sent to the other processes)")
        self.runner: ModelRunner | None = None

    def _set_kv_layout(self, max_model_len: int, kv_layout) -> None:
        """Gives the model its KV cache groups for `max_model_len` (`serving_kv_layout`)."""
        layout = serving_kv_layout(self.model, max_model_len, kv_layout)
        if layout != self.model.kv_layout:
            self.model = dataclasses.replace(self.model, kv_layout=layout)

    @property
    def kv_layout(self) -> KVGroupLayout:
        """The KV cache groups served (one group, slot = layer, when not hybrid)."""
        return self.model.kv_groups

    @property
    def dtype(self) -> str:
        """The served weights' dtype name ("float32" or "bfloat16"; `dtype="auto"` resolved)."""
        return np.dtype(self.model.dtype).name

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's EOS ids and the tokenizer's, without repeats, the model's first."""
        eos = self.tokenizer.eos_token_id
        return tuple(dict.fromkeys([*self.model.cfg.eos_token_ids,
                                    *([eos] if eos is not None else [])]))

    def draft_runner_args(self, max_num_seqs: int) -> dict:
        """What a draft model's runner shares with this one (`make_speculator`'s args)."""
        lim, mc = self.limits, self.config.model
        # NOTE: the target's served dtype ("auto" resolved), so the draft matches it.
        return dict(vocab_size=self.model.cfg.vocab_size, dtype=self.dtype,
                    backend=mc.attention_backend, num_pages=lim.num_pages,
                    page_size=self.config.cache.page_size, max_model_len=lim.max_model_len,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=lim.max_num_batched_tokens,
                    target_params=self.model.weight_bytes, target=self.model)

    @property
    def state_group(self) -> StateGroupSpec | None:
        """The state group the KV manager keeps for a model with linear-attention layers
        (`sizing.state_group`: the page pool was sized after it), or None."""
        return state_group(self.config, self.model)

    def init_device(self, max_num_seqs: int, num_swap_slots: int,
                    num_spec_tokens: int = 0) -> ModelRunner:
        """Allocates the page pool (and a state group's state pools: `state_group`) and
        builds the runner (its programs compile on first use or in `ModelRunner.warmup`).

        Args:
            max_num_seqs: Most requests per step (the scheduler's).
            num_swap_slots: Host pages for swapped-out requests (the KV manager's).
            num_spec_tokens: Most proposals a request verifies per step.
        """
        states = self.state_group
        lim, cache = self.limits, self.config.cache
        self.runner = ModelRunner(self.model, lim.num_pages, cache.page_size, lim.max_model_len,
                                  max_num_seqs, lim.max_num_batched_tokens, num_swap_slots,
                                  layout=self.layout, num_spec_tokens=num_spec_tokens,
                                  kv_cache_dtype=cache.kv_cache_dtype,
                                  eos_token_id=(self.eos_token_ids or (None,))[0],
                                  kv_layout=self.model.kv_layout, lora=self.config.lora,
                                  max_logprobs=self.config.model.max_logprobs,
                                  logprobs_mode=self.config.model.logprobs_mode,
                                  routed_experts=self.config.model.enable_return_routed_experts,
                                  num_state_slots=states.num_rows if states else None)
        logger.info("jaxserve: weights %s; KV cache %s: %d pages of %d tokens = "
                    "%d tokens of capacity (%.0f MiB); max_model_len %d, token buckets %s",
                    self.model.weights_report(),
                    np.dtype(self.runner.page_pool.dtype).name, lim.num_pages, cache.page_size,
                    self.kv_capacity_tokens, lim.num_pages * lim.bytes_per_page / 2**20,
                    lim.max_model_len, self.runner.buckets)
        if self.model.cfg.is_mla:
            itemsize = np.dtype(self.runner.page_pool.dtype).itemsize
            logger.info("jaxserve: %s", kv_bytes_report(self.model.cfg, itemsize))
        if states is not None:
            logger.info("jaxserve: linear-attention state pools: %d slots (the null slot "
                        ", %d speculative-decoding backups and %d prefix-caching snapshots "
                        "included) of %.2f MiB each, %d of %d layers; the page pool holds the "
                        "other %d", states.num_rows, states.num_backup_slots,
                        states.num_snapshot_slots,
                        self.model.state_bytes_per_slot / 2**20,
                        len(self.model.cfg.linear_layers), self.model.cfg.num_layers,
                        len(self.model.cfg.attention_layers))
        if self.model.is_hybrid:
            kv = self.kv_layout
            logger.info("jaxserve: hybrid KV cache: %d groups (windows %s), %d of %d layers "
                        "per page", kv.num_groups, list(kv.windows), kv.num_slots,
                        kv.num_layers)
        return self.runner

    # ------------------------------------------------- weights and sleep
    def update_weights(self, weights) -> None:
        """Serves new weights from the next step on, without recompiling.

        Args:
            weights: A params tree in the model's standard layout (see
                `jaxserve.runner.weight_sync`; float weights of a quantized model are
                quantized by its plan), or the path of a checkpoint of the same
                architecture (loaded straight into the layout's shardings).

        Raises:
            ValueError: A tree, shape or dtype that is not the model's, or a checkpoint of
                another architecture.
        """
        from jaxserve.runner.weight_sync import checked_params, serving_params
        from models.linear import ServingChoice
        from models.loaders import load_model

        if isinstance(weights, (str, os.PathLike)):
            mc, std = self.config.model, self.model
            loaded = load_model(os.fspath(weights), self.dtype,
                                serving=ServingChoice(mc.attention_backend),
                                shardings=self.layout.param_shardings if self.layout else None,
                                quantization=mc.quantization)
            if loaded.cfg.for_max_model_len(self.limits.max_model_len) != std.cfg:
                raise ValueError(f"update_weights: {os.fspath(weights)!r} holds a "
                                 f"{loaded.cfg.architecture} of another shape than the "
                                 f"served {std.cfg.architecture}")
            weights = loaded.params
            release_loader_memory(loaded.source)
        params = serving_params(self.model, checked_params(self.model, weights))
        self.runner.set_params(params)
        self.model = dataclasses.replace(self.model, params=self.runner.params)

    def get_weights(self) -> dict:
        """The served weights in the model's standard layout (`update_weights`'s input).

        Raises:
            ValueError: The weights were dropped by `sleep(level=2)`.
        """
        from jaxserve.runner.weight_sync import standard_params

        if self.runner.params is None:
            raise ValueError("get_weights: the weights were dropped by sleep(level=2)")
        return standard_params(self.runner.model)

    def sleep(self, level: int) -> int:
        """Frees the page pool's device memory (level 2: also drops the weights); returns
        the bytes freed (weights shared with a caller's `Model` stay alive there)."""
        freed = self.runner.free_kv_pool()
        if level >= 2 and self.runner.params is not None:
            freed += sum(x.nbytes for x in jax.tree_util.tree_leaves(self.runner.params))
            self.runner.set_params(None)
            self.model = dataclasses.replace(self.model, params=None)
        return freed

    def wake_up(self, weights: bool = True, kv_cache: bool = True) -> None:
        """Restores what `sleep` freed: the weights (those dropped by `sleep(2)` are read
        again from the model's source; weights still held cost nothing) and then the page
        pool (each only when asked and missing).

        Raises:
            ValueError: The weights were dropped and the model came without a path to read
                them from (give them with `update_weights`).
        """
        if weights and self.runner.params is None:
            if not self.model.source or not os.path.exists(self.model.source):
                raise ValueError("wake_up: the weights were dropped by sleep(level=2) and "
                                 "the model has no path to read them again; give them with "
                                 "update_weights(params) first")
            self.update_weights(self.model.source)
        if kv_cache and self.runner.kv_pages is None:
            self.runner.alloc_kv_pool()

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens of context the KV pool holds (every page but the null page) when every
        KV cache group keeps every page: a hybrid cache's sliding groups hold less, so
        long requests fit more."""
        num_groups = self.kv_layout.num_groups
        return (self.limits.num_pages - 1) * self.config.cache.page_size // num_groups


def load_vision_tower(model: Model):
    """The vision tower of `model`'s checkpoint directory when its family's images are served
    (`models.vision.towers`), in the model's dtype; None for others.

    Raises:
        ValueError: Images on more than one host (the encoder cache is not sent), or a
            tower config or tensor that cannot be served (named).
    """
    from models.loaders.safetensors_dir import SafetensorsDir
    from models.vision.towers import load_vision, read_hf_config

    hf = read_hf_config(model.source) if model.source else None
    if hf is None or (hf.get("architectures") or [None])[0] not in SERVED_VISION:
        return None
    if jax.process_count() > 1:
        raise ValueError("images are served on one host only (the encoder cache's rows are "
                         "not sent to the other processes)")
    return load_vision(hf, SafetensorsDir(model.source), model.dtype)
