"""Request preparation off the event loop in two bounded lanes: light requests in one thread
pool, heavy ones (large bodies, a request's own chat template) in a small one with a bounded
queue, so heavy work queues or is refused (429) while small requests keep their latency."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.utils import trim_memory

DEFAULT_HEAVY_BODY_BYTES = 256 * 1024


@dataclasses.dataclass(frozen=True)
class PrepareLimits:
    """How requests are prepared (parsed, tokenized, templated) before the engine sees them.

    Attributes:
        heavy_body_bytes: Bodies larger than this are heavy (a 2,048-token prompt is ~10 KB;
            tokenizing 256 KiB takes ~0.1 s). Requests that bring their own `chat_template`
            are heavy whatever their size (a template may run up to its 2 s deadline).
        heavy_workers: Heavy requests prepared at once (each may keep a core busy).
        heavy_queue: Heavy requests that may wait for a worker; more get a 429.
        heavy_share: Most of the time the heavy workers may be busy: after a heavy call of
            t seconds the next starts no sooner than `t * (1 / heavy_share - 1) /
            heavy_workers` later. Heavy calls hold the interpreter (JSON decoding, template
            code) or a core (tokenizing), which slows every other request; the pause gives
            them the rest, and heavy clients wait in the queue meanwhile. 1: no pause.
        light_workers: Threads preparing the other requests.
    """

    heavy_body_bytes: int = DEFAULT_HEAVY_BODY_BYTES
    heavy_workers: int = 1
    heavy_queue: int = 16
    heavy_share: float = 0.5
    light_workers: int = 8

    def __post_init__(self):
        for name in ("heavy_body_bytes", "heavy_workers", "light_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.heavy_queue < 0:
            raise ValueError(f"heavy_queue must be at least 0, got {self.heavy_queue}")
        if not 0 < self.heavy_share <= 1:
            raise ValueError(f"heavy_share must be in (0, 1], got {self.heavy_share}")


class PrepareLanes:
    """The two lanes; `run` puts a blocking call in one and awaits it.

    Args:
        limits: Sizes of the lanes (`PrepareLimits()` when None).
    """

    def __init__(self, limits: PrepareLimits | None = None):
        self.limits = limits or PrepareLimits()
        self._light: concurrent.futures.ThreadPoolExecutor | None = None
        self._heavy: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.heavy_admitted = 0  # heavy calls queued or running
        self.heavy_refused = 0
        self._not_before = 0.0  # monotonic time before which no heavy call starts

    @property
    def heavy_full(self) -> bool:
        """Whether a heavy call now would be refused (the gate then refuses a large body
        before reading it)."""
        return self.heavy_admitted >= self.limits.heavy_workers + self.limits.heavy_queue

    def is_heavy(self, body_bytes: int) -> bool:
        """Whether a body of this many bytes is prepared in the heavy lane."""
        return body_bytes > self.limits.heavy_body_bytes

    def _executor(self, heavy: bool) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if heavy and self._heavy is None:
                self._heavy = concurrent.futures.ThreadPoolExecutor(
                    self.limits.heavy_workers, thread_name_prefix="jaxserve-prepare-heavy")
            if not heavy and self._light is None:
                self._light = concurrent.futures.ThreadPoolExecutor(
                    self.limits.light_workers, thread_name_prefix="jaxserve-prepare")
            return self._heavy if heavy else self._light

    def _admit(self) -> None:
        lim = self.limits
        most = lim.heavy_workers + lim.heavy_queue
        with self._lock:
            if self.heavy_admitted >= most:
                self.heavy_refused += 1
                raise OpenAIError(429, f"the server is busy: {self.heavy_admitted} heavy "
                                       f"requests (bodies over {lim.heavy_body_bytes} bytes or "
                                       "with their own chat_template) are being prepared or "
                                       f"wait, the limit is {most} ({lim.heavy_workers} "
                                       f"workers + {lim.heavy_queue} queued: "
                                       "--heavy-prepare-workers, --heavy-prepare-queue); "
                                       "retry later")
            self.heavy_admitted += 1

    def _release(self, _future) -> None:
        with self._lock:
            self.heavy_admitted -= 1

    async def run(self, heavy: bool, fn: Callable[..., Any], *args) -> Any:
        """`fn(*args)` in the light or heavy lane; its result or its exception.

        A heavy call beyond the queue's bound is refused before it runs; a heavy call gives
        the memory it freed back to the system when it ends. Cancelling the await drops a
        call that has not started (a started one finishes in its thread).

        Raises:
            OpenAIError: 429 when the heavy lane's queue is full (naming the limit).
        """
        if heavy:
            self._admit()
            call = functools.partial(self._heavy_call, fn, *args)
        else:
            call = functools.partial(fn, *args)
        try:
            future = self._executor(heavy).submit(call)
        except BaseException:
            if heavy:
                self._release(None)
            raise
        if heavy:
            future.add_done_callback(self._release)  # runs on completion or cancellation
        try:
            return await asyncio.wrap_future(future)
        finally:
            # NOTE: a failed call's exception holds its traceback, which holds this frame,
            # which held the future, which holds the exception: a cycle that keeps the
            # request's body alive until the cyclic GC runs, seconds or minutes later.
            del future, call

    def shutdown(self) -> None:
        """Stops the lanes' threads once their calls finish (queued calls are dropped)."""
        for executor in (self._light, self._heavy):
            if executor is not None:
                executor.shutdown(wait=False, cancel_futures=True)


    def _heavy_call(self, fn: Callable[..., Any], *args) -> Any:
        """`fn(*args)` after the pause the share asks for, then `trim_memory()`."""
        lim = self.limits
        while (wait := self._not_before - time.monotonic()) > 0:
            time.sleep(wait)
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            trim_memory()
            end = time.monotonic()
            pause = (end - start) * (1 / lim.heavy_share - 1) / lim.heavy_workers
            with self._lock:
                self._not_before = max(self._not_before, end + pause)
