"""`LLMEngine`: requests in, one scheduled + executed + detokenized step at a time, outputs out."""

from __future__ import annotations

import logging
import time

import jax
import numpy as np

from jaxserve.compilation_cache import enable_compilation_cache
from jaxserve.config import EngineConfig
from jaxserve.core.kv_cache_manager import KVCacheManager
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine.request_state import RequestState, make_request
from jaxserve.engine.sizing import resolve_limits
from jaxserve.outputs import RequestOutput
from jaxserve.parallel.sharding import TensorParallel, make_tensor_parallel
from jaxserve.request import RequestStatus
from jaxserve.runner.model_runner import ModelRunner
from jaxserve.sample.metadata import RowSpec, build_sampling_metadata
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve")


def tensor_parallel_layout(config: EngineConfig, cfg) -> TensorParallel | None:
    """The mesh layout for this engine's devices, or None for the default device.

    Raises:
        ValueError: data_parallel_size > 1 (use `LLM` or `DataParallelEngine`), unknown
            device ids, or a tensor-parallel size the model's heads do not allow.
    """
    par = config.parallel
    if par.data_parallel_size > 1:
        raise ValueError("LLMEngine serves one replica; data_parallel_size > 1 needs "
                         "jaxserve.parallel.data_parallel.DataParallelEngine (LLM picks it)")
    if par.tensor_parallel_size == 1 and par.device_ids is None:
        return None
    devices = jax.devices()
    if par.device_ids is not None:
        by_id = {d.id: d for d in devices}
        missing = [i for i in par.device_ids if i not in by_id]
        if missing:
            raise ValueError(f"device_ids {missing} do not exist; devices: {sorted(by_id)}")
        devices = [by_id[i] for i in par.device_ids]
    layout = make_tensor_parallel(cfg, par.tensor_parallel_size, devices)
    logger.info("jaxserve: tensor parallel over %s (mesh %s)",
                [d.id for d in layout.mesh.devices.flat], dict(layout.mesh.shape))
    return layout


class LLMEngine:
    """Continuous-batching engine over one model.

    Args:
        config: Engine configuration.
        model: An already loaded `models.model.Model` (else loaded from config).
        tokenizer: Its tokenizer (else loaded from the same source).
    """

    def __init__(self, config: EngineConfig, model=None, tokenizer=None):
        from models.loaders import load_model, load_tokenizer, read_arch_config
        from models.model import Model

        self.config = config
        # NOTE: a cache directory the process already configured (tests, a host program)
        # is kept unless the config names one.
        if config.compilation_cache_dir or not jax.config.jax_compilation_cache_dir:
            enable_compilation_cache(config.compilation_cache_dir)
        mc = config.model
        if model is not None and mc.attention_backend != "auto":
            model = Model(model.cfg, model.params, model.dtype, model.source,
                          backend=mc.attention_backend)
        if model is None:
            self.layout = tensor_parallel_layout(config, read_arch_config(mc.model))
            shardings = self.layout.param_shardings if self.layout is not None else None
            model = load_model(mc.model, mc.dtype, mc.attention_backend, shardings=shardings)
        else:
            self.layout = tensor_parallel_layout(config, model.cfg)
        self.model = model
        if tokenizer is None:
            tokenizer = load_tokenizer(model.source)
        self.tokenizer = tokenizer
        self.limits = resolve_limits(config, self.model)
        lim = self.limits
        swap_space = config.cache.swap_space
        if jax.process_count() > 1:
            # NOTE: host swap reads pages back to this process, and across hosts a page's
            # heads live on other processes: multi-host preemption recomputes.
            if config.scheduler.preemption_mode == "swap":
                raise ValueError("preemption_mode='swap' is single-host only; use "
                                 "'recompute' across hosts")
            swap_space = 0.0
        self.kv = KVCacheManager(
            lim.num_pages, config.cache.block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            watermark=config.cache.watermark, swap_space=swap_space,
            bytes_per_page=lim.bytes_per_page, max_model_len=lim.max_model_len)
        self.scheduler = Scheduler(config.scheduler, self.kv, lim.max_model_len,
                                   lim.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, lim.num_pages, config.cache.block_size,
                                  lim.max_model_len, self.scheduler.max_num_seqs,
                                  lim.max_num_batched_tokens, self.kv.host_pool.num_slots,
                                  layout=self.layout)
        eos = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        self.eos_token_ids = tuple(dict.fromkeys([*self.model.cfg.eos_token_ids, *eos]))
        self.rng = np.random.default_rng(mc.seed)
        self.states: dict[str, RequestState] = {}
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "num_steps": 0}
        self.finished_reasons: dict[str, int] = {}
        logger.info("jaxserve: %d KV pages of %d tokens, max_model_len %d, token buckets %s",
                    lim.num_pages, config.cache.block_size, lim.max_model_len,
                    self.runner.buckets)
        if config.warmup:
            self.warmup()

    # ------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None, *,
                    priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Queues a request: text, token ids, or `{"prompt_token_ids": [...]}`.

        Raises:
            ValueError: Duplicate id, bad prompt or parameters, or a request that can never
                fit (prompt over max_model_len, more pages than exist).
        """
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        state = make_request(self, request_id, prompt, params or SamplingParams(),
                             priority=priority, cache_salt=cache_salt,
                             arrival_time=arrival_time)
        self.scheduler.add_request(state.root)
        self.states[request_id] = state
        self.counters["prompt_tokens"] += len(state.prompt_token_ids)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Ends requests now; their pages are freed at once. Unknown ids are ignored.

        Returns:
            The final output (finish_reason "abort") of each request that was live.
        """
        outputs = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            state = self.states.pop(request_id, None)
            if state is None:
                continue
            for req_id in state.live_request_ids():
                self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ABORTED)
            state.abort()
            self.finished_reasons["abort"] = self.finished_reasons.get("abort", 0) + 1
            outputs.append(state.make_output())
        return outputs

    def _fail_request(self, state: RequestState, error: BaseException | str) -> None:
        """Ends one user request with finish_reason "error" (pages freed); others go on."""
        message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        logger.warning("jaxserve: request %s failed: %s", state.request_id, message)
        for req_id in state.live_request_ids():
            self.scheduler.finish_request(req_id, RequestStatus.FINISHED_ERROR)
        state.fail(message)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.states)

    # ---------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns the outputs of requests it advanced.

        NOTE: host-side work that belongs to one request (its sampling row, its
        detokenization) is isolated: if it fails, that request ends with finish_reason
        "error" and the others in the step go on exactly as without it. Only a failure of
        the shared device step itself raises.
        """
        out = self.scheduler.schedule().decodes_first()
        if out.is_empty:
            return []
        now = time.time()
        rows, row_states = [], []
        for s in out.scheduled:
            req = self.scheduler.requests[s.request_id]
            state = self.states[req.user_request_id]
            state.on_scheduled(now)
            for k in range(s.num_samples):
                seed = req.seeds[k] if s.num_samples > 1 else req.seeds[req.sample_index]
                rows.append(RowSpec(state.row_params, req.prompt_token_ids,
                                    req.output_token_ids, seed, s.sampling_counter))
                row_states.append(state)
        _, num_rows = self.runner.step_shape(out)
        sampling, failed = self._sampling_metadata(rows, row_states, num_rows)
        targets = self._prompt_targets(out)
        result = self.runner.execute(out, sampling, prompt_targets=targets)
        if targets is not None:
            self._record_prompt_logprobs(out, result.prompt_logprobs)
        self.counters["num_steps"] += 1
        touched: dict[str, RequestState] = {}
        for state, error in failed.items():
            self._fail_request(state, error)
            touched[state.request_id] = state

        sampled: dict[str, list[int]] = {}
        row_of: dict[str, list[int]] = {}
        for row, req_id in enumerate(result.row_request_ids):
            sampled.setdefault(req_id, []).append(int(result.token_ids[row]))
            row_of.setdefault(req_id, []).append(row)
        now = time.time()
        for req, tokens in self.scheduler.update_from_output(out, sampled):
            state = self.states[req.user_request_id]
            if state.error is not None:  # failed earlier in this step
                if not req.is_finished():  # a sibling forked after the failure
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
                continue
            own_rows = row_of.get(req.request_id)
            # A child forked this step sampled from its parent's i-th fan-out row.
            row = own_rows[0] if own_rows else row_of[req.forked_from][req.sample_index]
            self.counters["generation_tokens"] += len(tokens)
            try:
                stop_str = state.on_tokens(req, tokens, result, row, now)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the step's
                self._fail_request(state, e)
                stop_str = None
            if stop_str is not None and not req.is_finished():
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            outputs.append(state.make_output())
            if state.finished:
                del self.states[state.request_id]
                for reason in state.finish_reasons():
                    self.finished_reasons[reason] = self.finished_reasons.get(reason, 0) + 1
        return outputs

    def _sampling_metadata(self, rows: list[RowSpec], row_states: list[RequestState],
                           num_rows: int):
        """The step's sampling arrays, and `{state: error}` of requests whose rows could
        not be built (their rows are replaced by inert greedy ones; they fail after the
        step, which computes the others' tokens exactly as it would without them)."""
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        vocab = self.model.cfg.vocab_size
        try:
            return build_sampling_metadata(rows, num_rows, vocab, eos_token_id=eos), {}
        except Exception:  # noqa: BLE001 - find the rows at fault, below
            pass
        failed: dict[RequestState, BaseException] = {}
        inert = RowSpec(SamplingParams(temperature=0.0), (), (), 0, 0)
        for i, row in enumerate(rows):
            try:
                build_sampling_metadata([row], 1, vocab, eos_token_id=eos)
            except Exception as e:  # noqa: BLE001
                failed.setdefault(row_states[i], e)
                rows[i] = inert
        for i, state in enumerate(row_states):
            if state in failed:
                rows[i] = inert  # every row of a failed request (n > 1 fan-out)
        return build_sampling_metadata(rows, num_rows, vocab, eos_token_id=eos), failed

    # ----------------------------------------------------- prompt logprobs
    def _prompt_targets(self, out) -> np.ndarray | None:
        """i32[step tokens]: the next prompt token at each position of requests that asked
        for prompt logprobs (-1 elsewhere), or None when no request did."""
        targets, wanted = [], False
        for s in out.scheduled:
            req = self.scheduler.requests[s.request_id]
            row = np.full(s.num_new_tokens, -1, np.int32)
            if req.sampling_params.prompt_logprobs is not None and req.sample_index == 0:
                pos = np.arange(s.start_pos, s.start_pos + s.num_new_tokens)
                keep = pos + 1 < req.num_prompt_tokens
                row[keep] = np.asarray(req.prompt_token_ids)[pos[keep] + 1]
                wanted |= bool(keep.any())
            targets.append(row)
        return np.concatenate(targets) if wanted else None

    def _record_prompt_logprobs(self, out, lp) -> None:
        t = 0
        for s in out.scheduled:
            req = self.scheduler.requests.get(s.request_id)
            state = self.states.get(req.user_request_id) if req is not None else None
            k = req.sampling_params.prompt_logprobs if req is not None else None
            if state is not None and k is not None and req.sample_index == 0:
                for i in range(s.num_new_tokens):
                    pos = s.start_pos + i
                    if pos + 1 < req.num_prompt_tokens:
                        state.set_prompt_logprob(pos + 1, req.prompt_token_ids[pos + 1],
                                                 lp, t + i, k)
            t += s.num_new_tokens

    # -------------------------------------------------------------- warmup
    def warmup(self) -> float:
        """Compiles every bucket now, so serving never compiles; returns seconds."""
        params = SamplingParams(temperature=0.0)

        def dummy(num_rows):
            return build_sampling_metadata([RowSpec(params, (), (), 0, 0)], num_rows,
                                           self.model.cfg.vocab_size)

        seconds = self.runner.warmup(dummy)
        logger.info("jaxserve: warm-up compiled %d buckets in %.1fs", len(self.runner.buckets),
                    seconds)
        return seconds

    # ------------------------------------------------------------- metrics
    def get_metrics(self) -> dict[str, float]:
        """Counters and gauges, named like vLLM's with a `jaxserve:` prefix."""
        stats = self.kv.stats()
        sched = self.scheduler
        padded = self.runner.num_padded_tokens
        total = padded + self.runner.num_scheduled_tokens
        metrics = {
            "jaxserve:num_requests_running": len(sched.running),
            "jaxserve:num_requests_waiting": len(sched.waiting),
            "jaxserve:num_requests_swapped": len(sched.swapped),
            "jaxserve:kv_cache_usage_perc": stats.usage,
            "jaxserve:prefix_cache_queries": stats.prefix_queries,
            "jaxserve:prefix_cache_hits": stats.prefix_hits,
            "jaxserve:num_preemptions": sched.num_preemptions,
            "jaxserve:prompt_tokens": self.counters["prompt_tokens"],
            "jaxserve:generation_tokens": self.counters["generation_tokens"],
            "jaxserve:num_compilations": self.runner.num_compilations,
            "jaxserve:padding_waste_ratio": padded / total if total else 0.0,
            "jaxserve:warmup_seconds": self.runner.warmup_seconds,
            "jaxserve:num_cow_copies": stats.num_cow_copies,
            "jaxserve:num_swap_outs": stats.num_swap_outs,
            "jaxserve:num_swap_ins": stats.num_swap_ins,
        }
        for reason, count in self.finished_reasons.items():
            metrics[f"jaxserve:request_success{{finished_reason={reason}}}"] = count
        return metrics
