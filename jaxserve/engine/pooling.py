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
from jaxserve.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from jaxserve.pooling_params import (
    ClassifierHead,
    PoolerConfig,
    PoolingParams,
    sentence_transformers_pooler,
)
from jaxserve.sampling_params import RequestOutputKind, SamplingParams

# What the scheduler runs for a pooling request: one greedy sample, never shown, ends it.
POOLING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                                  output_kind=RequestOutputKind.FINAL_ONLY)


class Pooler:
    """Pooled vectors of the live pooling requests.

    Args:
        config: The engine's pooler.
        hidden_size: The model's width (the largest `dimensions`); a classifier's class count.
        head: A sequence classifier's head (its pooled vectors are class logits, answered
            to "classify" and "score" requests), or None (an embedding model's vectors).
    """

    def __init__(self, config: PoolerConfig, hidden_size: int,
                 head: ClassifierHead | None = None):
        config_params = PoolingParams(dimensions=config.dimensions)
        config_params.verify(hidden_size)
        self.config = config
        self.hidden_size = hidden_size
        self.head = head
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
            ValueError: Not `PoolingParams`, `dimensions` past the hidden size, a LoRA
                adapter (the pooling runner serves none), or a `task` the model does not
                serve (embeddings of a classifier; classes or scores of an embedding model;
                a score of a classifier of several classes).
        """
        params = PoolingParams(task="embed" if self.head is None else "classify") \
            if params is None else params
        if not isinstance(params, PoolingParams):
            raise ValueError(f"this engine runs the pooling runner (embeddings): a request "
                             f"takes PoolingParams, not {type(params).__name__}; generation "
                             "needs an engine with runner='generate'")
        if self.head is None and params.task != "embed":
            raise ValueError(f"task={params.task!r}: this model is an embedding model (no "
                             "classification head); it serves 'embed' (a pair's score is the "
                             "cosine of its embeddings: LLM.score)")
        if self.head is not None and params.task == "embed":
            raise ValueError("task='embed': this model is a sequence classifier; it serves "
                             "'classify' and 'score'")
        if params.task == "score" and self.head.num_labels != 1:
            raise ValueError(f"task='score': a cross-encoder scores with one class; this "
                             f"classifier has {self.head.num_labels} (use 'classify')")
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
                values = []
                error = error or f"request {out.request_id} ended before its prompt was " \
                                 f"computed ({out.outputs[0].finish_reason})"
            elif params.task == "embed":
                if self.config.pooling_type == "MEAN":
                    vector = vector / len(out.prompt_token_ids)
                values = params.finish(vector, self.config)
            else:  # a classifier's class logits, activated unless asked not to
                values = vector if params.use_activation is False \
                    else self.head.activate(vector, params.task)
                values = np.asarray(values, np.float32).tolist()
            result.append(_request_output(params.task, values, out, error))
            self.forget([out.request_id])
        return result


def _request_output(task: str, values: list[float], out: RequestOutput, error):
    """The finished request's output of its task's kind (a failed score: NaN)."""
    if task == "embed":
        cls, inner = EmbeddingRequestOutput, EmbeddingOutput(values)
    elif task == "classify":
        cls, inner = ClassificationRequestOutput, ClassificationOutput(values)
    else:
        cls, inner = ScoringRequestOutput, ScoringOutput(values[0] if values else float("nan"))
    return cls(out.request_id, inner, out.prompt_token_ids, True, out.metrics, error)


def make_pooler(model_config, model) -> Pooler:
    """The pooler of a pooling engine serving `model` under `model_config` (a
    `jaxserve.config.ModelConfig`): `pooler_config` if given, else a sentence-transformers
    directory's, else the model's default (vLLM's: CLS and normalized for an encoder, LAST
    and normalized for a decoder). A classifier (`models.encoder.EncoderModel` with a head,
    `models.score_head.ScoreHeadModel`) pools the token its head reads (an encoder's first,
    a decoder's last) into class logits.

    Raises:
        ValueError: Another pooling type for a classifier, or the pooler's own errors.
    """
    encoder = getattr(model, "encoder", None)
    given = model_config.pooler_config or sentence_transformers_pooler(model.source)
    num_labels = getattr(model, "num_labels", 0)
    if not num_labels:
        config = given or PoolerConfig("CLS" if encoder is not None else "LAST")
        return Pooler(config, model.cfg.hidden_size)
    kind = "CLS" if encoder is not None else "LAST"
    if given is not None and given.pooling_type != kind:
        raise ValueError(f"pooler_config.pooling_type={given.pooling_type!r}: "
                         f"{model.cfg.architecture}'s classification head reads the "
                         f"{'first' if kind == 'CLS' else 'last'} token ({kind})")
    head = ClassifierHead(num_labels, model.problem_type, model.score_activation)
    return Pooler(given or PoolerConfig(kind, normalize=False), num_labels, head)
