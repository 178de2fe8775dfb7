"""Resolves the engine's sizes: max_model_len, token budget, and KV page count from memory."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import jax
import numpy as np

from jaxserve.config import EngineConfig
from jaxserve.core.state_backups import default_num_backup_slots
from jaxserve.core.state_slots import (
    StateGroupSpec,
    default_num_state_slots,
    num_pages_after_state,
)
from jaxserve.parallel.layouts import splits_linear_layers
from jaxserve.utils import cdiv
from pallas_kernels.kv_quant import kv_pool_layout

logger = logging.getLogger("jaxserve")
DEFAULT_CHUNKED_BUDGET = 512


@dataclass(frozen=True)
class Limits:
    """Sizes fixed at start-up.

    Attributes:
        max_model_len: Longest prompt + output.
        max_num_batched_tokens: Token budget of one step (largest bucket).
        num_pages: KV pages in the pool, the null page included.
        bytes_per_page: Bytes one page holds across all its layers (K and V): every layer
            with one KV cache group, `KVGroupLayout.num_slots` of them with several.
    """

    max_model_len: int
    max_num_batched_tokens: int
    num_pages: int
    bytes_per_page: int


def page_bytes(model, page_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one KV page of `model` across the layers a page holds (`Model.kv_pages_shape`:
    all of them, or a hybrid layout's `num_slots`), K and V (8-bit: codes + scales)."""
    shape, dtype = kv_pool_layout(model.kv_pages_shape(1, page_size), model.kv_dtype,
                                  kv_cache_dtype)
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


def resolve_limits(config: EngineConfig, model, max_model_len: int | None = None) -> Limits:
    """Fills in the sizes the config left open and checks they fit together.

    Args:
        config: The engine's configuration.
        model: The serving model (its KV cache groups set).
        max_model_len: The longest sequence served, already resolved (`Worker` fits the
            default to the pool: `fit_max_model_len`); None: `resolve_max_model_len`.

    Raises:
        ValueError: max_model_len over the model's limit, a token budget that cannot hold
            a whole prompt without chunking, or a pool too small for one sequence.
    """
    cc, sc = config.cache, config.scheduler
    if max_model_len is None:
        max_model_len = resolve_max_model_len(config, model)
    if sc.chunked:
        budget = sc.max_num_batched_tokens or max(DEFAULT_CHUNKED_BUDGET, sc.max_num_seqs)
        if budget < sc.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={budget} must be >= max_num_seqs="
                             f"{sc.max_num_seqs}")
    else:
        budget = sc.max_num_batched_tokens or max(max_model_len, sc.max_num_seqs)
        if budget < max_model_len:
            raise ValueError(f"max_num_batched_tokens={budget} is smaller than max_model_len="
                             f"{max_model_len}; without chunked prefill a whole prompt must "
                             "fit one step (enable chunked prefill or raise the budget)")
    per_page = page_bytes(model, cc.page_size, cc.kv_cache_dtype)
    num_pages = pool_pages(config, model, per_page)
    min_pages = pages_per_sequence(model.kv_groups, max_model_len, cc.page_size) + 1
    if num_pages < 2:
        raise ValueError(f"num_kv_blocks={num_pages}: the pool needs at least 2 pages")
    if num_pages < min_pages:
        logger.warning("jaxserve: %d KV pages hold less than one max_model_len=%d sequence; "
                       "longer prompts are rejected and longer outputs end as length-capped",
                       num_pages, max_model_len)
    return Limits(max_model_len, budget, num_pages, per_page)


def pool_pages(config: EngineConfig, model, per_page: int | None = None) -> int:
    """KV pages in the pool, the null page included: the engine argument `num_kv_blocks`
    (vLLM's name, read here only), else what the memory budget holds (the same on every
    process).

    Args:
        per_page: Bytes of one page (`page_bytes`; computed when None).
    """
    cc, ranks = config.cache, config.parallel.attention_ranks
    if cc.num_kv_blocks is not None:
        if cc.num_kv_blocks % ranks:
            raise ValueError(f"num_kv_blocks={cc.num_kv_blocks} must be a multiple of the "
                             f"{ranks} attention ranks (enable_dp_attention: each holds an "
                             "equal share of the pool)")
        return cc.num_kv_blocks
    if per_page is None:
        per_page = page_bytes(model, cc.page_size, cc.kv_cache_dtype)
    # NOTE: under tensor parallelism each device holds its KV heads' share of a page.
    # A latent pool (multi-head latent attention) is whole on every device.
    kv_shards = 1 if model.cfg.is_mla else min(config.parallel.tensor_parallel_size,
                                               model.cfg.kv_pool_heads[0])
    pages = agree_across_processes(_pages_from_memory(config, per_page // kv_shards,
                                                      state_group(config, model)))
    return max(pages // ranks * ranks, 2 * ranks)


def state_group(config: EngineConfig, model) -> StateGroupSpec | None:
    """The state group of a model with linear-attention layers (None for others): one slot
    per sequence the scheduler runs plus the null slot (`default_num_state_slots`), each of
    `Model.state_bytes_per_slot` split over the tensor-parallel devices as the state pools
    are (`TensorParallel.state_shardings`: by the layers' heads, which the size divides; whole on
    every device for Mamba-2 layers, `splits_linear_layers`). With a `speculative_config`,
    backup slots come on top (`default_num_backup_slots`: one per sequence), into which a
    verifying request's state is copied before its step. With prefix caching,
    `num_state_snapshots` more rows (None: `max_num_seqs`) hold its state snapshots
    (`StateSnapshots`). The KV manager's host slots follow `swap_space` (`KVCacheManager`)."""
    if not model.has_linear_attention:
        return None
    shards = config.parallel.tensor_parallel_size if splits_linear_layers(model.cfg) else 1
    max_num_seqs, cc = config.scheduler.max_num_seqs, config.cache
    backups = default_num_backup_slots(max_num_seqs, config.speculative_config is not None)
    snapshots = 0
    if cc.enable_prefix_caching:
        snapshots = max_num_seqs if cc.num_state_snapshots is None else cc.num_state_snapshots
    return StateGroupSpec(default_num_state_slots(max_num_seqs) + backups,
                          model.state_bytes_per_slot // shards, num_backup_slots=backups,
                          num_snapshot_slots=snapshots)


def resolve_max_model_len(config: EngineConfig, model) -> int:
    """The longest sequence served: the configured one, else the model's own context length
    (`max_position_embeddings`; a GGUF file's `context_length`), as vLLM's default
    (`fit_max_model_len` then lowers the default to what the KV pool holds).

    Raises:
        ValueError: max_model_len over the model's `max_position_embeddings`.
    """
    limit = model.cfg.max_position_embeddings
    max_model_len = config.model.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={limit}")
    return max_model_len


def fit_max_model_len(config: EngineConfig, model, max_model_len: int) -> int:
    """The default `max_model_len` (the model's context length) lowered, when the KV pool
    cannot hold one request that long, to the longest one it holds (logged with the
    reason); a configured `max_model_len` is returned as given (a pool too small for it
    is `resolve_limits`' warning).

    Args:
        config: The engine's configuration.
        model: The serving model, its KV cache groups set (`Model.kv_groups`).
        max_model_len: `resolve_max_model_len`'s value.
    """
    if config.model.max_model_len is not None:
        return max_model_len
    page_size, layout = config.cache.page_size, model.kv_groups
    num_pages = pool_pages(config, model)
    fits = lambda n: pages_per_sequence(layout, n, page_size) + 1 <= num_pages
    if num_pages < 2 or fits(max_model_len):
        return max_model_len
    lo, hi = 0, max_model_len  # the longest that fits is in [lo, hi]; fits(0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    # NOTE: a pool that holds no token of every group is `resolve_limits`' warning.
    lo = max(lo, 1)
    budget = (f"num_kv_blocks={config.cache.num_kv_blocks}" if config.cache.num_kv_blocks
              else "the KV memory budget (gpu_memory_utilization, or kv_cache_memory_gib "
              "where the device reports no memory)")
    logger.warning("jaxserve: max_model_len=%d, not the model's context length %d: the KV "
                   "pool (%d pages of %d tokens, from %s) holds no longer request; raise the "
                   "budget or set max_model_len to silence this", lo, max_model_len,
                   num_pages, page_size, budget)
    return lo


def pages_per_sequence(layout, max_model_len: int, page_size: int) -> int:
    """Pages one sequence of `max_model_len` tokens holds at most, over all KV cache groups
    of `layout` (`KVGroupLayout`): a full-attention group its whole table, a sliding group
    the pages of its window and one more (one step's tokens may straddle a page)."""
    full = cdiv(max_model_len, page_size)
    return sum(full if not window else min(full, cdiv(abs(window), page_size) + 1)
               for window in layout.windows)


def _pages_from_memory(config: EngineConfig, per_device_page: int,
                       states: StateGroupSpec | None = None) -> int:
    """Pages that fit the memory budget: a fraction of each accelerator's memory, or a
    fixed `kv_cache_memory_gib` of host memory where the device reports no limit (the CPU),
    less the state group's slots when there is one (`num_pages_after_state`).

    Args:
        per_device_page: Bytes of one page on one device (its KV heads' share).
        states: The state group (`state_group`; `bytes_per_slot` on one device), or None.

    Raises:
        ValueError: The state slots alone outgrow the budget (naming the settings to change).
    """
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    per_slot = 0 if states is None else states.bytes_per_slot
    # NOTE: data-parallel attention splits the pool by pages over its ranks (each device
    # holds 1/ranks of the pages), where expert parallelism alone copies it on each.
    ranks = config.parallel.attention_ranks
    if limit:
        free = limit * config.cache.gpu_memory_utilization - stats.get("bytes_in_use", 0)
        budget = max(free * 0.9, 0) * ranks  # NOTE: 10% left for activations and logits
    else:
        # NOTE: CPU "devices" all live in host memory, so the budget covers every shard of
        # the replica together (KV heads replicated across shards, and the pool's copy on
        # each expert-parallel group, count once per copy).
        copies = config.parallel.devices_per_replica // ranks
        per_device_page, per_slot = per_device_page * copies, per_slot * copies
        budget = config.cache.kv_cache_memory_gib * 2**30
    if states is None:
        return max(2, int(budget // per_device_page))
    if states.num_rows * per_slot > budget:
        knob = "gpu_memory_utilization" if limit else "kv_cache_memory_gib"
        raise ValueError(f"{states.num_rows} linear-attention state slots of {per_slot} bytes "
                         f"outgrow the KV memory budget ({budget / 2**20:.1f} MiB): lower "
                         f"max_num_seqs (one slot each, two with speculative decoding, plus "
                         f"the null slot) or num_state_snapshots ({states.num_snapshot_slots} "
                         f"prefix-caching snapshots), or raise {knob}")
    return max(2, num_pages_after_state(int(budget), per_device_page, states.num_rows,
                                        per_slot))


def agree_across_processes(num_pages: int) -> int:
    """The smallest page count any process found room for (processes size their pools
    from their own devices' free memory, and every process must build the same pool)."""
    if jax.process_count() == 1:
        return num_pages
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.array([num_pages], np.int32))))
