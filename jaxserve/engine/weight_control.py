"""`WeightControl`: an engine's calls for programs that drive it: new weights without a
restart (`update_weights`), `reset_prefix_cache`, and `sleep` / `wake_up` (vLLM's names).

Requests in flight are never silently carried across a weight change: `update_weights`
refuses while requests are unfinished unless `abort_running=True`, which ends them (finish
reason "abort") first; `sleep` refuses while requests are unfinished. Cached prefixes are
dropped by both (their KV was computed with the old weights, or is gone).

Sleep is kept per memory tag, as vLLM's: `sleep` puts both tags ("weights", "kv_cache") to
sleep and `wake_up(tags)` wakes some of them, so an RL loop can wake the weights, update
them, and only then allocate the KV cache (a lower peak). The engine sleeps, and refuses
requests, until every tag is awake.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxserve.outputs import RequestOutput

# vLLM's memory tags, in the order `wake_up` restores them (weights before the KV cache).
SLEEP_TAGS = ("weights", "kv_cache")

if TYPE_CHECKING:
    from jaxserve.core.kv_cache_manager import KVCacheManager
    from jaxserve.runner.worker import Worker


class WeightControl:
    """An engine's weights, cached prefixes and sleep state (`LLMEngine` delegates its
    calls of the same names here).

    Args:
        worker: The engine's `Worker` (the served weights and the page pool).
        kv: The engine's `KVCacheManager` (its cached prefixes are dropped).
        end_requests: `(what, abort) -> final outputs`: settles the engine's requests
            before a change: finishes the step in flight, then aborts the unfinished
            requests when `abort`, else raises ValueError (naming `what`) while there are
            any.

    Attributes:
        sleep_level: 0 awake, else the deepest level `sleep` was called with since the
            weights were last woken (while only the KV cache sleeps, the level `sleep` was
            called with).
        sleeping_tags: The memory tags still asleep (a subset of `SLEEP_TAGS`; empty when
            awake).
    """

    def __init__(self, worker: Worker, kv: KVCacheManager,
                 end_requests: Callable[[str, bool], list[RequestOutput]]):
        self.worker = worker
        self.kv = kv
        self.end_requests = end_requests
        self.sleep_level = 0
        self.sleeping_tags: set[str] = set()

    def update_weights(self, weights, abort_running: bool = False) -> list[RequestOutput]:
        """Serves new weights from the next step on: no recompiles; leaves already placed
        on the serving shardings are used without a copy through the host.

        Args:
            weights: A params tree in the model's standard layout (as
                `models.model.abstract_params` describes it; float weights for a quantized
                model are quantized), or the path of a checkpoint of the same architecture.
            abort_running: End unfinished requests (finish reason "abort") instead of
                refusing.

        Returns:
            The final outputs of the requests it aborted.

        Raises:
            ValueError: Requests are unfinished (and `abort_running` is False), the
                weights do not fit the model (the message names the leaf), or the model is
                an encoder (`models.encoder.EncoderModel`: its weights are not a decoder's).
        """
        if getattr(self.worker.model, "encoder", None) is not None:
            raise ValueError("update_weights: encoder-only models are not updated in place; "
                             "build a new engine over the new weights")
        aborted = self.end_requests("update_weights", abort_running)
        self.worker.update_weights(weights)
        self.reset_prefix_cache()
        return aborted

    def get_weights(self) -> dict:
        """The served weights as a params tree in the model's standard layout (the form
        `update_weights` takes; the `cpu` backend's packed panels unpacked into a copy)."""
        return self.worker.get_weights()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (vLLM's `reset_prefix_cache`); False, and nothing
        done, while requests hold pages."""
        if self.kv.pool.num_used_pages:
            return False
        self.kv.evict_cached_pages()
        return True

    def sleep(self, level: int = 1) -> int:
        """Frees device memory until `wake_up` (vLLM's `sleep`): level 1 the KV page pool,
        level 2 the weights too. Both tags sleep afterwards at either level (as vLLM's; at
        level 1 the weights stay on the devices, and waking them costs nothing). Sleeping
        again, fully or partly woken, frees what is still held. Returns the bytes freed.

        Raises:
            ValueError: A level other than 1 or 2, or unfinished requests.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (free the KV cache) or 2 (also the "
                             f"weights), got {level!r}")
        self.end_requests("sleep", False)
        self.reset_prefix_cache()
        freed = self.worker.sleep(level)
        # NOTE: woken weights were restored, so the level starts again from this call.
        deepest = self.sleep_level if "weights" in self.sleeping_tags else 0
        self.sleep_level = max(deepest, level)
        self.sleeping_tags = set(SLEEP_TAGS)
        return freed

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Allocates what `sleep` freed (vLLM's `wake_up`): every tag, or those in `tags`.

        "weights" puts the weights back (those dropped at level 2 are read again from the
        model's path, unless `update_weights` gave new ones since); "kv_cache" allocates
        the page pool. Waking a tag that is awake does nothing (as vLLM's), and so does an
        empty list. The engine serves again once every tag is awake.

        Args:
            tags: Some of "weights" and "kv_cache"; None wakes both.

        Raises:
            ValueError: `tags` is not a list of those names (an unknown tag wakes nothing),
                or the weights were dropped and cannot be read again (`Worker.wake_up`).
        """
        wanted = self.check_tags(tags)
        due = [t for t in SLEEP_TAGS if t in wanted and t in self.sleeping_tags]
        if not due:
            return
        self.worker.wake_up(weights="weights" in due, kv_cache="kv_cache" in due)
        self.sleeping_tags.difference_update(due)
        if not self.sleeping_tags:
            self.sleep_level = 0

    @staticmethod
    def check_tags(tags) -> set[str]:
        """The tags `wake_up` is asked for (None: all of them).

        Raises:
            ValueError: Not a list of "weights" / "kv_cache" (the message names the bad tag).
        """
        if tags is None:
            return set(SLEEP_TAGS)
        if isinstance(tags, (str, bytes)) or not isinstance(tags, (list, tuple, set)):
            raise ValueError(f"wake_up tags must be a list of memory tags {list(SLEEP_TAGS)} "
                             f"(or None for all), got {tags!r}")
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"wake_up: unknown memory tag(s) {unknown}; the tags are "
                             f"{list(SLEEP_TAGS)}")
        return set(tags)

    def is_sleeping(self) -> bool:
        """Whether any tag sleeps (requests are refused until every tag is awake)."""
        return bool(self.sleeping_tags)

    def check_awake(self) -> None:
        """Raises ValueError when the engine sleeps (new requests are refused)."""
        if self.sleeping_tags:
            asleep = [t for t in SLEEP_TAGS if t in self.sleeping_tags]
            raise ValueError(f"the engine is sleeping (sleep was called; still asleep: "
                             f"{', '.join(asleep)}); call wake_up() before adding requests")
