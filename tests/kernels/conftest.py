"""Fixtures shared by the kernel tests: lowering the Mosaic (TPU) kernels on a CPU host."""

from __future__ import annotations

import jax
import pytest


@pytest.fixture
def fake_tpu_info(monkeypatch):
    """Lets Mosaic lowering run on a CPU host by describing a TPU v5e for this device kind."""
    from jax._src.pallas.mosaic import tpu_info

    kind = jax.devices()[0].device_kind
    monkeypatch.setitem(tpu_info.registry, kind, lambda: tpu_info.get_tpu_info_for_chip(
        tpu_info.ChipVersion.TPU_V5E, 1))
