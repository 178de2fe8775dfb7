"""Images on the host side of the engine: page hashes fold in each image's hash (the same
image shares pages, another image with the same text shares none), prefill chunks never
split an image whose tokens attend both ways (`whole_images`), and the encoder cache
(`EncoderCache`): encodes an image once, evicts the least recently used, and maps a step's
placeholder tokens to their rows and span ends."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.prefix_cache import update_page_hashes
from jaxserve.core.scheduler_output import ScheduledRequest
from jaxserve.multimodal.inputs import ImageItem, whole_images
from jaxserve.multimodal.processors import ImageInputs
from jaxserve.request import Request
from jaxserve.runner.encoder_cache import EncoderCache

PAGE = 4


def item(name: str, offset: int, length: int = 6, whole: bool = True) -> ImageItem:
    pixels = np.full((1, 3), float(len(name)), np.float32)
    return ImageItem(name, ImageInputs(pixels, length), offset, length, whole)


def request(items, n=20, rid="r") -> Request:
    return Request(rid, list(range(1, n + 1)), mm_items=items)


def test_page_hashes_follow_the_images():
    a, b = request([item("A", 5)]), request([item("B", 5)])
    same = request([item("A", 5)])
    ha, hb, hs = (update_page_hashes(r, PAGE) for r in (a, b, same))
    assert ha == hs
    assert ha[0] == hb[0]  # page 0 (tokens 0-3) holds no image: shared
    assert all(x != y for x, y in zip(ha[1:], hb[1:], strict=True))  # from the image on: none
    assert update_page_hashes(request([]), PAGE)[0] == ha[0]


@pytest.mark.parametrize("start, budget, want", [
    (0, 8, 5),    # would end inside the image (5-10): stops before it
    (0, 11, 11),  # holds it whole
    (0, 4, 4),    # ends before it
    (5, 4, 0),    # starts at it but cannot hold it: waits
    (7, 2, 0),    # a prefix hit inside it: the rest must come whole
    (7, 4, 4),    # ... and does
    (11, 3, 3),   # after it
])
def test_chunks_never_split_a_whole_image(start, budget, want):
    assert whole_images(request([item("A", 5)]), start, budget) == want


def test_chunks_may_split_an_image_that_is_not_whole():
    assert whole_images(request([item("A", 5, whole=False)]), 0, 8) == 8


class FakeTower:
    """Rows of an image: its pixel value + the row index, so rows are recognisable."""

    hidden_size, dtype = 2, jnp.float32

    def __init__(self):
        self.calls = 0

    def encode(self, inputs):
        self.calls += 1
        n = 6
        return (inputs.pixel_values[0, 0] * 100 + jnp.arange(n, dtype=jnp.float32))[:, None] \
            * jnp.ones((n, 2))


def test_encoder_cache_encodes_once_and_evicts_the_least_recent():
    tower = FakeTower()
    cache = EncoderCache(tower, num_rows=12)  # two images of 6 rows
    a, b, c = item("A", 0), item("BB", 0), item("CCC", 0)
    cache.ensure([a])
    cache.ensure([a, b])
    assert (tower.calls, cache.hits, cache.misses) == (2, 1, 2)
    cache.ensure([c])  # no room: A, the least recently used, goes
    assert "A" not in cache.entries and {"BB", "CCC"} == set(cache.entries)
    assert cache.metrics() == {
        "jaxserve:mm_cache_queries": 4, "jaxserve:mm_cache_hits": 1,
        "jaxserve:encoder_cache_misses": 3, "jaxserve:encoder_cache_evictions": 1,
        "jaxserve:encoder_cache_capacity_rows": 12, "jaxserve:encoder_cache_usage_perc": 1.0}
    first, _ = cache.entries["CCC"]
    np.testing.assert_array_equal(np.asarray(cache.buffer[first:first + 6, 0]),
                                  300 + np.arange(6))
    with pytest.raises(ValueError, match="encoder cache"):
        EncoderCache(tower, num_rows=5).ensure([a])


def test_token_rows_map_a_chunk_to_its_image_rows():
    cache = EncoderCache(FakeTower(), num_rows=12)
    img = item("A", 3)  # placeholders at 3-8
    cache.ensure([img])
    first, _ = cache.entries["A"]
    # a chunk of positions 2-9 after a 3-token request without images
    steps = [ScheduledRequest("x", [1, 2, 3], 0, [], 0),
             ScheduledRequest("r", list(range(8)), 2, [], 0, mm_items=(img,))]
    rows, ends = cache.token_rows(steps, 16)
    assert rows[:4].tolist() == [-1, -1, -1, -1]  # x's tokens, then position 2
    assert rows[4:10].tolist() == list(range(first, first + 6))
    assert rows[10:].tolist() == [-1] * 6
    assert ends.tolist() == [0] * 4 + [9] * 6 + [0] * 6
