"""The padded step sizes: pinned bucket lists, bucket lookup and the rows of a bucket."""

from __future__ import annotations

import pytest

from jaxserve.runner.buckets import pick_bucket, rows_for_bucket, token_buckets

POW2 = [16, 32, 64, 128, 256]


@pytest.mark.parametrize("budget, kwargs, expected", [
    (512, {}, POW2 + [512]),  # the default chunked budget
    (2048, {}, POW2 + [512, 768, 1024, 1280, 1536, 1792, 2048]),  # default unchunked
    (8, {}, [16]),
    (16, {}, [16]),
    (17, {}, [16, 32]),
    (100, {}, [16, 32, 64, 128]),
    (256, {}, POW2),
    (257, {}, POW2 + [512]),
    (300, {}, POW2 + [512]),
    (1000, {}, POW2 + [512, 768, 1024]),
    (2048, {"min_bucket": 8, "gap": 512}, [8, 16, 32, 64, 128, 256, 512, 1024, 1536, 2048]),
    (40, {"min_bucket": 5}, [8, 16, 32, 64]),
    (4096, {"min_bucket": 64, "gap": 1024}, [64, 128, 256, 512, 1024, 2048, 3072, 4096]),
    (10, {"min_bucket": 1, "gap": 4}, [1, 2, 4, 8, 12]),
    (1, {"min_bucket": 1, "gap": 1}, [1]),
])
def test_token_buckets_pinned(budget, kwargs, expected):
    assert token_buckets(budget, **kwargs) == expected


@pytest.mark.parametrize("budget", [1, 15, 16, 200, 256, 511, 512, 513, 1500, 4096])
@pytest.mark.parametrize("min_bucket, gap", [(16, 256), (8, 64), (1, 1)])
def test_every_step_size_has_a_tight_bucket(budget, min_bucket, gap):
    buckets = token_buckets(budget, min_bucket=min_bucket, gap=gap)
    assert buckets == sorted(set(buckets)) and buckets[-1] >= budget
    floor = 1 << (min_bucket - 1).bit_length()
    for n in range(1, budget + 1):
        b = pick_bucket(buckets, n)
        assert b >= n
        if n <= gap:  # padding stays under 2x below the gap...
            assert b <= max(floor, 2 * n - 1)
        else:  # ...and under one gap above it
            assert b - n < gap


def test_pick_bucket():
    buckets = token_buckets(512)
    assert [pick_bucket(buckets, n) for n in (0, 1, 16, 17, 256, 257, 512)] == [
        16, 16, 16, 32, 256, 512, 512]
    with pytest.raises(ValueError, match="513 exceeds the largest bucket 512"):
        pick_bucket(buckets, 513)


def test_rows_for_bucket():
    assert [rows_for_bucket(n, 64) for n in (16, 64, 512)] == [16, 64, 64]
    assert rows_for_bucket(16, 4) == 4


@pytest.mark.parametrize("args, match", [
    ((0,), "must be positive"),
    ((512, 0), "must be positive"),
    ((512, 16, 300), "power of two"),
    ((512, 16, 0), "power of two"),
    ((512, 16, -256), "power of two"),
    ((512, 512, 256), "must not exceed the gap"),
])
def test_token_buckets_errors(args, match):
    with pytest.raises(ValueError, match=match):
        token_buckets(*args)
