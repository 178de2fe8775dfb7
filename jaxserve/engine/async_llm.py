"""`AsyncLLM`: an asyncio front over `LLMEngine`, whose blocking steps run in a background thread.

The engine is touched only by its thread. Requests and aborts reach it through a
thread-safe queue, drained before every step; outputs go back to each request's
`RequestStream` on the asyncio loop that added it (so any loop, or several, may use it).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import Future

from jaxserve.metrics import ServerMetrics, StatLogger
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve")


class EngineDeadError(RuntimeError):
    """The engine stopped (shutdown or a crash) before the request finished."""


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative `RequestOutput`s.

    Each item is the latest state (older undelivered states are skipped: they are
    prefixes of it). Leaving the iteration early, or dropping the stream, aborts the
    request in the engine.
    """

    def __init__(self, request_id: str, owner: AsyncLLM, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def _put(self, item) -> None:
        """Delivers an output or an exception (thread-safe)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.finished = True

    async def get(self) -> RequestOutput:
        """The next (latest) output; raises the engine's error if the request failed."""
        item = await self._queue.get()
        while not self._queue.empty() and not isinstance(item, BaseException):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                yield await self.get()
        finally:
            self.abort()

    def abort(self) -> None:
        """Aborts the request unless it already finished (idempotent, thread-safe)."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    def __del__(self):
        if not self.finished and self._owner is not None:
            self._owner.abort(self.request_id)


class AsyncLLM:
    """Serves one `LLMEngine` to asyncio code.

    Args:
        engine: The engine; from now on only the background thread touches it.
        metrics: Where to record latencies and engine figures (default: a fresh one).
        log_interval: Seconds between stat log lines while busy (0 disables them).
    """

    def __init__(self, engine, metrics: ServerMetrics | None = None, log_interval: float = 10.0):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.limits.max_model_len
        self.metrics = metrics or ServerMetrics("jaxserve")
        self.stat_logger = StatLogger(log_interval) if log_interval > 0 else None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._stopped = False
        self.errored: BaseException | None = None
        self.metrics.update_snapshot(engine.get_metrics())
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, model=None, *, tokenizer=None, metrics=None,
                         log_interval: float = 10.0, **engine_args) -> AsyncLLM:
        """Builds the engine like `LLM(model, tokenizer=..., **engine_args)` does."""
        from jaxserve.engine.llm import LLM

        return cls(LLM(model, tokenizer=tokenizer, **engine_args).engine, metrics, log_interval)

    @property
    def is_running(self) -> bool:
        """Whether the engine thread is alive and accepting requests."""
        return self._thread.is_alive() and not self._stopped

    # ------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt, params: SamplingParams, *,
                          priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """Queues a request; returns its stream once the engine accepted it.

        Raises:
            ValueError: The engine rejected it (bad prompt or parameters, too long, ...).
            EngineDeadError: The engine is shut down.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        stream = RequestStream(request_id, self, asyncio.get_running_loop())
        accepted: Future = Future()
        self._commands.put(("add", (stream, prompt, params, priority, cache_salt, time.time()),
                            accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            stream.finished = True
            self.abort(request_id)  # the engine may have taken it before we left
            raise
        except BaseException:
            stream.finished = True
            raise
        return stream

    async def generate(self, prompt, params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Adds a request and yields its cumulative outputs until it finishes."""
        stream = await self.add_request(request_id, prompt, params, priority=priority,
                                        cache_salt=cache_salt)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Aborts a request (thread-safe); its pages are freed before the next step."""
        self._commands.put(("abort", request_id, None))

    def get_metrics(self) -> dict[str, float]:
        """The engine's figures as of its latest step."""
        return dict(self.metrics.snapshot)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the engine thread; unfinished requests end with `EngineDeadError`."""
        if not self._stopped:
            self._stopped = True
            self._commands.put(("stop", None, None))
        self._thread.join(timeout)

    # ------------------------------------------------------ engine thread
    def _handle(self, kind: str, payload, done: Future | None) -> None:
        engine = self.engine
        if kind == "add":
            stream, prompt, params, priority, cache_salt, arrival = payload
            if stream.finished:  # its consumer already left
                done.cancel()
                return
            try:
                engine.add_request(stream.request_id, prompt, params, priority=priority,
                                   cache_salt=cache_salt, arrival_time=arrival)
            except Exception as e:  # noqa: BLE001 - rejected: the caller gets the error
                done.set_exception(e)
                return
            self._streams[stream.request_id] = stream
            done.set_result(None)
        elif kind == "abort" and payload in self._streams:
            self._streams.pop(payload)
            self.metrics.forget(payload)
            engine.abort_request([payload])

    def _drain(self, block: bool) -> bool:
        """Runs queued commands (waiting for one if `block`); False once told to stop."""
        try:
            item = self._commands.get(timeout=1.0) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item[0] == "stop":
                return False
            self._handle(*item)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
            logger.exception("jaxserve: engine step failed; aborting %d requests",
                             len(self._streams))
            self._fail_all(RuntimeError(f"engine step failed: {e}"))
            return
        now = time.time()
        for out in outputs:
            self.metrics.observe(out, now)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream._put(out)

    def _fail_all(self, error: BaseException) -> None:
        ids = list(self._streams)
        for request_id in ids:
            self._streams.pop(request_id)._put(error)
            self.metrics.forget(request_id)
        if ids:
            self.engine.abort_request(ids)

    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    self._step()
                snapshot = self.engine.get_metrics()
                self.metrics.update_snapshot(snapshot)
                if self.stat_logger is not None:
                    self.stat_logger.maybe_log(snapshot)
        except BaseException as e:  # noqa: BLE001 - record why the engine died
            logger.exception("jaxserve: engine thread died")
            self.errored = e
        finally:
            self._stopped = True
            self._fail_all(EngineDeadError("the engine shut down before the request finished"))
            while True:  # answer adds that raced with the shutdown
                try:
                    kind, _, done = self._commands.get_nowait()
                except queue.Empty:
                    break
                if done is not None and not done.done():
                    done.set_exception(EngineDeadError("the engine is not running"))
            self.metrics.update_snapshot(self.engine.get_metrics())
