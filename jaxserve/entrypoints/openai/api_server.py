"""The OpenAI-compatible HTTP server: FastAPI routes, JSON errors for everything, start-up in
the background (503 with progress until warm), and a graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxserve
from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError
from jaxserve.engine.protocol import EngineClient
from jaxserve.entrypoints.openai.admission import PrepareLanes, PrepareLimits
from jaxserve.entrypoints.openai.dev_routes import add_dev_routes
from jaxserve.entrypoints.openai.errors import OpenAIError, error_body, loads_body, parse_body
from jaxserve.entrypoints.openai.gate import DEFAULT_MAX_BODY_BYTES, ServerGate
from jaxserve.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from jaxserve.entrypoints.openai.serving_base import (  # noqa: F401 - re-exported
    ServingLimits,
    default_model_name,
)
from jaxserve.entrypoints.openai.serving_chat import OpenAIServingChat
from jaxserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from jaxserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from jaxserve.entrypoints.openai.serving_models import OpenAIServingModels
from jaxserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from jaxserve.entrypoints.openai.serving_score import add_scoring_routes, attach_scoring
from jaxserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("jaxserve")


class Startup:
    """What `/health` reports while the engine loads and warms up in the background."""

    def __init__(self):
        self.phase = "loading the model"
        # The engine, once built (warm-up progress is read from it).
        self.engine: EngineClient | None = None
        self.error: str | None = None

    def status(self) -> dict:
        """`{"status": "starting"|"failed", "detail", ["warmup": "3/6 buckets"]}`."""
        out = {"status": "failed" if self.error else "starting",
               "detail": self.error or self.phase}
        if self.engine is not None and self.phase.startswith("warm"):
            done, total = self.engine.warmup_progress
            out["warmup"] = f"{done}/{total} buckets"
            out["detail"] = f"warm-up {done}/{total} buckets"
        return out


def _guard(handler):
    """Every failure of a route becomes an OpenAI-style JSON body (never a bare 500 that
    breaks the connection)."""

    @functools.wraps(handler)
    async def run(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except OpenAIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        except EngineDeadError as e:
            return JSONResponse(error_body(503, str(e)), status_code=503)
        except RecursionError:
            return JSONResponse(error_body(400, "request is nested too deeply"), 400)
        except Exception as e:  # noqa: BLE001 - the client gets JSON; the log gets the trace
            logger.exception("jaxserve: internal error")
            return JSONResponse(error_body(500, f"internal error: {type(e).__name__}: {e}"),
                                status_code=500)

    return run


def build_app(llm: AsyncLLM | None, served_model_names: list[str], api_key: str | None = None,
              shutdown_engine: bool = True, limits: ServingLimits | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              enable_server_load_tracking: bool = False,
              enable_tokenizer_info_endpoint: bool = False,
              prepare_limits: PrepareLimits | None = None,
              disable_docs: bool = False, models: OpenAIServingModels | None = None,
              allow_runtime_lora_updating: bool = False,
              server_dev_mode: bool = False) -> FastAPI:
    """The FastAPI app over an engine.

    Args:
        llm: The async engine, or None while it is still starting (call `app.state.attach`
            with it once built; until then `/health` and `/v1/*` answer 503).
        served_model_names: Names clients may use; the first is reported.
        api_key: Require `Authorization: Bearer <api_key>` on `/v1/*`, `/tokenize`,
            `/detokenize`, `/invocations` and `/tokenizer_info` when set.
        shutdown_engine: Shut the engine down when the app's lifespan ends.
        limits: Per-request limits (prompts per request, prompt length pre-check).
        enable_server_load_tracking: `GET /load` reports the requests being answered
            (otherwise 0), as vLLM's flag of the same name.
        enable_tokenizer_info_endpoint: Serve `GET /tokenizer_info` (the tokenizer's
            configuration, chat template included; off by default, as in vLLM).
        max_body_bytes: Largest request body (413 beyond).
        prepare_limits: The lanes requests are prepared in (`PrepareLimits()` when None).
        disable_docs: Serve no `/docs`, `/redoc` or `/openapi.json` (vLLM's
            `--disable-fastapi-docs`); they are open, without the key, otherwise.
        models: The base model's names and the LoRA adapters requests may name (None:
            `served_model_names`, no adapters); its names must match
            `served_model_names`.
        allow_runtime_lora_updating: Serve `POST /v1/load_lora_adapter` and
            `/v1/unload_lora_adapter` (vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`); without
            it they do not exist (404).
        server_dev_mode: Serve vLLM's development endpoints (`/sleep`, `/wake_up`,
            `/is_sleeping`, `/reset_prefix_cache`: `dev_routes.add_dev_routes`).
    """

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.loop = asyncio.get_running_loop()
        yield
        state.lanes.shutdown()
        if shutdown_engine and app.state.llm is not None:
            await asyncio.to_thread(app.state.llm.shutdown)

    docs = {} if not disable_docs else {"docs_url": None, "redoc_url": None,
                                          "openapi_url": None}
    app = FastAPI(title="jaxserve", version=jaxserve.__version__, lifespan=lifespan, **docs)
    state = app.state
    state.lanes = PrepareLanes(prepare_limits)
    state.llm, state.ready, state.draining = None, False, False
    state.load_tracking = enable_server_load_tracking
    state.tokenizer_info = enable_tokenizer_info_endpoint
    state.startup = Startup()
    state.startup_status = state.startup.status
    state.models = models or OpenAIServingModels(served_model_names)
    state.runtime_lora = allow_runtime_lora_updating
    state.dev_mode = server_dev_mode
    app.add_middleware(ServerGate, state=state, api_key=api_key, max_body_bytes=max_body_bytes)

    def attach(engine: AsyncLLM) -> None:
        lim = limits or ServingLimits()
        if lim.max_chars_per_token is None:
            vocab = getattr(engine.tokenizer, "get_vocab", dict)()
            per_token = max((len(t) for t in vocab), default=0)
            lim = dataclasses.replace(lim, max_chars_per_token=per_token)
        lanes, names, models = state.lanes, served_model_names, state.models
        state.completion = OpenAIServingCompletion(engine, names, lim, lanes, models)
        state.chat = OpenAIServingChat(engine, names, lim, lanes, models)
        state.responses = OpenAIServingResponses(engine, names, lim, lanes, models,
                                                 chat=state.chat)
        state.tokenization = OpenAIServingTokenization(engine, names, lim, lanes, models)
        state.embedding = OpenAIServingEmbedding(engine, names, lim, lanes, models)
        attach_scoring(state, engine, names, lim, lanes, models)  # /score, /rerank, /classify
        state.runner = engine.engine.runner_type  # "generate" or "pooling": one kind of endpoint
        state.llm, state.ready = engine, True

    state.attach = attach
    if llm is not None:
        attach(llm)

    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state) -> None:
    """The endpoints, each answering through the handlers `attach` put on `state`."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, e: StarletteHTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code)

    def respond(result):
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def serves(runner: str, api: str) -> None:
        """A 400 for an endpoint of the other runner (vLLM's runner separation)."""
        if state.runner != runner:
            raise OpenAIError(400, f"The model does not support the {api} API: this server "
                                   f"runs the {state.runner} runner (jaxserve serve "
                                   f"--runner {runner} serves it)")

    @app.post("/v1/completions")
    @_guard
    async def completions(request: Request):
        serves("generate", "Completions")
        return respond(await state.completion.create(await request.body(),
                                                     request.is_disconnected))

    @app.post("/v1/chat/completions")
    @_guard
    async def chat_completions(request: Request):
        serves("generate", "Chat Completions")
        return respond(await state.chat.create(await request.body(), request.is_disconnected))

    @app.post("/v1/responses")
    @_guard
    async def responses(request: Request):
        serves("generate", "Responses")
        return respond(await state.responses.create(await request.body(),
                                                    request.is_disconnected))

    @app.post("/v1/embeddings")
    @_guard
    async def embeddings(request: Request):
        serves("pooling", "Embeddings")
        return respond(await state.embedding.create(await request.body(),
                                                    request.is_disconnected))

    add_scoring_routes(app, state, _guard, respond, serves)

    @app.get("/v1/models")
    @_guard
    async def models():
        return JSONResponse(state.tokenization.models())

    @app.post("/tokenize")
    @_guard
    async def tokenize(request: Request):
        return JSONResponse(await state.tokenization.tokenize(await request.body()))

    @app.post("/detokenize")
    @_guard
    async def detokenize(request: Request):
        return JSONResponse(await state.tokenization.detokenize(await request.body()))

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, 503)
        if not state.ready:
            return JSONResponse(state.startup.status(), 503)
        if not state.llm.is_running:
            return JSONResponse({"status": "dead", "detail": "the engine is not running"}, 503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        if state.llm is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(state.llm.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return JSONResponse({"version": jaxserve.__version__})

    @app.get("/load")
    async def load():
        return JSONResponse({"server_load": state.gate.load if state.load_tracking else 0})

    @app.post("/invocations")
    @_guard
    async def invocations(request: Request):
        """SageMaker-style entry: a chat body (`messages`) or a completion body (`prompt`);
        on a pooling server, an embeddings body (`input`)."""
        raw = await request.body()
        body = await state.lanes.run(state.lanes.is_heavy(len(raw)), loads_body, raw)
        if state.runner == "pooling":  # an embeddings body (`input`)
            return respond(await state.embedding.create(body, request.is_disconnected,
                                                        len(raw)))
        if isinstance(body, dict) and "messages" in body:
            handler = state.chat
        elif isinstance(body, dict) and "prompt" in body:
            handler = state.completion
        else:
            raise OpenAIError(400, "an /invocations body holds either messages (chat) or "
                                   "prompt (completion)")
        return respond(await handler.create(body, request.is_disconnected, len(raw)))

    @app.get("/tokenizer_info")
    @_guard
    async def tokenizer_info():
        if not state.tokenizer_info:
            raise OpenAIError(404, "/tokenizer_info is off (--enable-tokenizer-info-endpoint)")
        return JSONResponse(state.tokenization.tokenizer_info())

    if state.runtime_lora:
        _add_lora_routes(app, state)
    if state.dev_mode:
        add_dev_routes(app, state, _guard)


def _add_lora_routes(app: FastAPI, state) -> None:
    """vLLM's runtime LoRA endpoints (only with `allow_runtime_lora_updating`): 200 with a
    plain-text success line, or an OpenAI-style error naming the adapter."""
    logger.warning("jaxserve: LoRA adapters may be loaded and unloaded at runtime "
                   "(/v1/load_lora_adapter): any client with access can read adapter "
                   "directories on this host")

    async def body_of(request: Request, model):
        raw = await request.body()
        return await state.lanes.run(state.lanes.is_heavy(len(raw)), parse_body, raw, model)

    @app.post("/v1/load_lora_adapter")
    @_guard
    async def load_lora_adapter(request: Request):
        body = await body_of(request, LoadLoRAAdapterRequest)
        text = await state.models.load_lora_adapter(state.llm, body.lora_name, body.lora_path)
        return Response(text, media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    @_guard
    async def unload_lora_adapter(request: Request):
        body = await body_of(request, UnloadLoRAAdapterRequest)
        text = await state.models.unload_lora_adapter(state.llm, body.lora_name,
                                                      body.lora_int_id)
        return Response(text, media_type="text/plain")


def start_in_background(app: FastAPI, build, on_error=None) -> threading.Thread:
    """Runs `build(startup) -> AsyncLLM` in a thread and attaches the engine when done.

    `build` may set `startup.phase` and `startup.engine` to report progress. A failure is
    logged, reported by `/health` ("failed"), and passed to `on_error(exception)`.
    """

    def run():
        startup = app.state.startup
        try:
            app.state.attach(build(startup))
            logger.info("jaxserve: ready")
        except Exception as e:  # noqa: BLE001 - reported by /health and the log
            logger.error("jaxserve: start-up failed: %s", e)
            startup.error = f"start-up failed: {type(e).__name__}: {e}"
            if on_error is not None:
                on_error(e)

    thread = threading.Thread(target=run, name="jaxserve-startup", daemon=True)
    thread.start()
    return thread


class GracefulServer(uvicorn.Server):
    """uvicorn server whose first SIGTERM/SIGINT drains: new requests get a 503 while the
    listener stays open, in-flight ones may finish for `drain_timeout` seconds, the rest
    end with an error (an error event and `[DONE]` for streams), then the server exits
    with status 0. A second SIGINT exits at once."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float = 30.0):
        super().__init__(config)
        self.app = app
        self.drain_timeout = drain_timeout

    def handle_exit(self, sig, frame) -> None:
        state = self.app.state
        if state.draining:
            self.should_exit = True
            if sig == signal.SIGINT:
                self.force_exit = True
            return
        state.draining = True
        logger.info("jaxserve: got %s; no new requests, finishing in-flight ones (up to "
                    "%.0fs)", signal.Signals(sig).name if sig else "stop", self.drain_timeout)
        loop = getattr(state, "loop", None)
        if loop is None or loop.is_closed():
            self.should_exit = True
            return
        loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        state = self.app.state
        gate = getattr(state, "gate", None)
        deadline = time.monotonic() + self.drain_timeout
        while gate is not None and gate.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if gate is not None and gate.in_flight:
            logger.warning("jaxserve: ending %d requests still running after %.0fs",
                           gate.in_flight, self.drain_timeout)
            if state.llm is not None:
                await asyncio.to_thread(state.llm.shutdown)
            end = time.monotonic() + 10
            while gate.in_flight and time.monotonic() < end:
                await asyncio.sleep(0.05)
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        # NOTE: uvicorn re-raises a caught SIGTERM after shutting down (exit status 143);
        # a drained server exits normally instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000,
                shutdown_timeout: float | None = 30.0, log_level: str = "info") -> GracefulServer:
    """A uvicorn server for `app` (run it with `.run()`; `handle_exit` drains and stops it)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5, access_log=False)
    return GracefulServer(config, app, 30.0 if shutdown_timeout is None else shutdown_timeout)
