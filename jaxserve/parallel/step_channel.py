"""Multi-host serving: process 0 schedules, and sends each device call to the other processes.

Over several hosts, one tensor-parallel mesh spans every process, and each jitted program
must run in every process, in the same order, on the same inputs (multi-controller SPMD).
For HTTP serving only process 0 (the leader) sees requests, so only it runs the scheduler:
before each device call it broadcasts what the call needs (the step's packed int32
buffers and static layouts, or a KV plan, or "warm up") with JAX's own collective
(`multihost_utils.broadcast_one_to_all`), and the followers (`follow`) replay the call on
their shards. Followers never schedule, detokenize or fetch samples.

A message is pickled (only jaxserve's own processes read it) and zlib-compressed (block
tables are mostly padding) into an int32 buffer padded to a power of two, so the
broadcast compiles once per size class; `prime` compiles the usual classes at start-up. A
header broadcast of fixed shape tells followers the size first. The broadcast is a device
collective: it runs after the step already on the devices, so a leader's next step
leaves its host only when the previous one is done there.
"""

from __future__ import annotations

import logging
import pickle
import threading
import zlib

import jax
import numpy as np
from jax.experimental import multihost_utils

logger = logging.getLogger("jaxserve")

_MIN_BYTES = 4096
_PRIMED_BYTES = 1 << 20  # size classes compiled by `prime`: 4 KiB .. 1 MiB


class StepChannel:
    """Process 0 sends, every other process receives, one message per device call."""

    def __init__(self):
        self.is_leader = jax.process_index() == 0
        self.num_messages = 0
        self.num_bytes = 0
        self.closed = False
        self._lock = threading.Lock()  # a message's header and body go out together

    def _broadcast(self, buf: np.ndarray) -> np.ndarray:
        return np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=self.is_leader))

    def send(self, kind: str, *payload) -> None:
        """Broadcasts one message (leader only)."""
        data = zlib.compress(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL), 1)
        size = max(_MIN_BYTES, 1 << (len(data) - 1).bit_length())
        buf = np.zeros(size // 4, np.int32)  # i32[size / 4]
        buf.view(np.uint8)[:len(data)] = np.frombuffer(data, np.uint8)
        with self._lock:
            if not self.is_leader or self.closed:
                raise RuntimeError("only process 0 sends device calls, until it closes")
            self._broadcast(np.array([len(data), size], np.int32))
            self._broadcast(buf)
            self.num_messages += 1
            self.num_bytes += len(data)

    def recv(self) -> tuple[str, tuple]:
        """Waits for the leader's next message: (kind, payload) (followers only)."""
        n, size = (int(x) for x in self._broadcast(np.zeros(2, np.int32)))
        buf = self._broadcast(np.zeros(size // 4, np.int32))
        self.num_messages += 1
        self.num_bytes += n
        return pickle.loads(zlib.decompress(buf.view(np.uint8)[:n].tobytes()))

    def prime(self) -> None:
        """Compiles the broadcast of every usual size class (leader: tells the followers
        to do the same), so serving compiles none."""
        if self.is_leader:
            self.send("prime")
        size = _MIN_BYTES
        while size <= _PRIMED_BYTES:
            self._broadcast(np.zeros(size // 4, np.int32))
            size *= 2

    def close(self) -> None:
        """Tells the followers to stop (leader; idempotent)."""
        if self.is_leader and not self.closed:
            self.send("stop")
            self.closed = True


def lead(engine) -> StepChannel:
    """Makes `engine` (process 0's) send every device call to the followers.

    Raises:
        ValueError: A draft-model speculator (its device calls are not sent), or not
            process 0.
    """
    if jax.process_index() != 0:
        raise ValueError("only process 0 leads; the others run jaxserve.parallel."
                         "step_channel.follow")
    check_followable(engine)
    channel = StepChannel()
    channel.prime()
    engine.runner.channel = channel
    return channel


def check_followable(engine) -> None:
    """Raises ValueError for engine features whose device calls followers cannot replay.

    NOTE: a speculator says itself whether it makes device calls of its own
    (`Speculator.own_device_calls`), so this layer needs no knowledge of the proposers
    above it.
    """
    if engine.config.parallel.data_parallel_size > 1:
        raise ValueError("data_parallel_size > 1 is single-host; across hosts use one "
                         "tensor-parallel replica (or one server per host)")
    spec = engine.speculator
    if spec is not None and spec.own_device_calls:
        raise ValueError("speculative_config with a draft model is single-host only; use "
                         "method 'ngram' across hosts")


def follow(engine, channel: StepChannel | None = None) -> int:
    """Replays process 0's device calls on this process's shards until told to stop.

    Args:
        engine: This process's `LLMEngine`, built with the leader's arguments (and
            warmup=False: warm-up comes as a message).
        channel: Where messages come from (default: a `StepChannel`).

    Returns:
        Messages handled.

    Raises:
        Exception: Whatever a replayed call raised; the process should then exit, which
            the distributed runtime reports to every other process.
    """
    check_followable(engine)
    channel, runner = channel or StepChannel(), engine.runner
    next_ids: dict[int, jax.Array] = {}  # i32[max_rows] sampled ids of recent steps
    while True:
        kind, payload = channel.recv()
        if kind == "stop":
            logger.info("jaxserve: follower %d stopping after %d messages",
                        jax.process_index(), channel.num_messages)
            return channel.num_messages
        if kind == "prime":
            channel.prime()
        elif kind == "warmup":
            engine.warmup()
        elif kind == "plans":
            runner.execute_plans(payload[0])
        elif kind == "step":
            inputs, step_id, prev_id = payload
            _, ids, _ = runner.launch(inputs, None if prev_id is None else next_ids[prev_id])
            next_ids[step_id] = ids
            for old in [k for k in next_ids if k < step_id - 2]:
                del next_ids[old]
        else:
            raise ValueError(f"unknown device call {kind!r} from process 0")
