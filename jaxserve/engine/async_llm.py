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
import weakref
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future

from jaxserve.engine.protocol import EngineClient
from jaxserve.metrics import ServerMetrics, StatLogger
from jaxserve.outputs import EmbeddingRequestOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

logger = logging.getLogger("jaxserve")


class EngineDeadError(RuntimeError):
    """The engine stopped (shutdown or a crash) before the request finished."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine (finish_reason "error"); others went on.

    Attributes:
        output: The request's final `RequestOutput` (its `error` says why).
    """

    def __init__(self, output: RequestOutput):
        super().__init__(f"request {output.request_id} failed: {output.error}")
        self.output = output


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative `RequestOutput`s.

    Each item is the latest state (older undelivered states are skipped: they are
    prefixes of it). Leaving the iteration early, or dropping the stream, aborts the
    request in the engine: `AsyncLLM` holds streams weakly, so a stream nobody references
    any more is collected and its request aborted. An abort from elsewhere
    (`AsyncLLM.abort`) ends the iteration with a final output whose finish_reason is
    "abort"; a request that failed on its own raises `RequestFailedError`.
    """

    def __init__(self, request_id: str, owner: AsyncLLM, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        """Delivers an output or an exception to the iterating side (thread-safe: the
        engine thread calls it)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.abort()

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
            if item.error is not None:
                raise RequestFailedError(item)
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
    """Serves one engine to asyncio code.

    Args:
        engine: The engine (an `EngineClient`: `LLMEngine`, `DataParallelEngine`); from
            now on only the background thread touches it.
        metrics: Where to record latencies and engine figures (default: a fresh one).
        log_interval: Seconds between stat log lines while busy (0 disables them).
    """

    def __init__(self, engine: EngineClient, metrics: ServerMetrics | None = None,
                 log_interval: float = 10.0):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.quantization = engine.quantization  # the weight format served
        self.metrics = metrics or ServerMetrics("jaxserve")
        self.stat_logger = StatLogger(log_interval) if log_interval > 0 else None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # NOTE: weak, so that a stream its consumer dropped is collected and aborts.
        self._streams: weakref.WeakValueDictionary[str, RequestStream] = \
            weakref.WeakValueDictionary()
        self._stopped = False
        self.errored: BaseException | None = None
        self.metrics.update_snapshot(engine.get_metrics())
        self.metrics.cache_config = engine.cache_config_info()
        self.metrics.configure(engine.max_model_len)
        self._iteration_tokens = engine.num_iteration_tokens
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
                          priority: int = 0, cache_salt: str | None = None,
                          lora_request=None) -> RequestStream:
        """Queues a request; returns its stream once the engine accepted it.

        Raises:
            ValueError: The engine rejected it (bad prompt or parameters, too long, ...).
            EngineDeadError: The engine is shut down.
        """
        streams = await self.add_requests([(request_id, prompt)], params, priority=priority,
                                          cache_salt=cache_salt, lora_request=lora_request)
        return streams[0]

    async def add_requests(self, requests: Sequence[tuple[str, object]],
                           params: SamplingParams, *, priority: int = 0,
                           cache_salt: str | None = None,
                           lora_request=None) -> list[RequestStream]:
        """Queues several `(request_id, prompt)` requests at once, all or none, with one
        LoRA adapter (`lora_request`, a `jaxserve.lora.LoRARequest`) or none.

        They reach the engine together (before its next step), so a request with many
        prompts is admitted as one batch, not one prompt per step.

        Raises:
            ValueError: The engine rejected one of them (none of them is kept).
            EngineDeadError: The engine is shut down.
        """
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        streams = [RequestStream(rid, self, loop) for rid, _ in requests]
        accepted: Future = Future()
        batch = [(stream, prompt) for stream, (_, prompt) in zip(streams, requests, strict=True)]
        self._commands.put(("add", (batch, params, priority, cache_salt, time.time(),
                                    lora_request), accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            for stream in streams:
                stream.abort()  # the engine may have taken them before we left
            raise
        except BaseException:
            for stream in streams:
                stream.finished = True
            raise
        return streams

    async def generate(self, prompt, params: SamplingParams, request_id: str, *,
                       priority: int = 0, cache_salt: str | None = None,
                       lora_request=None) -> AsyncIterator[RequestOutput]:
        """Adds a request (run with adapter `lora_request`, if given) and yields its
        cumulative outputs until it finishes."""
        stream = await self.add_request(request_id, prompt, params, priority=priority,
                                        cache_salt=cache_salt, lora_request=lora_request)
        async for out in stream:
            yield out

    async def encode(self, prompt, pooling_params, request_id: str, *,
                     priority: int = 0) -> EmbeddingRequestOutput:
        """Embeds one prompt on a pooling engine (vLLM's `encode`); returns its output.

        Raises:
            ValueError: A generate engine, bad `dimensions` or a bad prompt.
            RequestFailedError: The request failed in the engine.
        """
        stream = await self.add_request(request_id, prompt, pooling_params, priority=priority)
        return await stream.get()

    async def add_lora(self, lora_request) -> bool:
        """Loads an adapter on the engine thread (vLLM's `add_lora`).

        Raises:
            ValueError: LoRA is off, or the adapter does not load (the message names why).
            EngineDeadError: The engine is shut down.
        """
        return await self._call("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """Forgets a loaded adapter (requests running it finish with it); whether it was
        loaded."""
        return await self._call("remove_lora", lora_id)

    async def sleep(self, level: int = 1) -> int:
        """Frees the KV cache (level 2: the weights too) until `wake_up`; bytes freed.

        Raises:
            ValueError: A bad level, or requests are unfinished.
        """
        return await self._call("sleep", level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Allocates again what `sleep` freed: every memory tag, or those in `tags`
        ("weights", "kv_cache"; vLLM's partial wake-up).

        Raises:
            ValueError: An unknown tag, or weights that cannot be read again.
        """
        await self._call("wake_up", tags)

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; False while requests hold pages."""
        return await self._call("reset_prefix_cache", None)

    def is_sleeping(self) -> bool:
        """Whether any memory tag of the engine sleeps."""
        return self.engine.is_sleeping()

    async def _call(self, method: str, arg):
        """Runs one of the engine's calls (add_lora, remove_lora, sleep, wake_up,
        reset_prefix_cache) on `arg` on the engine thread, between
        steps."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        done: Future = Future()
        self._commands.put(("call", (method, arg), done))
        return await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        """Aborts a request (thread-safe); its pages are freed before the next step."""
        self._commands.put(("abort", request_id, None))

    def get_metrics(self) -> dict[str, float]:
        """The engine's figures as of its latest step."""
        return dict(self.metrics.snapshot)

    @property
    def thread_alive(self) -> bool:
        """Whether the engine thread still runs (it may, briefly, after `shutdown`)."""
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the engine thread; unfinished requests end with `EngineDeadError`."""
        if not self._stopped:
            self._stopped = True
            self._commands.put(("stop", None, None))
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------ engine thread
    def _handle(self, kind: str, payload, done: Future | None) -> None:
        engine = self.engine
        if kind == "add":
            batch, params, priority, cache_salt, arrival, lora = payload
            if any(stream.finished for stream, _ in batch):  # its consumer already left
                done.cancel()
                return
            added = []
            try:
                for stream, prompt in batch:
                    engine.add_request(stream.request_id, prompt, params, priority=priority,
                                       cache_salt=cache_salt, arrival_time=arrival,
                                       lora_request=lora)
                    added.append(stream.request_id)
            except Exception as e:  # noqa: BLE001 - rejected: the caller gets the error
                engine.abort_request(added)
                done.set_exception(e)
                return
            for stream, _ in batch:
                self._streams[stream.request_id] = stream
                if isinstance(params, SamplingParams):  # not PoolingParams (embeddings)
                    self.metrics.on_added(stream.request_id, params)
            done.set_result(None)
        elif kind == "call":
            method, arg = payload
            calls = {"add_lora": engine.add_lora, "remove_lora": engine.remove_lora,
                     "sleep": engine.sleep, "wake_up": engine.wake_up,
                     "reset_prefix_cache": lambda _: engine.reset_prefix_cache()}
            try:
                done.set_result(calls[method](arg))
            except Exception as e:  # noqa: BLE001 - the caller gets the error
                done.set_exception(e)
        elif kind == "abort":
            # NOTE: the stream may be gone already (dropped by its consumer); the engine
            # request is aborted all the same.
            stream = self._streams.pop(payload, None)
            self.metrics.forget(payload)
            finals = engine.abort_request([payload]) or []
            if stream is not None and not stream.finished:
                for out in finals:
                    stream.put(out)
                if not finals:
                    stream.put(EngineDeadError(f"request {payload} was aborted"))

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
        processed = self.engine.num_iteration_tokens
        self.metrics.observe_step(processed - self._iteration_tokens)
        self._iteration_tokens = processed
        for out in outputs:
            if isinstance(out, RequestOutput):  # not an EmbeddingRequestOutput
                self.metrics.observe(out, now)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.put(out)

    def _fail_all(self, error: BaseException) -> None:
        ids = list(self._streams.keys())
        for request_id in ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(error)
            self.metrics.forget(request_id)
        if ids:
            self.engine.abort_request(ids)

    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished_requests()):
                if self.engine.has_unfinished_requests():
                    # NOTE: arrivals and aborts show in the gauges before the (possibly long)
                    # step that takes them in, not after it.
                    self.metrics.update_snapshot(self.engine.get_metrics())
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
