"""vLLM's scoring endpoints on a pooling server: `/score` and `/v1/score` (pairs' scores),
`/rerank`, `/v1/rerank` and `/v2/rerank` (documents ranked against a query, Jina/Cohere
shapes) and `/classify` (class probabilities), with vLLM's request and response bodies
(docs/openai_api.md)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from jaxserve.engine.scoring import check_truncation, score_pairs, score_prompt, truncated
from jaxserve.entrypoints.openai.errors import OpenAIError, parse_body
from jaxserve.entrypoints.openai.protocol import OpenAIBaseModel
from jaxserve.entrypoints.openai.serving_base import Prepared
from jaxserve.entrypoints.openai.serving_engine import OpenAIServing
from jaxserve.entrypoints.openai.serving_pooling import OpenAIServingPooling
from jaxserve.pooling_params import PoolingParams

Texts = str | list[str]
# vLLM's spellings of a score request's two sides, in the order they are looked for.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
               ("text_1", "text_2"))


class ScoreRequest(OpenAIBaseModel):
    """Body of `POST /score` (vLLM's `ScoreRequest`: one pair of sides, any spelling)."""

    model: str | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    text_1: Texts | None = None
    text_2: Texts | None = None
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    priority: int = 0
    user: str | None = None


class RerankRequest(OpenAIBaseModel):
    """Body of `POST /rerank` (vLLM's `RerankRequest`, Cohere's `return_documents`)."""

    model: str | None = None
    query: str
    documents: Texts
    top_n: int = 0
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    priority: int = 0
    user: str | None = None


class ClassificationRequest(OpenAIBaseModel):
    """Body of `POST /classify` (vLLM's `ClassificationRequest`)."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None
    priority: int = 0
    user: str | None = None


class _PoolingServing(OpenAIServing):
    """What the scoring handlers share: the engine's pooler, truncation and length checks."""

    @property
    def head(self):
        """The served classifier's head (`ClassifierHead`), or None for an embedding model."""
        return self.llm.engine.classifier_head

    def keep(self, req) -> int | None:
        try:
            return check_truncation(req.truncate_prompt_tokens, self.max_model_len)
        except ValueError as e:
            raise OpenAIError(400, str(e), "truncate_prompt_tokens") from None

    def fits(self, prompt: dict, param: str) -> dict:
        """`prompt` if shorter than max_model_len, else a 400 naming `param`."""
        n = len(prompt["prompt_token_ids"])
        if n >= self.max_model_len:
            raise OpenAIError(400, f"This model's maximum context length is "
                                   f"{self.max_model_len} tokens. However, your {param} has "
                                   f"{n} tokens (at most {self.max_model_len - 1}; "
                                   "truncate_prompt_tokens cuts it).", param)
        return prompt

    def text_prompt(self, text, param: str, keep: int | None) -> dict:
        if not isinstance(text, str) or not text:
            raise OpenAIError(400, f"{param} must hold non-empty texts", param)
        prompt = truncated(self.tokenizer, text, keep)
        if isinstance(prompt, str):
            prompt = {"prompt_token_ids": self.encode(text, param), "prompt": text}
        return self.fits(prompt, param)

    def pairs_prepared(self, req, pairs: list[tuple], sides: tuple[str, str]) -> Prepared:
        """Requests for `pairs`: a cross-encoder's packed pairs (task "score"), or an
        embedding model's texts, embedded once each (`extra["pairs"]`: indices of each
        pair's two vectors)."""
        keep = self.keep(req)
        for side, texts in zip(sides, zip(*pairs, strict=True), strict=True):
            if any(not isinstance(t, str) or not t for t in texts):
                raise OpenAIError(400, f"{side} must hold non-empty texts", side)
        if self.head is not None:
            model = self.llm.engine.model
            try:
                prompts = [score_prompt(self.tokenizer, model, a, b, keep) for a, b in pairs]
            except ValueError as e:  # the first text holds the separator
                raise OpenAIError(400, str(e), sides[0]) from None
            params = PoolingParams(task="score", use_activation=req.use_activation)
            return Prepared(params, [self.fits(p, sides[1]) for p in prompts])
        if req.use_activation is not None:
            raise OpenAIError(400, "use_activation applies to a classifier's scores; this "
                                   "model's scores are cosines of embeddings", "use_activation")
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        where, firsts = {t: i for i, t in enumerate(texts)}, {a for a, _ in pairs}
        prompts = [self.text_prompt(t, sides[0] if t in firsts else sides[1], keep)
                   for t in texts]
        return Prepared(PoolingParams(), prompts,
                        {"pairs": [(where[a], where[b]) for a, b in pairs]})

    def scores(self, prep: Prepared, finals) -> list[float]:
        """Each pair's score from the finished requests (in `prep.prompts`' order)."""
        for out in finals:
            if out.error is not None:
                raise OpenAIError(500, out.error)
        if "pairs" not in prep.extra:
            return [float(out.outputs.score) for out in finals]
        vecs = [np.asarray(out.outputs.embedding, np.float64) for out in finals]
        return [float(vecs[i] @ vecs[j] / max(np.linalg.norm(vecs[i]) * np.linalg.norm(vecs[j]),
                                               1e-12)) for i, j in prep.extra["pairs"]]

    def stream_events(self, req, prep, request_id, streams):
        raise OpenAIError(400, "scores are not streamed", "stream")


def _usage(prep: Prepared) -> dict:
    n = sum(len(p["prompt_token_ids"]) for p in prep.prompts)
    return {"prompt_tokens": n, "total_tokens": n}


class OpenAIServingScore(_PoolingServing):
    """`POST /score`: one text against each of the other side's (1 to N) or pairwise."""

    request_model = ScoreRequest
    id_prefix = "score"

    def _parse(self, body):
        req = parse_body(body, ScoreRequest)
        self.check_model(req.model)
        return req

    def prepare(self, req: ScoreRequest) -> Prepared:
        sides = next((s for s in SCORE_SIDES if getattr(req, s[0]) is not None
                      and getattr(req, s[1]) is not None), None)
        if sides is None:
            raise OpenAIError(400, "a score request gives queries and documents (or items, "
                                   "data_1 and data_2, text_1 and text_2)", "queries")
        try:
            pairs = score_pairs(getattr(req, sides[0]), getattr(req, sides[1]))
        except ValueError as e:
            raise OpenAIError(400, str(e), sides[1]) from None
        return self.pairs_prepared(req, pairs, sides)

    def full_response(self, req, prep, request_id, finals) -> dict:
        data = [{"index": i, "object": "score", "score": s}
                for i, s in enumerate(self.scores(prep, finals))]
        return {"id": request_id, "object": "list", "created": int(time.time()),
                "model": req.model or self.model_name, "data": data, "usage": _usage(prep)}


class OpenAIServingRerank(_PoolingServing):
    """`POST /rerank`: the documents ranked by their score against the query (the best
    `top_n`; 0: all)."""

    request_model = RerankRequest
    id_prefix = "rerank"

    def _parse(self, body):
        req = parse_body(body, RerankRequest)
        self.check_model(req.model)
        return req

    def prepare(self, req: RerankRequest) -> Prepared:
        docs = [req.documents] if isinstance(req.documents, str) else req.documents
        if not docs:
            raise OpenAIError(400, "documents must not be empty", "documents")
        if req.top_n < 0:
            raise OpenAIError(400, f"top_n must be 0 (all) or positive, got {req.top_n}",
                              "top_n")
        prep = self.pairs_prepared(req, [(req.query, d) for d in docs], ("query", "documents"))
        prep.extra["documents"] = docs
        return prep

    def full_response(self, req, prep, request_id, finals) -> dict:
        scores = self.scores(prep, finals)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        docs = prep.extra["documents"]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": docs[i]}} if req.return_documents else {})}
                   for i in order[:req.top_n or None]]
        return {"id": request_id, "model": req.model or self.model_name,
                "usage": _usage(prep), "results": results}


class OpenAIServingClassify(_PoolingServing):
    """`POST /classify`: each input's class probabilities and its likeliest label."""

    request_model = ClassificationRequest
    id_prefix = "classify"

    def __init__(self, *args, labels: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.labels = labels or {}

    def _parse(self, body):
        req = parse_body(body, ClassificationRequest)
        self.check_model(req.model)
        return req

    def prepare(self, req: ClassificationRequest) -> Prepared:
        if self.head is None:
            raise OpenAIError(400, "The model does not support the Classification API: it "
                                   "has no classification head (an embedding model)", "model")
        keep = self.keep(req)
        prompts = []
        for item in self.prompt_list(req.input, "input"):
            if isinstance(item, str):
                prompts.append(self.text_prompt(item, "input", keep))
            else:
                prompts.append(self.fits({"prompt_token_ids": truncated(
                    self.tokenizer, list(item), keep)}, "input"))
        return Prepared(PoolingParams(task="classify", use_activation=req.use_activation),
                        prompts)

    def full_response(self, req, prep, request_id, finals) -> dict:
        data = []
        for i, out in enumerate(finals):
            if out.error is not None:
                raise OpenAIError(500, out.error)
            probs = out.outputs.probs
            best = int(np.argmax(probs))
            data.append({"index": i, "label": self.labels.get(str(best), f"LABEL_{best}"),
                         "probs": probs, "num_classes": len(probs)})
        return {"id": request_id, "object": "list", "created": int(time.time()),
                "model": req.model or self.model_name, "data": data, "usage": _usage(prep)}


def attach_scoring(state, engine, *args) -> None:
    """Puts the scoring handlers on the server's `state` (`args`: the other handlers'
    served names, limits, lanes and models); `/classify` labels classes by the model's
    `id2label`."""
    labels = {}
    source = engine.engine.model_source
    if source and os.path.isfile(os.path.join(source, "config.json")):
        with open(os.path.join(source, "config.json")) as f:
            labels = {str(k): v for k, v in (json.load(f).get("id2label") or {}).items()}
    state.score = OpenAIServingScore(engine, *args)
    state.rerank = OpenAIServingRerank(engine, *args)
    state.classify = OpenAIServingClassify(engine, *args, labels=labels)
    state.pooling = OpenAIServingPooling(engine, *args)


def add_scoring_routes(app: FastAPI, state, guard, respond, serves) -> None:
    """Adds `/score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank`, `/classify` and
    `/pooling` (each a 400 on a generate server: `serves`), answered by the handlers `attach`
    puts on `state` (`score`, `rerank`, `classify`, `pooling`)."""

    async def score(request: Request):
        serves("pooling", "Score")
        return respond(await state.score.create(await request.body(), request.is_disconnected))

    async def rerank(request: Request):
        serves("pooling", "Rerank")
        return respond(await state.rerank.create(await request.body(),
                                                 request.is_disconnected))

    async def classify(request: Request):
        serves("pooling", "Classification")
        return JSONResponse(await state.classify.create(await request.body(),
                                                        request.is_disconnected))

    async def pooling(request: Request):
        serves("pooling", "Pooling")
        return respond(await state.pooling.create(await request.body(),
                                                  request.is_disconnected))

    app.post("/pooling")(guard(pooling))
    for path in ("/score", "/v1/score"):
        app.post(path)(guard(score))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.post(path)(guard(rerank))
    app.post("/classify")(guard(classify))
