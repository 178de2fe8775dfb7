"""The per-platform tuning table: defaults, platform rows, and the values the kernels read."""

from __future__ import annotations

import pytest

from pallas_kernels import tuning
from pallas_kernels.ops import kernel_tiles


def test_every_kernel_has_defaults_and_platform_rows_override_them(monkeypatch):
    for kernel, table in tuning.TUNED.items():
        assert "*" in table, kernel
        assert tuning.tuned(kernel, "cpu") == {**table["*"], **table.get("cpu", {})}
    monkeypatch.setitem(tuning.TUNED, "ragged_xla",
                        {"*": dict(block_q=64, block_kv=128), "gpu": dict(block_q=32)})
    assert tuning.tuned("ragged_xla", "gpu") == dict(block_q=32, block_kv=128)
    assert tuning.tuned("ragged_xla", "tpu") == dict(block_q=64, block_kv=128)


def test_unknown_kernel_is_a_key_error():
    with pytest.raises(KeyError):
        tuning.tuned("no_such_kernel")


def test_kernel_tiles_follow_the_table(monkeypatch):
    assert kernel_tiles(16, 64) == (2, 4)  # 32 keys a block; 32 blocks split 4 ways
    assert kernel_tiles(16, 8) == (2, 1)
    monkeypatch.setitem(tuning.TUNED, "pallas_tiles",
                        {"*": dict(min_block_keys=64, split_from_blocks=8, max_splits=2)})
    assert kernel_tiles(16, 64) == (4, 2)


def test_min_bucket_covers_every_concrete_backend():
    from pallas_kernels.ops import ATTENTION_BACKENDS

    concrete = set(ATTENTION_BACKENDS) - {"auto"}
    assert set(tuning.tuned("min_bucket")) == concrete
