"""Engine configuration: frozen dataclasses built from vLLM-style keyword arguments.

Every engine argument is validated here, once, with a `ValueError` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from jaxserve.config_checks import check as _check
from jaxserve.config_checks import check_types as _check_types
from jaxserve.config_devices import LoRAConfig, ParallelConfig
from jaxserve.multimodal.config import MultiModalConfig
from jaxserve.pooling_params import RUNNERS, TASKS, PoolerConfig
from jaxserve.sampling_params import LOGPROBS_MODES
from jaxserve.speculative_config import SPECULATIVE_METHODS, SpeculativeConfig  # noqa: F401
from models.quant import QUANTIZATIONS

PREEMPTION_MODES = ("recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")
# The scheduling modes the benchmarks compare; the last is the default engine.
SCHEDULING_MODES = ("naive", "static", "continuous", "continuous+chunked")
# "auto" (vLLM's default): float32 on the CPU, else the checkpoint's dtype (bfloat16 for
# most; `models.loaders.serving_dtype`).
DTYPES = ("auto", "float32", "bfloat16")
# "auto": the model dtype (float16 for a GGUF's blocks on the CPU: `Model.kv_dtype`); "fp8"
# is vLLM's alias of "fp8_e4m3".
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8", "fp8_e4m3",
                   "fp8_e5m2")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights, in which dtype, and how long a sequence may grow.

    Attributes:
        model: GGUF file, HF directory, jaxserve checkpoint, a Hugging Face hub id
            (`Qwen/Qwen3-0.6B`), an fsspec URL (`gs://bucket/model`), or None for the
            default model (`models.loaders.model_source`).
        revision: The hub revision (branch, tag or commit) of a hub id (default: main).
        download_dir: The hub cache directory, or where URLs are copied (default: the
            hub's own cache, ~/.cache/jaxserve/models for URLs).
        tokenizer_revision: The hub revision of a hub id's tokenizer (default: `revision`).
        dtype: "auto" (the default, as vLLM's: float32 on the CPU backend, where XLA
            emulates bfloat16; on GPU/TPU the checkpoint's dtype, bfloat16 for float32 and
            float16 checkpoints), "float32" or "bfloat16".
        max_model_len: Longest prompt + output; None: the model's own context length
            (`max_position_embeddings`, a GGUF file's `context_length`), as vLLM's, or the
            longest request the KV pool holds when that is less (logged).
        attention_backend: "auto", "xla", "cpu" (XLA with a C++ decode kernel; the CPU's
            default where it builds) or "pallas" (see `pallas_kernels.ops`).
        seed: Seed of the engine's random stream (unseeded requests draw from it).
        quantization: Weight format on the device: None (the source's own; a GGUF file
            keeps its quantized types, on the CPU where the `cpu` backend's kernel reads
            them in place, else it is dequantized there), "none" (dense `dtype`), "gguf",
            "int8" (weight-only, per output channel) or "q8_0" (int8 in blocks of 32).
        runner: "generate" (the default) or "pooling" (embeddings: `LLM.embed`,
            `/v1/embeddings`; such an engine refuses generation and the other way round).
        task: vLLM's older spelling: "embed" (the pooling runner) or "generate".
        pooler_config: The pooler (`jaxserve.pooling_params.PoolerConfig`, or a dict / JSON
            of its fields `pooling_type`, `normalize`, `dimensions`); parsed here. None:
            the model directory's sentence-transformers pooling (`modules.json`), else
            LAST and normalized (vLLM's defaults).
        override_pooler_config: vLLM's older name of `pooler_config` (either, not both).
        hf_overrides: vLLM's: fields merged into the model's `config.json` (a Qwen3-Reranker's
            `classifier_from_token`, `is_original_qwen3_reranker`: `models.seq_cls_convert`).
        convert: vLLM's `--convert`: "auto"/"none", "classify" (a `*ForCausalLM` as its
            `*ForSequenceClassification`) or "embed" (a classifier's decoder as an embedder).
        batch_invariant: Every request's logits bit-for-bit the same whatever shares its
            step, chunk sizes and buckets (`pallas_kernels.invariant`); "xla" and "cpu"
            backends, float weights or quantized, one device.
        enable_return_routed_experts: Every completion also carries the experts its tokens
            were routed to (`CompletionOutput.routed_experts`; a mixture of experts only;
            routing replay in RL training). Off: the step programs are unchanged.
        max_logprobs: Most `logprobs` / `prompt_logprobs` a request may ask for (vLLM's,
            default 20); -1: the whole vocabulary. Above 20 warm-up compiles one more
            top-logprobs width (`jaxserve.sample.metadata.logprobs_widths`).
        logprobs_mode: What sample logprobs hold (`LOGPROBS_MODES`, vLLM's): "raw_logprobs"
            (the default: log-softmax of the model's logits), "raw_logits", or
            "processed_logprobs" / "processed_logits" (after the logit controls, penalties,
            temperature and min-p / top-k / top-p the sampler applied; dropped tokens -inf).
            Prompt logprobs are raw log-softmax in every mode, as vLLM's.
    """

    model: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    tokenizer_revision: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    attention_backend: str = "auto"
    seed: int = 0
    quantization: str | None = None
    runner: str = "generate"
    task: str | None = None
    pooler_config: object = None
    override_pooler_config: object = None
    hf_overrides: object = None
    convert: str = "auto"
    batch_invariant: bool = False
    enable_return_routed_experts: bool = False
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"

    def __post_init__(self):
        _check_types(self)
        _resolve_runner(self)
        _check(self.max_logprobs >= -1, "max_logprobs", self.max_logprobs,
               "-1 (the whole vocabulary) or a non-negative integer")
        _check(self.logprobs_mode in LOGPROBS_MODES, "logprobs_mode", self.logprobs_mode,
               f"one of {LOGPROBS_MODES}")
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {DTYPES}")
        _check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len",
               self.max_model_len, "a positive integer")
        _check(isinstance(self.seed, int), "seed", self.seed, "an integer")
        _check(self.quantization is None or self.quantization in QUANTIZATIONS, "quantization",
               self.quantization, f"None or one of {QUANTIZATIONS}")


def _resolve_runner(cfg: ModelConfig) -> None:
    """Sets `runner` from vLLM's `task` and parses the pooler (on a frozen config)."""
    _check(cfg.runner in RUNNERS, "runner", cfg.runner, f"one of {RUNNERS}")
    if cfg.task is not None:
        _check(cfg.task in TASKS, "task", cfg.task, f"one of {tuple(TASKS)}")
        if cfg.runner != "generate" and TASKS[cfg.task] != cfg.runner:
            raise ValueError(f"task={cfg.task!r} contradicts runner={cfg.runner!r}")
        object.__setattr__(cfg, "runner", TASKS[cfg.task])
    if cfg.pooler_config is not None and cfg.override_pooler_config is not None:
        raise ValueError("pooler_config and override_pooler_config both given; use "
                         "pooler_config")
    given = cfg.pooler_config if cfg.pooler_config is not None else cfg.override_pooler_config
    object.__setattr__(cfg, "pooler_config", None if given is None else PoolerConfig.parse(given))
    object.__setattr__(cfg, "override_pooler_config", None)
    from models.seq_cls_convert import CONVERTS

    _check(cfg.convert in CONVERTS, "convert", cfg.convert, f"one of {CONVERTS}")
    _check(cfg.hf_overrides is None or isinstance(cfg.hf_overrides, dict), "hf_overrides",
           cfg.hf_overrides, "a dict of config.json fields")


@dataclass(frozen=True)
class CacheConfig:
    """The KV page pool and the host swap space.

    The engine arguments keep vLLM's names (`block_size`, `num_kv_blocks`); inside the
    engine a block is a page (`page_size`, `num_pages`), translated here (`page_size`) and
    where the pool is sized (`runner.sizing.pool_pages`).

    Attributes:
        block_size: Tokens per KV page (`page_size` inside the engine).
        num_kv_blocks: Fix the page count (the null page included); None sizes the pool
            from memory.
        gpu_memory_utilization: Fraction of accelerator memory for weights + KV.
        kv_cache_memory_gib: KV budget where the device reports no memory (the CPU): host
            memory for one replica's whole pool, all tensor-parallel shards together.
        swap_space: Host swap pool per engine in GiB (preemption_mode="swap").
        enable_prefix_caching: Reuse full pages across requests by content hash.
        num_state_snapshots: For a model with linear-attention layers and prefix caching,
            the state slots kept for snapshots of page-aligned prefixes' states (a hit
            resumes one; least recently used evicted), taken out of the KV memory budget
            like the requests' slots. None: `max_num_seqs`; 0: prefix caching off for such
            models.
        watermark: Fraction of pages kept free when admitting new requests.
        kv_cache_dtype: "auto" (the model dtype; float16 for a GGUF file's blocks served
            in place on the CPU, `Model.kv_dtype`), "float32", "float16" or "bfloat16"
            (pages of that dtype, widened to float32 by the XLA and `cpu` attention
            paths; the Pallas kernels read the model dtype only), or "int8", "fp8" /
            "fp8_e4m3" or "fp8_e5m2": 8-bit K/V with one float32 scale per token and head,
            stored in the page.
        disable_hybrid_kv_cache_manager: Keep one block table for every layer of a model
            mixing sliding-window and full-attention layers (Gemma 2/3), so sliding layers
            hold their whole context too (vLLM's flag). Off by default: each kind of layer
            gets its KV cache groups and sliding pages go back while a request runs
            (`models.kv_groups`).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_gib: float = 1.0
    swap_space: float = 4.0
    enable_prefix_caching: bool = True
    num_state_snapshots: int | None = None
    watermark: float = 0.01
    kv_cache_dtype: str = "auto"
    disable_hybrid_kv_cache_manager: bool = False

    @property
    def page_size(self) -> int:
        """Token slots per KV page: the engine argument `block_size` under the name the
        engine uses inside."""
        return self.block_size

    def __post_init__(self):
        _check_types(self)
        _check(self.block_size in (8, 16, 32, 64, 128), "block_size", self.block_size,
               "one of 8, 16, 32, 64, 128")
        _check(self.num_kv_blocks is None or self.num_kv_blocks >= 2, "num_kv_blocks",
               self.num_kv_blocks, "at least 2 (page 0 is the null page)")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
               self.gpu_memory_utilization, "in (0, 1]")
        _check(self.kv_cache_memory_gib > 0, "kv_cache_memory_gib", self.kv_cache_memory_gib,
               "positive")
        _check(self.swap_space >= 0, "swap_space", self.swap_space, "non-negative (GiB)")
        _check(0 <= self.watermark < 1, "watermark", self.watermark, "in [0, 1)")
        _check(self.num_state_snapshots is None or self.num_state_snapshots >= 0,
               "num_state_snapshots", self.num_state_snapshots, "None or >= 0")
        _check(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype,
               f"one of {KV_CACHE_DTYPES}")


@dataclass(frozen=True)
class SchedulerConfig:
    """How each step's token budget is filled.

    Attributes:
        max_num_seqs: Most requests in one step.
        max_num_batched_tokens: Token budget of one step (None: 512 with chunked prefill,
            else max_model_len).
        enable_chunked_prefill: Cut long prompts into chunks sharing steps with decodes.
        long_prefill_token_threshold: Cap on one request's chunk (0: no cap).
        preemption_mode: "recompute" or "swap".
        scheduling_policy: "fcfs" or "priority" (lower value first).
        scheduling_mode: "continuous+chunked" (default), "continuous" (whole prompts:
            chunked prefill off), or the benchmarks' baselines "static" (fixed batches that
            wait for their slowest member) and "naive" (one request at a time), which an
            engine schedules with `jaxserve.core.baseline_schedulers`' variants.
        async_scheduling: Schedule and dispatch each step while the previous one runs on
            the device, its sampled ids fed to the next step there (vLLM's async
            scheduling); False keeps one step at a time (for debugging). Steps fall back
            to one at a time while a request needs what they would overlap (penalties,
            bad words, prompt logprobs, n > 1 forking, beam search).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    scheduling_mode: str = "continuous+chunked"
    async_scheduling: bool = True

    def __post_init__(self):
        _check_types(self)
        _check(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "at least 1")
        _check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
               "max_num_batched_tokens", self.max_num_batched_tokens, "at least 1")
        _check(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
               self.long_prefill_token_threshold, "non-negative")
        _check(self.preemption_mode in PREEMPTION_MODES, "preemption_mode",
               self.preemption_mode, f"one of {PREEMPTION_MODES}")
        _check(self.scheduling_policy in SCHEDULING_POLICIES, "scheduling_policy",
               self.scheduling_policy, f"one of {SCHEDULING_POLICIES}")
        _check(self.scheduling_mode in SCHEDULING_MODES, "scheduling_mode",
               self.scheduling_mode, f"one of {SCHEDULING_MODES}")

    @property
    def chunked(self) -> bool:
        """Whether prompts may be split across steps."""
        return self.enable_chunked_prefill and self.scheduling_mode == "continuous+chunked"


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; build it with `EngineConfig.from_kwargs`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)  # images in prompts
    warmup: bool = True
    compilation_cache_dir: str | None = None
    # vLLM's `speculative_config` (dict or JSON), parsed by `from_kwargs`; None: off.
    speculative_config: SpeculativeConfig | None = None

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Sorts vLLM-style flat keyword arguments into the sub-configs.

        Raises:
            ValueError: An unknown argument (the message lists the known ones) or a value
                outside its range (the message names the field).
        """
        groups = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                  "parallel": ParallelConfig, "lora": LoRAConfig, "multimodal": MultiModalConfig}
        known = {f.name: g for g, c in groups.items() for f in dataclasses.fields(c)}
        top = {"warmup", "compilation_cache_dir", "speculative_config"}
        unknown = sorted(set(kwargs) - set(known) - top)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {', '.join(unknown)}; known: "
                             f"{', '.join(sorted([*known, *top]))}")
        parts = {g: c(**{k: v for k, v in kwargs.items() if known.get(k) == g})
                 for g, c in groups.items()}
        extra = {k: kwargs[k] for k in top if k in kwargs}
        if "speculative_config" in extra:
            extra["speculative_config"] = SpeculativeConfig.from_dict(extra["speculative_config"])
        return cls(**parts, **extra)
