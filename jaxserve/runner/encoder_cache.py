"""The encoder cache: a device buffer of vision-encoder output rows, allotted per image hash,
so an image seen again (in another request, or after a preemption) is not encoded again.

Images are encoded when a step first computes one of their placeholders, one image per
encoder call (one compile per image size); their rows stay until the space is needed for
another image, least recently used first, never while a step in preparation uses them.
A step reads the rows through `token_rows`: each placeholder token's row (-1 for text),
and each token's bidirectional span end (`AttentionMetadata.q_span_end`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict

import jax
import numpy as np


@functools.partial(jax.jit, donate_argnums=0)
def _put(buffer: jax.Array, rows: jax.Array, first) -> jax.Array:
    """`buffer` with `rows` [n, H] written from row `first` on."""
    return jax.lax.dynamic_update_slice_in_dim(buffer, rows.astype(buffer.dtype), first, 0)


class EncoderCache:
    """Encoder rows on the device, by image hash.

    Args:
        tower: The model's `models.vision.towers.VisionTower`.
        num_rows: Rows the buffer holds (at least one step's images).
        put: Places a host array on the step's devices (the runner's `to_device`).

    Attributes:
        buffer: dtype[num_rows, hidden] the rows (what every step reads).
        hits: Images found encoded when a step needed them (a lookup per image per step
            that computes some of its placeholders: an image split over two prefill chunks,
            which only an image without a bidirectional span can be, is looked up twice).
        misses: Images encoded.
        evictions: Images whose rows were given to another image.
    """

    def __init__(self, tower, num_rows: int, put=jax.device_put):
        self.tower = tower
        self.num_rows = num_rows
        self.buffer = put(np.zeros((num_rows, tower.hidden_size), np.dtype(tower.dtype)))
        self.entries: OrderedDict[str, tuple[int, int]] = OrderedDict()  # hash -> (first, n)
        self.hits = self.misses = self.evictions = 0

    def _free_run(self, n: int, keep: set[str]) -> int | None:
        """The first row of `n` free consecutive rows, evicting least recently used entries
        not in `keep` until there is one; None when the kept ones leave no room."""
        while True:
            taken = sorted(self.entries.values())
            start = 0
            for first, size in taken:
                if first - start >= n:
                    return start
                start = first + size
            if self.num_rows - start >= n:
                return start
            victim = next((h for h in self.entries if h not in keep), None)
            if victim is None:
                return None
            del self.entries[victim]
            self.evictions += 1

    def ensure(self, items) -> None:
        """Encodes the images of `items` (`ImageItem`s) that are not in the buffer.

        Raises:
            ValueError: The step's images need more rows than the buffer holds.
        """
        keep = {item.hash for item in items}
        for item in items:
            if item.hash in self.entries:
                self.entries.move_to_end(item.hash)
                self.hits += 1
                continue
            first = self._free_run(item.length, keep)
            if first is None:
                raise ValueError(f"a step's images need more than the encoder cache's "
                                 f"{self.num_rows} rows")
            rows = self.tower.encode(item.inputs)  # [n, H]
            self.buffer = _put(self.buffer, rows, first)
            self.entries[item.hash] = (first, item.length)
            self.misses += 1

    @property
    def used_rows(self) -> int:
        """Rows the cached images hold."""
        return sum(n for _, n in self.entries.values())

    def metrics(self) -> dict[str, float]:
        """The cache's figures for `EngineMetrics.get_metrics`: vLLM's multimodal cache
        counters (`mm_cache_queries`, `mm_cache_hits`, in images) and jaxserve's own."""
        return {"jaxserve:mm_cache_queries": self.hits + self.misses,
                "jaxserve:mm_cache_hits": self.hits,
                "jaxserve:encoder_cache_misses": self.misses,
                "jaxserve:encoder_cache_evictions": self.evictions,
                "jaxserve:encoder_cache_capacity_rows": self.num_rows,
                "jaxserve:encoder_cache_usage_perc": self.used_rows / self.num_rows}

    def token_rows(self, scheduled, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(i32[num_tokens] each token's row in the buffer, -1 for text and padding;
        i32[num_tokens] each token's bidirectional span end, 0 outside one) for a step's
        scheduled requests (`ScheduledRequest`s, packed in order), whose images `ensure`
        has put in the buffer."""
        rows = np.full(num_tokens, -1, np.int32)
        ends = np.zeros(num_tokens, np.int32)
        t = 0
        for s in scheduled:
            for item in s.mm_items:
                lo = max(item.offset, s.start_pos)
                hi = min(item.end, s.start_pos + s.num_new_tokens)
                if lo >= hi:
                    continue
                first, _ = self.entries[item.hash]
                at = slice(t + lo - s.start_pos, t + hi - s.start_pos)
                rows[at] = first + np.arange(lo - item.offset, hi - item.offset)
                if item.whole:
                    ends[at] = item.end
            t += s.num_new_tokens
        return rows, ends
