"""The pooling runner's host side: requests' pooled vectors, added up chunk by chunk from
what each step computed on the device, and their `EmbeddingRequestOutput`s.

A pooling request is an ordinary scheduler request whose only sample (`max_tokens=1`,
greedy, dropped) ends it as soon as its prompt is computed, so it is prefill only and
shares steps with other pooling requests through the same scheduler: chunked prefill,
preemption and (for LAST pooling) prefix hits work unchanged. Each step, the runner's
pooling program (`StepPrograms.pool`) returns every scheduled row's share
(`StepResult.pooled`); `Pooler.accumulate` keeps a vector per request (reset whenever a
chunk starts at position 0, as after a recompute preemption), and `Pooler.outputs` turns
the finished requests' `RequestOutput`s into embeddings. `LLMEngine.add_request` adds them (with
`POOLING_SAMPLING` for the scheduler) and hands their `PoolingParams` to `Pooler.add`.
"""

from __future__ import annotations

import numpy as np

from jaxserve.core.scheduler_output import SchedulerOutput
from jaxserve.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolerConfig, PoolingParams
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

# What the scheduler runs for a pooling request: one greedy sample, never shown, ends it.
POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                                  output_kind=RequestOutputKind.FINAL_ONLY)


class Pooler:
    """Pooled vectors of the live pooling requests.

    Args:
        config: The engine's pooler.
        hidden_size: The model's width (the largest `dimensions`).
    """

    def __init__(self, config: PoolerConfig, hidden_size: int):
        config_params = PoolingParams(dimensions=config.dimensions)
        config_params.verify(hidden_size)
        self.config = config
        self.hidden_size = hidden_size
        self.params: dict[str, PoolingParams] = {}  # by request id
        self._vectors: dict[str, np.ndarray] = {}  # f32[hidden] so far, by request id
        self._prompt_lens: dict[str, int] = {}
        # Prompt tokens of the pooling requests added (vLLM counts them when added: a
        # pooling request ends in its prefill step).
        self.num_prompt_tokens = 0

    @property
    def prefix_caching_allowed(self) -> bool:
        """Whether prefix hits may skip prompt tokens: only LAST pooling reads none of
        them (MEAN and CLS need every chunk from position 0; vLLM turns caching off)."""
        return self.config.pooling_type == "LAST"

    def check(self, params, lora_request=None) -> PoolingParams:
        """The request's `PoolingParams` (default ones for None).

        Raises:
            ValueError: Not `PoolingParams`, `dimensions` past the hidden size, or a LoRA
                adapter (the pooling runner serves none).
        """
        params = PoolingParams() if params is None else params
        if not isinstance(params, PoolingParams):
            raise ValueError(f"this engine runs the pooling runner (embeddings): a request "
                             f"takes PoolingParams, not {type(params).__name__}; generation "
                             "needs an engine with runner='generate'")
        params.verify(self.hidden_size)
        if lora_request is not None:
            raise ValueError("lora_request: the pooling runner serves no LoRA adapters")
        return params

    def add(self, request_id: str, params: PoolingParams, prompt_len: int) -> None:
        """Starts a request's vector."""
        self.params[request_id] = params
        self._prompt_lens[request_id] = prompt_len
        self.num_prompt_tokens += prompt_len

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.params.pop(request_id, None)
            self._vectors.pop(request_id, None)
            self._prompt_lens.pop(request_id, None)

    def accumulate(self, out: SchedulerOutput, pooled: np.ndarray, skip=()) -> None:
        """Adds a step's shares (`pooled`: f32[len(out.scheduled), hidden], in its row
        order) to its requests' vectors; `skip` holds requests whose step failed."""
        kind = self.config.pooling_type
        for row, s in enumerate(out.scheduled):
            rid = s.request_id
            if rid not in self.params or rid in skip:
                continue
            share = pooled[row]
            end = s.start_pos + s.num_new_tokens
            if kind == "MEAN":
                self._vectors[rid] = share.copy() if s.start_pos == 0 \
                    else self._vectors[rid] + share
            elif kind == "CLS" and s.start_pos == 0:
                self._vectors[rid] = share.copy()
            elif kind == "LAST" and end == self._prompt_lens[rid]:
                self._vectors[rid] = share.copy()

    def outputs(self, outputs: list[RequestOutput]) -> list:
        """`outputs` with each finished pooling request's as an `EmbeddingRequestOutput`
        (others, such as unfinished ones, are left out: a pooling request answers once)."""
        result = []
        for out in outputs:
            params = self.params.get(out.request_id)
            if params is None:
                result.append(out)
                continue
            if not out.finished:
                continue
            vector = self._vectors.get(out.request_id)
            error = out.error
            if vector is None or error is not None:
                embedding = []
                error = error or f"request {out.request_id} ended before its prompt was " \
                                 f"computed ({out.outputs[0].finish_reason})"
            else:
                if self.config.pooling_type == "MEAN":
                    vector = vector / len(out.prompt_token_ids)
                embedding = params.finish(vector, self.config)
            result.append(EmbeddingRequestOutput(out.request_id, EmbeddingOutput(embedding),
                                                 out.prompt_token_ids, True, out.metrics,
                                                 error))
            self.forget([out.request_id])
        return result
