"""Data parallelism: independent engine replicas on disjoint devices behind one front end.

Each replica is a full `LLMEngine` (its own scheduler, page pool and compiled steps) on
its own `tensor_parallel_size` devices. The front end sends each new request to the
replica with the fewest queued tokens (prompt tokens not yet computed plus tokens still to
generate), breaking ties by KV usage, and steps every replica in turn.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxserve.config import EngineConfig
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.engine.weight_control import WeightControl
from jaxserve.outputs import RequestOutput
from jaxserve.runner.serving import (
    load_weights,
    local_model_config,
    release_loader_memory,
    tokenizer_path,
)


class DataParallelEngine:
    """The `LLMEngine` interface over `data_parallel_size` replicas.

    Args:
        config: Engine configuration (its parallel settings say how many replicas).
        model: An already loaded model (weights shared by every replica's placement).
        tokenizer: Its tokenizer.

    Raises:
        ValueError: Not enough devices for dp x tp.
    """

    def __init__(self, config: EngineConfig, model=None, tokenizer=None):
        from models.loaders import load_tokenizer

        par = config.parallel
        devices = jax.devices()
        per = par.devices_per_replica  # expert_parallel_size x tensor_parallel_size
        need = par.data_parallel_size * per
        if len(devices) < need:
            raise ValueError(f"data_parallel_size={par.data_parallel_size} x "
                             f"{per} devices per replica (tensor_parallel_size="
                             f"{par.tensor_parallel_size}, expert_parallel_size="
                             f"{par.expert_parallel_size or 1}) needs {need} devices; "
                             f"{len(devices)} available")
        # NOTE: a hub id or URL is fetched once, here (the replicas get the local path).
        source = config
        config = local_model_config(config)
        if tokenizer is None:
            tokenizer = load_tokenizer(tokenizer_path(source) or config.model.model)
        if model is None:
            model = load_weights(config)
            release_loader_memory(model.source)
        self.replicas = []
        for i in range(par.data_parallel_size):
            group = devices[i * per:(i + 1) * per]
            replica_cfg = dataclasses.replace(config, parallel=dataclasses.replace(
                par, data_parallel_size=1, device_ids=tuple(d.id for d in group)))
            self.replicas.append(LLMEngine(replica_cfg, model=model, tokenizer=tokenizer))
        self.config = config
        self.tokenizer = tokenizer
        self.model = self.replicas[0].model
        self.limits = self.replicas[0].limits
        self._owner: dict[str, int] = {}

    # The LLMEngine interface ---------------------------------------------------------
    def add_request(self, request_id: str, prompt, params=None, **kwargs) -> None:
        """Queues a request on the least loaded replica (see the module docstring)."""
        if request_id in self._owner:
            raise ValueError(f"request id {request_id!r} is already in use")
        index = min(range(len(self.replicas)), key=self._load)
        self.replicas[index].add_request(request_id, prompt, params, **kwargs)
        self._owner[request_id] = index

    def add_lora(self, lora_request) -> bool:
        """Loads an adapter on every replica (`LLMEngine.add_lora`)."""
        return all(replica.add_lora(lora_request) for replica in self.replicas)

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter on every replica; whether any had it loaded."""
        return any([replica.remove_lora(lora_id) for replica in self.replicas])

    def update_weights(self, weights, abort_running: bool = False) -> list[RequestOutput]:
        """New weights on every replica (`WeightControl.update_weights`)."""
        return [out for r in self.replicas for out in r.update_weights(weights, abort_running)]

    def get_weights(self) -> dict:
        return self.replicas[0].get_weights()

    def reset_prefix_cache(self) -> bool:
        return all([r.reset_prefix_cache() for r in self.replicas])

    def sleep(self, level: int = 1) -> int:
        return sum(r.sleep(level) for r in self.replicas)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wakes `tags` (None: all) on every replica; an unknown tag is refused before any
        replica wakes."""
        WeightControl.check_tags(tags)
        for r in self.replicas:
            r.wake_up(tags)

    def is_sleeping(self) -> bool:
        return any(r.is_sleeping() for r in self.replicas)

    def _load(self, index: int) -> tuple[int, float]:
        replica = self.replicas[index]
        queued = 0
        for req in replica.scheduler.requests.values():
            queued += req.num_tokens - req.num_computed_tokens
            sp = req.sampling_params
            if sp.max_tokens is not None:
                queued += max(0, sp.max_tokens - req.num_output_tokens)
        return queued, replica.kv.usage

    def abort_request(self, request_ids) -> list[RequestOutput]:
        """Ends requests on their replicas; returns their final outputs."""
        outputs = []
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            index = self._owner.pop(request_id, None)
            if index is not None:
                outputs.extend(self.replicas[index].abort_request(request_id))
        return outputs

    def step(self) -> list[RequestOutput]:
        """One step of every replica that has work; the outputs of all of them."""
        outputs = []
        for replica in self.replicas:
            if replica.has_unfinished_requests():
                outputs.extend(replica.step())
        for out in outputs:
            if out.finished:
                self._owner.pop(out.request_id, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def warmup(self) -> float:
        """Compiles every replica's buckets (for engines built with warmup=False)."""
        return sum(r.warmup() for r in self.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(r.get_num_unfinished_requests() for r in self.replicas)

    def replica_of(self, request_id: str) -> int | None:
        """Which replica serves a live request (None once finished)."""
        return self._owner.get(request_id)

    # The rest of `EngineClient`: the replicas serve one model, so the first one speaks
    # for all, except where each counts its own (tokens, warm-up).
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The replicas' EOS ids (the same model and tokenizer in each)."""
        return self.replicas[0].eos_token_ids

    @property
    def classifier_head(self):
        """Every replica's classifier head (`EngineClient.classifier_head`)."""
        return self.replicas[0].classifier_head

    @property
    def model_source(self) -> str:
        """Every replica's weights' source (`EngineClient.model_source`)."""
        return self.replicas[0].model_source

    @property
    def runner_type(self) -> str:
        """"generate" or "pooling" (every replica's)."""
        return self.replicas[0].runner_type

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def quantization(self) -> str:
        return self.replicas[0].quantization

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].vocab_size

    def check_constraint(self, structured_outputs) -> None:
        """Compiles a constraint in every replica's cache (each matches its own requests)."""
        for replica in self.replicas:
            replica.check_constraint(structured_outputs)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.replicas)

    @property
    def num_iteration_tokens(self) -> int:
        return sum(r.num_iteration_tokens for r in self.replicas)

    @property
    def warmup_progress(self) -> tuple[int, int]:
        """Buckets compiled and in all, over every replica."""
        done, total = zip(*(r.warmup_progress for r in self.replicas), strict=True)
        return sum(done), sum(total)

    def cache_config_info(self) -> dict[str, object]:
        """One replica's KV cache settings (`num_gpu_blocks` per replica, as vLLM's)."""
        return self.replicas[0].cache_config_info()

    def get_metrics(self) -> dict[str, float]:
        """Counters summed over replicas; usage and ratios averaged."""
        per = [r.get_metrics() for r in self.replicas]
        merged: dict[str, float] = {}
        for name in {k for m in per for k in m}:
            values = [m.get(name, 0) for m in per]
            average = name.split("{", 1)[0].endswith(("_perc", "_ratio", "warmup_seconds",
                                                      "sleep_state"))
            merged[name] = sum(values) / len(values) if average else sum(values)
        return merged
