"""`WeightControl`: an engine's calls for programs that drive it: new weights without a
restart (`update_weights`), `reset_prefix_cache`, and `sleep` / `wake_up` (vLLM's names).

Requests in flight are never silently carried across a weight change: `update_weights`
refuses while requests are unfinished unless `abort_running=True`, which ends them (finish
reason "abort") first; `sleep` refuses while requests are unfinished. Cached prefixes are
dropped by both (their KV was computed with the old weights, or is gone).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from jaxserve.outputs import RequestOutput

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
            last `wake_up`.
    """

    def __init__(self, worker: Worker, kv: KVCacheManager,
                 end_requests: Callable[[str, bool], list[RequestOutput]]):
        self.worker = worker
        self.kv = kv
        self.end_requests = end_requests
        self.sleep_level = 0

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
            ValueError: Requests are unfinished (and `abort_running` is False), or the
                weights do not fit the model (the message names the leaf).
        """
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
        level 2 the weights too. Returns the bytes freed.

        Raises:
            ValueError: A level other than 1 or 2, or unfinished requests.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (free the KV cache) or 2 (also the "
                             f"weights), got {level!r}")
        self.end_requests("sleep", False)
        self.reset_prefix_cache()
        freed = self.worker.sleep(level)
        self.sleep_level = max(self.sleep_level, level)
        return freed

    def wake_up(self) -> None:
        """Allocates what `sleep` freed (weights dropped at level 2 are read again from the
        model's path, unless `update_weights` gave new ones)."""
        self.worker.wake_up()
        self.sleep_level = 0

    def is_sleeping(self) -> bool:
        """Whether the engine sleeps (requests are refused until `wake_up`)."""
        return self.sleep_level > 0

    def check_awake(self) -> None:
        """Raises ValueError when the engine sleeps (new requests are refused)."""
        if self.sleep_level:
            raise ValueError("the engine is sleeping (sleep was called); call wake_up() "
                             "before adding requests")
