"""vLLM's development endpoints (`/sleep`, `/wake_up`, `/is_sleeping`, `/reset_prefix_cache`),
served only in development mode (`--server-dev-mode` or `VLLM_SERVER_DEV_MODE=1`)."""

from __future__ import annotations

import logging
import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from jaxserve.entrypoints.openai.errors import OpenAIError

logger = logging.getLogger("jaxserve")
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
DEV_PATHS = ("/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache")


def dev_mode_from_env() -> bool:
    """Whether `VLLM_SERVER_DEV_MODE` turns the development endpoints on."""
    return os.environ.get(DEV_MODE_ENV, "").strip().lower() in ("1", "true", "yes")


def add_dev_routes(app: FastAPI, state, guard) -> None:
    """Adds the development endpoints to `app` (`guard` turns failures into JSON errors).

    `POST /sleep?level=1|2` frees the KV cache (2: the weights too; 400 while requests
    run), `POST /wake_up` (every memory tag; `?tags=weights`, `?tags=kv_cache`, repeated
    for several, wakes those only: vLLM's partial wake-up; an unknown tag is a 400),
    `GET /is_sleeping` -> {"is_sleeping": bool} (true until every tag is awake),
    `POST /reset_prefix_cache` (400 while requests hold pages). While the engine sleeps,
    completions are refused with a 400 naming it.
    """
    logger.warning("jaxserve: development endpoints on (%s): any client with the key may "
                   "put the engine to sleep", ", ".join(DEV_PATHS))

    def engine():
        if state.llm is None:
            raise OpenAIError(503, "the engine is still starting")
        return state.llm

    async def call(fn, *args):
        try:
            return await fn(*args)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None

    @app.post("/sleep")
    @guard
    async def sleep(request: Request):
        raw = request.query_params.get("level", "1")
        if raw not in ("1", "2"):
            raise OpenAIError(400, f"level must be 1 or 2, got {raw!r}")
        await call(engine().sleep, int(raw))
        return Response(status_code=200)

    @app.post("/wake_up")
    @guard
    async def wake_up(request: Request):
        # NOTE: vLLM's query form: `tags` repeated; none at all wakes every tag.
        tags = request.query_params.getlist("tags") or None
        await call(engine().wake_up, tags)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    @guard
    async def is_sleeping():
        return JSONResponse({"is_sleeping": engine().is_sleeping()})

    @app.post("/reset_prefix_cache")
    @guard
    async def reset_prefix_cache():
        if not await call(engine().reset_prefix_cache):
            raise OpenAIError(400, "the prefix cache was not reset: requests hold pages")
        return Response(status_code=200)
