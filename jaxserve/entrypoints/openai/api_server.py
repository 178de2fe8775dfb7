"""The OpenAI-compatible HTTP server: FastAPI routes, error bodies, API key gate, graceful stop."""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import re
import signal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxserve
from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxserve.entrypoints.openai.serving_engine import OpenAIError, error_body
from jaxserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("jaxserve")
_QUANT_SUFFIX = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)


def default_model_name(source) -> str:
    """A served name from a model path: `.../SmolLM2-135M-Instruct.Q4_1.gguf` gives
    `SmolLM2-135M-Instruct`; a directory gives its own name."""
    name = os.path.basename(os.path.normpath(str(source)))
    if name.lower().endswith(".gguf"):
        name = _QUANT_SUFFIX.sub("", name[:-5])
    return name or "jaxserve-model"


class GateMiddleware:
    """ASGI middleware: Bearer API key on `/v1/*` (like vLLM), and 503 while draining."""

    def __init__(self, app, api_key: str | None, state):
        self.app, self.api_key, self.state = app, api_key, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        if getattr(self.state, "draining", False) and scope["path"] != "/health":
            response = JSONResponse(error_body(503, "the server is shutting down"), 503)
            return await response(scope, receive, send)
        if self.api_key and scope["path"].startswith("/v1"):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                body = error_body(401, "Invalid or missing API key (expected "
                                       "'Authorization: Bearer <key>').")
                response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(llm: AsyncLLM, served_model_names: list[str], api_key: str | None = None,
              shutdown_engine: bool = True) -> FastAPI:
    """The FastAPI app over an engine.

    Args:
        llm: The async engine (its `metrics` registry backs `/metrics`).
        served_model_names: Names clients may use; the first is reported.
        api_key: Require `Authorization: Bearer <api_key>` on `/v1/*` when set.
        shutdown_engine: Shut the engine down when the app's lifespan ends.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if shutdown_engine:
            llm.shutdown()

    app = FastAPI(title="jaxserve", version=jaxserve.__version__, lifespan=lifespan)
    app.state.draining = False
    app.add_middleware(GateMiddleware, api_key=api_key, state=app.state)
    completion = OpenAIServingCompletion(llm, served_model_names)
    chat = OpenAIServingChat(llm, served_model_names)
    tokenization = OpenAIServingTokenization(llm, served_model_names)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_, e: OpenAIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, e: EngineDeadError):
        return JSONResponse(error_body(503, str(e)), status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

    def respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return respond(await completion.create(await request.body(), request.is_disconnected))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return respond(await chat.create(await request.body(), request.is_disconnected))

    @app.get("/v1/models")
    async def models():
        return JSONResponse(tokenization.models())

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return JSONResponse(tokenization.tokenize(await request.body()))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return JSONResponse(tokenization.detokenize(await request.body()))

    @app.get("/health")
    async def health():
        if not llm.is_running:
            return JSONResponse(error_body(503, "the engine is not running"), 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(llm.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": jaxserve.__version__})

    return app


class GracefulServer(uvicorn.Server):
    """uvicorn server whose SIGTERM/SIGINT first stops admission, then lets in-flight
    requests finish (up to `timeout_graceful_shutdown`, then they are aborted)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI):
        super().__init__(config)
        self.app = app

    def handle_exit(self, sig, frame) -> None:
        if not self.app.state.draining:
            logger.info("jaxserve: got %s; no new requests, finishing in-flight ones",
                        signal.Signals(sig).name if sig else "stop")
        self.app.state.draining = True
        super().handle_exit(sig, frame)


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000,
                shutdown_timeout: float | None = 30.0, log_level: str = "info") -> GracefulServer:
    """A uvicorn server for `app` (run it with `.run()`; `handle_exit` stops it)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout, access_log=False)
    return GracefulServer(config, app)
