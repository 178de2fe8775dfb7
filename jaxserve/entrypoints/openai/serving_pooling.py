"""`POST /pooling` (vLLM's): each input's pooled values, an embedding model's vectors or a
classifier's class values, as floats or base64 float32, in vLLM's `PoolingResponse` shape."""

from __future__ import annotations

import time

from jaxserve.engine.llm_pooling import ENCODE_TASKS
from jaxserve.entrypoints.openai.errors import OpenAIError, parse_body
from jaxserve.entrypoints.openai.serving_base import Prepared
from jaxserve.entrypoints.openai.serving_embedding import (
    EmbeddingRequest,
    OpenAIServingEmbedding,
    encode_embedding,
)
from jaxserve.pooling_params import PoolingParams


class PoolingRequest(EmbeddingRequest):
    """Body of `POST /pooling` (vLLM's `PoolingRequest`, its completion form): the embeddings
    body, and `task` ("embed" or "classify"; None: what the model serves) and
    `use_activation` (a classifier's)."""

    task: str | None = None
    use_activation: bool | None = None


class OpenAIServingPooling(OpenAIServingEmbedding):
    """Handles `/pooling` on a pooling server: inputs as `/v1/embeddings` reads them, pooled
    by the served model's task."""

    request_model = PoolingRequest
    id_prefix = "pool"

    def _parse(self, body):
        req = parse_body(body, PoolingRequest)
        self.check_model(req.model)
        return req

    @property
    def classifier(self) -> bool:
        return self.llm.engine.classifier_head is not None

    def prepare(self, req: PoolingRequest) -> Prepared:
        """The inputs' prompts (as `/v1/embeddings`'), with the task's `PoolingParams`.

        Raises:
            OpenAIError: 400 naming `task` (unknown, per-token, or not the model's),
                `use_activation` for an embedding, `dimensions` / `normalize` for classes.
        """
        served = "classify" if self.classifier else "embed"
        task = req.task or served
        if task not in ENCODE_TASKS:
            raise OpenAIError(400, f"task must be one of {ENCODE_TASKS}, got {task!r} "
                                   "(per-token pooling is not built)", "task")
        if task != served:
            raise OpenAIError(400, f"task={task!r}: this model serves {served!r}", "task")
        prep = super().prepare(req)
        if task == "embed":
            if req.use_activation is not None:
                raise OpenAIError(400, "use_activation applies to a classifier's classes",
                                  "use_activation")
            return prep
        if req.dimensions is not None or req.normalize is not None:
            raise OpenAIError(400, "dimensions and normalize apply to embeddings, not a "
                                   "classifier's classes", "dimensions")
        prep.params = PoolingParams(task="classify", use_activation=req.use_activation)
        return prep

    def full_response(self, req: PoolingRequest, prep: Prepared, request_id: str,
                      finals) -> dict:
        num_tokens = sum(len(p["prompt_token_ids"]) for p in prep.prompts)
        data = []
        for i, out in enumerate(finals):
            if out.error is not None:
                raise OpenAIError(500, out.error)
            values = getattr(out.outputs, "embedding", None)
            values = out.outputs.probs if values is None else values
            data.append({"index": i, "object": "pooling",
                         "data": encode_embedding(values, req.encoding_format)})
        return {"id": request_id, "object": "list", "created": int(time.time()),
                "model": req.model or self.model_name, "data": data,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}
