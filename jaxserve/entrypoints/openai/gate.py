"""ASGI gate in front of every route: readiness (503 while starting or draining), the API key
(a repeated Authorization header is a 400), the request-body size limit (413), and the count
of requests in flight (for the drain)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json

from jaxserve.entrypoints.openai.errors import error_body
from jaxserve.utils import trim_memory

# Paths answered whatever the server's state, and without a key.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/load"})
# Paths that do work on their input: behind the key when one is set.
KEYED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/invocations", "/tokenizer_info",
                  "/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache")
# Requests that `/load` counts while they are answered (streams until their last event).
LOAD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/invocations"})
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024


async def _send_json(send, status: int, body: dict, headers: list | None = None) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})


def bearer_matches(header: str, api_key: str) -> bool:
    """Whether an Authorization header carries `api_key` (scheme case-insensitive)."""
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              api_key.encode())


class ServerGate:
    """ASGI middleware; see the module docstring.

    Args:
        app: The wrapped ASGI app.
        state: The app's state: `ready` (bool), `draining` (bool), `startup_status()`.
        api_key: Require `Authorization: Bearer <api_key>` on keyed paths when set.
        max_body_bytes: Largest request body accepted (413 beyond).
    """

    def __init__(self, app, state, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app, self.state, self.api_key = app, state, api_key
        self.max_body_bytes = max_body_bytes
        self.in_flight = 0
        self.load = 0  # requests on LOAD_PATHS being answered
        state.gate = self

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path not in OPEN_PATHS:
            if self.state.draining:
                return await _send_json(send, 503, error_body(503, "the server is shutting "
                                                                   "down"))
            if not self.state.ready:
                return await _send_json(send, 503, error_body(
                    503, f"the server is starting ({self.state.startup_status()['detail']})"))
        auths = [v for k, v in scope["headers"] if k.lower() == b"authorization"]
        if len(auths) > 1:
            # NOTE: a proxy that reads the first header and a server that reads another
            # would disagree on who is calling: refuse rather than pick one.
            return await _send_json(send, 400, error_body(
                400, f"the request has {len(auths)} Authorization headers; send one"))
        if self.api_key and path.startswith(KEYED_PREFIXES):
            given = (auths[0] if auths else b"").decode("latin-1")
            if not bearer_matches(given, self.api_key):
                return await _send_json(send, 401, error_body(
                    401, "Invalid or missing API key (expected 'Authorization: Bearer "
                         "<key>')."), [(b"www-authenticate", b"Bearer")])
        size = 0
        if scope["method"] in ("POST", "PUT", "PATCH"):
            receive, size = await self._buffer_body(scope, receive, send)
            if receive is None:
                return
        counted = int(path in LOAD_PATHS)
        self.in_flight += 1
        self.load += counted
        try:
            return await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            self.load -= counted
            lanes = getattr(self.state, "lanes", None)
            if lanes is not None and lanes.is_heavy(size):
                # NOTE: once a large request is answered and its objects are gone, the C
                # heap's free memory goes back to the system (RSS returns to its level).
                del receive
                with contextlib.suppress(RuntimeError):  # the executor is shut down
                    asyncio.get_running_loop().run_in_executor(None, trim_memory)

    async def _buffer_body(self, scope, receive, send):
        """Reads the body up to the limit: (a replaying `receive`, its size), or (None, 0)
        after a 413 or a 429."""
        limit = self.max_body_bytes
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        too_large = error_body(413, f"request body is larger than the limit of {limit} bytes "
                                    "(--max-request-body-bytes)")
        close = [(b"connection", b"close")]
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_json(send, 413, too_large, close)
            return None, 0
        lanes = getattr(self.state, "lanes", None)
        if declared is not None and declared.isdigit() and lanes is not None \
                and lanes.is_heavy(int(declared)) and lanes.heavy_full:
            # NOTE: the heavy lane would refuse it: say so before reading megabytes.
            lanes.heavy_refused += 1
            lim = lanes.limits
            await _send_json(send, 429, error_body(
                429, f"the server is busy: the heavy lane (bodies over {lim.heavy_body_bytes} "
                     f"bytes) is full, the limit is {lim.heavy_workers + lim.heavy_queue} "
                     "requests (--heavy-prepare-workers + --heavy-prepare-queue); retry later"),
                close)
            return None, 0
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                chunks = None
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await _send_json(send, 413, too_large, close)
                return None, 0
            if not message.get("more_body", False):
                break
        body = b"".join(chunks) if chunks is not None else b""
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed or chunks is None:
                return await receive()  # the app may wait for a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay, size
