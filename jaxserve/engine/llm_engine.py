"""`LLMEngine`: requests in, one scheduled + executed + detokenized step at a time, outputs out."""

from __future__ import annotations

import logging

from jaxserve.compilation_cache import drop_staging_caches
from jaxserve.config import EngineConfig
from jaxserve.core.baseline_schedulers import scheduler_class
from jaxserve.engine.engine_metrics import EngineMetrics
from jaxserve.engine.engine_steps import EngineSteps, InFlight
from jaxserve.engine.images import engine_images
from jaxserve.engine.input_processor import InputProcessor
from jaxserve.engine.lora_control import LoRAControl
from jaxserve.engine.output_processor import OutputProcessor
from jaxserve.engine.pooling import POOLING_SAMPLING, make_pooler
from jaxserve.engine.routed_experts import RoutedExperts
from jaxserve.engine.sampling_inputs import SamplingInputs
from jaxserve.engine.weight_control import WeightControl
from jaxserve.outputs import RequestOutput
from jaxserve.parallel.dp_attention import check_engine_config as check_dp_attention_config
from jaxserve.parallel.dp_attention import make_kv_cache_manager
from jaxserve.pooling_params import PoolingParams
from jaxserve.request import RequestStatus
from jaxserve.runner.worker import Worker
from jaxserve.sample.metadata import RowSpec, build_sampling_metadata
from jaxserve.sampling_params import SamplingParams
from jaxserve.spec_decode.factory import make_speculator
from jaxserve.utils import delegated, delegated_property, trim_memory

logger = logging.getLogger("jaxserve")


class LLMEngine(EngineSteps):
    """Continuous-batching engine over one model.

    It owns the request flow (add, step, abort); its other calls are delegated to the
    collaborators it builds: `weights` (`WeightControl`: new weights, prefix cache,
    sleep), `loras` (`LoRAControl`: adapters), `metrics` (`EngineMetrics`: figures),
    `sampling_inputs` (`SamplingInputs`: each step's sampling arrays), and for a pooling
    engine `pooler` (`Pooler`: embeddings).

    Args:
        config: Engine configuration.
        model: An already loaded `models.model.Model` (else loaded from config).
        tokenizer: Its tokenizer (else loaded from the same source).
    """

    def __init__(self, config: EngineConfig, model=None, tokenizer=None):
        self.config = config
        check_dp_attention_config(config)
        # The model, its sizes, its devices; its KV cache groups by window (Gemma 2/3) unless
        # the hybrid KV cache is off.
        self.worker = Worker(config, model, tokenizer,
                             kv_layout=not config.cache.disable_hybrid_kv_cache_manager)
        lim, cache = self.limits, self.worker.config.cache  # an encoder's: no caching
        # The pooling runner (embeddings) or None (generation); see `engine/pooling.py`.
        self.pooler = make_pooler(config.model, self.model) \
            if config.model.runner == "pooling" else None
        ranks = 1 if self.layout is None else self.layout.num_attention_ranks
        self.kv = make_kv_cache_manager(
            ranks, lim.num_pages, cache.page_size, enable_prefix_caching=cache.enable_prefix_caching
            and (self.pooler is None or self.pooler.prefix_caching_allowed),
            watermark=cache.watermark, swap_space=cache.swap_space,
            bytes_per_page=lim.bytes_per_page, max_model_len=lim.max_model_len,
            group_windows=self.worker.kv_layout.windows,
            max_chunk_tokens=lim.max_num_batched_tokens, state_group=self.worker.state_group)
        if self.kv.prefix_caching_disabled_reason:  # asked for, but off (also on /metrics)
            logger.warning("jaxserve: %s", self.kv.prefix_caching_disabled_reason)
        # NOTE: "static" and "naive" are the benchmarks' baselines (core/baseline_schedulers.py).
        self.scheduler = scheduler_class(config.scheduler.scheduling_mode)(
            self.worker.config.scheduler, self.kv, lim.max_model_len, lim.max_num_batched_tokens,
            config.lora.max_loras if config.lora.enable_lora else None)
        self.speculator = make_speculator(
            config.speculative_config, **self.worker.draft_runner_args(self.scheduler.max_num_seqs))
        self.worker.init_device(self.scheduler.max_num_seqs, self.kv.host_pool.num_slots,
                                self.speculator.k if self.speculator else 0)
        if self.speculator is not None:
            self.speculator.attach(self.runner)
        if self.pooler is not None:
            self.runner.pooling_type = self.pooler.config.pooling_type
        self.inputs = InputProcessor(self.tokenizer, self.model.cfg.vocab_size,
                                     lim.max_model_len, self.scheduler.max_num_seqs,
                                     self.worker.eos_token_ids, config.model.seed,
                                     config.model.max_logprobs, engine_images(self))
        self.outputs = OutputProcessor(RoutedExperts(
            self.model.cfg.num_layers, self.model.cfg.num_experts_per_tok, cache.page_size,
            lim.num_pages) if config.model.enable_return_routed_experts else None)
        self.sampling_inputs = SamplingInputs(self.runner, self.outputs,
                                              self.model.cfg.vocab_size)
        self.weights = WeightControl(self.worker, self.kv, self._end_requests)
        self.loras = LoRAControl(self.runner.lora)
        self.metrics = EngineMetrics(self.worker, self.scheduler, self.outputs, self.weights,
                                     self.speculator, self.pooler)
        self.counters = {"num_steps": 0}
        # Whether steps overlap (may be switched between steps, as tests do to compare both
        # orders on one compiled engine).
        self.async_scheduling = config.scheduler.async_scheduling
        self._pending: InFlight | None = None  # the step on the device (async scheduling)
        self._stashed: list[RequestOutput] = []  # outputs of a step finished by `flush`
        if config.warmup:
            self.warmup()

    # The worker's parts, read by the engine's users (benchmarks, tests, the server).
    model = property(lambda self: self.worker.model, doc="The served `Model`.")
    tokenizer = property(lambda self: self.worker.tokenizer, doc="The tokenizer.")
    runner = property(lambda self: self.worker.runner, doc="The `ModelRunner`.")
    layout = property(lambda self: self.worker.layout, doc="Tensor-parallel layout or None.")
    limits = property(lambda self: self.worker.limits, doc="The engine's sizes (`Limits`).")

    # Calls delegated to the collaborators (documented there).
    update_weights = delegated("weights", WeightControl.update_weights)
    get_weights = delegated("weights", WeightControl.get_weights)
    reset_prefix_cache = delegated("weights", WeightControl.reset_prefix_cache)
    sleep = delegated("weights", WeightControl.sleep)
    wake_up = delegated("weights", WeightControl.wake_up)
    is_sleeping = delegated("weights", WeightControl.is_sleeping)
    check_awake = delegated("weights", WeightControl.check_awake)
    add_lora = delegated("loras", LoRAControl.add_lora)
    remove_lora = delegated("loras", LoRAControl.remove_lora)
    list_loras = delegated("loras", LoRAControl.list_loras)
    get_metrics = delegated("metrics", EngineMetrics.get_metrics)
    cache_config_info = delegated("metrics", EngineMetrics.cache_config_info)
    kv_capacity_tokens = delegated_property("metrics", EngineMetrics.kv_capacity_tokens)
    num_scheduled_tokens = delegated_property("metrics", EngineMetrics.num_scheduled_tokens)
    num_iteration_tokens = delegated_property("metrics", EngineMetrics.num_iteration_tokens)
    num_prompt_tokens = delegated_property("metrics", EngineMetrics.num_prompt_tokens)
    warmup_progress = delegated_property("metrics", EngineMetrics.warmup_progress)

    @property
    def classifier_head(self):
        """The pooler's classifier head, or None (`EngineClient.classifier_head`)."""
        return None if self.pooler is None else self.pooler.head

    @property
    def model_source(self) -> str:
        """Where the weights came from (`EngineClient.model_source`)."""
        return self.model.source or ""

    @property
    def runner_type(self) -> str:
        """"generate" or "pooling" (`ModelConfig.runner`; vLLM's `runner_type`)."""
        return self.config.model.runner

    # ------------------------------------------------------------ requests
    @property
    def states(self) -> dict:
        """Live user requests by id (their `RequestState`s)."""
        return self.outputs.states

    @property
    def finished_reasons(self) -> dict[str, int]:
        """How many requests finished, by finish reason."""
        return self.outputs.finished_reasons

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *,
                    priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None, lora_request=None) -> None:
        """Queues a request: text, token ids, or `{"prompt_token_ids": [...]}`.

        `lora_request` (`jaxserve.lora.LoRARequest`) runs it with that adapter, loaded
        now if it is not yet. On a pooling engine (`runner="pooling"`) `params` are
        `PoolingParams` (None: the defaults), and the request is prefill only
        (`engine/pooling.py`).

        Raises:
            ValueError: Duplicate id, bad prompt or parameters, a request that can never
                fit (prompt over max_model_len, more pages than exist), an adapter without
                `enable_lora` or one that does not load (`LoRAManager.add`),
                `PoolingParams` on a generate engine, or on a pooling engine
                `SamplingParams`, bad `dimensions` or an adapter.
        """
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.weights.check_awake()
        pooling = None
        if self.pooler is not None or isinstance(params, PoolingParams):
            if self.pooler is None:
                raise ValueError("this engine runs the generate runner: embeddings "
                                 "(PoolingParams) need an engine with runner='pooling' "
                                 "(task='embed')")
            pooling = self.pooler.check(params, lora_request)
            params = POOLING_SAMPLING
        elif lora_request is not None:
            self.add_lora(lora_request)
        state = self.inputs.process(request_id, prompt, params or SamplingParams(),
                                    priority=priority, cache_salt=cache_salt,
                                    arrival_time=arrival_time, lora_request=lora_request)
        self.scheduler.add_request(state.root)
        self.outputs.add(state)
        if pooling is not None:
            self.pooler.add(request_id, pooling, len(state.prompt_token_ids))

    def fork_request(self, parent_id: str, request_id: str, prompt,
                     params: SamplingParams) -> None:
        """Queues a request that starts from another one's KV cache: like `add_request`,
        but the leading tokens of `prompt` that live request `parent_id` has alike and has
        computed are not computed again. The new request shares the parent's pages for them
        (a page both go on writing into is copied first) and runs with the parent's
        adapter, cache salt and priority. Programs that branch sequences themselves use it:
        beam search (`engine/beam_search.py`) forks each beam's continuations this way.

        Args:
            parent_id: A live request. Where it holds no pages on the device (waiting,
                preempted, swapped out) nothing is shared and the prompt is computed whole.
            request_id: The new request's id.
            prompt: Its prompt as for `add_request`, typically the parent's prompt and
                outputs so far followed by tokens of the caller's choosing.
            params: Its sampling parameters (limits such as `max_tokens` count from its
                own first output token).

        Raises:
            ValueError: An unknown parent, a pooling engine, or anything `add_request`
                refuses.
        """
        parent = self.scheduler.requests.get(parent_id)
        if parent is None:
            raise ValueError(f"fork_request: no live request {parent_id!r}")
        if self.pooler is not None:
            raise ValueError("fork_request: the pooling runner (embeddings) forks no requests")
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.weights.check_awake()
        state = self.inputs.process(request_id, prompt, params, priority=parent.priority,
                                    cache_salt=parent.cache_salt,
                                    lora_request=parent.lora_request)
        self.scheduler.add_request(state.root, kv_from=parent)
        self.outputs.add(state)
        if self.outputs.routing is not None:
            self.outputs.routing.fork(parent_id, request_id)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Ends requests now; their pages are freed at once. Unknown ids are ignored.

        Returns:
            The final output (finish_reason "abort") of each request that was live.
        """
        done = self.outputs.abort([request_ids] if isinstance(request_ids, str)
                                  else list(request_ids))
        self._finish_requests(done.to_finish)
        return done.outputs if self.pooler is None else self.pooler.outputs(done.outputs)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's and tokenizer's EOS ids, the first one the sampler's (held once, by
        the input processor, which stamps them on each request)."""
        return self.inputs.eos_token_ids

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output a request may have."""
        return self.limits.max_model_len

    @property
    def quantization(self) -> str:
        """The weight format served: the plan's name ("gguf", "int8", a checkpoint's own
        format such as "fp8"), or "none" for float weights."""
        return self.model.quant.name or "none"

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size."""
        return self.model.cfg.vocab_size

    def check_constraint(self, structured_outputs) -> None:
        """Compiles an output constraint now (the compiler's LRU keeps it for the request).

        Raises:
            ValueError: The schema, regex or grammar does not compile (naming the field).
        """
        self.inputs.grammars.compile(structured_outputs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states or self._stashed)

    def get_num_unfinished_requests(self) -> int:
        return len(self.states)

    def _end_requests(self, what: str, abort: bool) -> list[RequestOutput]:
        """Finishes the step in flight; aborts unfinished requests when `abort`, else
        refuses while there are any (`WeightControl`'s `end_requests`)."""
        self.flush()
        live = list(self.states)
        if live and not abort:
            raise ValueError(f"{what}: {len(live)} request(s) are unfinished ({live[:3]}); "
                             "let them finish or abort them first"
                             + (" (or pass abort_running=True)" if what == "update_weights"
                                else ""))
        return self.abort_request(live) if live else []

    def _finish_requests(self, to_finish: dict[str, RequestStatus]) -> None:
        """Ends the scheduler requests the output processor says are over."""
        for req_id, status in to_finish.items():
            self.scheduler.finish_request(req_id, status)

    # -------------------------------------------------------------- warmup
    def warmup(self) -> float:
        """Compiles every bucket now, so serving never compiles; returns seconds."""
        params = SamplingParams(temperature=0.0)

        def dummy(num_rows):
            return build_sampling_metadata([RowSpec(params, (), (), 0, 0)], num_rows,
                                           self.model.cfg.vocab_size)

        seconds = self.runner.warmup(dummy)
        if self.speculator is not None:
            seconds += self.speculator.warmup(dummy)
        drop_staging_caches()  # jaxprs and MLIR modules (the executables stay)
        trim_memory()  # the compilers' temporaries, freed but left in the C heap
        logger.info("jaxserve: warm-up compiled %d buckets in %.1fs", len(self.runner.buckets),
                    seconds)
        return seconds
