"""`POST /v1/embeddings`: OpenAI's embeddings body (text or token ids, one or a batch) to
pooled vectors, as floats or base64 float32, from an engine with `runner="pooling"`."""

from __future__ import annotations

import base64
import time
from typing import Literal

import numpy as np

from jaxserve.entrypoints.openai.errors import OpenAIError, parse_body
from jaxserve.entrypoints.openai.protocol import OpenAIBaseModel
from jaxserve.entrypoints.openai.serving_base import Prepared
from jaxserve.entrypoints.openai.serving_engine import OpenAIServing
from jaxserve.outputs import EmbeddingRequestOutput
from jaxserve.pooling_params import PoolingParams


class EmbeddingRequest(OpenAIBaseModel):
    """Body of `POST /v1/embeddings` (OpenAI's fields, and vLLM's `normalize`)."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool | None = None


def encode_embedding(embedding: list[float], encoding_format: str) -> list[float] | str:
    """The vector as OpenAI sends it: floats, or base64 of little-endian float32 bytes
    (what the official client decodes with `np.frombuffer(..., dtype="float32")`)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(embedding, "<f4").tobytes()).decode("ascii")
    return embedding


class OpenAIServingEmbedding(OpenAIServing):
    """Handles embedding requests (an engine whose runner is "pooling")."""

    request_model = EmbeddingRequest
    id_prefix = "embd"

    def _parse(self, body):
        req = parse_body(body, EmbeddingRequest)
        self.check_model(req.model)
        return req

    def prepare(self, req: EmbeddingRequest) -> Prepared:
        """Pooling parameters and tokenized inputs (each below max_model_len)."""
        try:
            params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        except ValueError as e:
            raise OpenAIError(400, str(e), "dimensions") from None
        items = self.prompt_list(req.input, "input")
        vocab = self.vocab_size or 2**31
        prompts = []
        for item in items:
            if isinstance(item, str):
                ids = self.encode(item, "input")
            else:
                bad = [t for t in item if not 0 <= t < vocab]
                if bad:
                    raise OpenAIError(400, f"input holds token ids outside [0, {vocab}): "
                                           f"{bad[:5]}", "input")
                ids = list(item)
            if not ids:
                raise OpenAIError(400, "input must not be empty", "input")
            if len(ids) >= self.max_model_len:
                raise OpenAIError(400, f"This model's maximum context length is "
                                       f"{self.max_model_len} tokens. However, your input "
                                       f"has {len(ids)} tokens (at most "
                                       f"{self.max_model_len - 1} are embedded).", "input")
            prompts.append({"prompt_token_ids": ids})
        return Prepared(params, prompts)

    async def start(self, base_id, prompts, params, priority=0, cache_salt=None,
                    lora_request=None):
        if lora_request is not None:
            raise OpenAIError(400, "model: LoRA adapters do not serve embeddings", "model")
        try:
            return await super().start(base_id, prompts, params, priority, cache_salt)
        except OpenAIError as e:
            if e.status == 400 and e.message.startswith("dimensions"):
                e.param = "dimensions"
            raise

    def full_response(self, req: EmbeddingRequest, prep: Prepared, request_id: str,
                      finals: list[EmbeddingRequestOutput]) -> dict:
        num_tokens = sum(len(p["prompt_token_ids"]) for p in prep.prompts)
        data = [{"object": "embedding", "index": i,
                 "embedding": encode_embedding(out.outputs.embedding, req.encoding_format)}
                for i, out in enumerate(finals)]
        return {"id": request_id, "object": "list", "created": int(time.time()),
                "model": req.model or self.model_name, "data": data,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

    def stream_events(self, req, prep, request_id, streams):
        raise OpenAIError(400, "embeddings are not streamed", "stream")
