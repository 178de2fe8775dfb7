"""`lora_delta` against a per-token NumPy loop: both implementations, tokens without an
adapter, every slot in one batch, slots no token uses, and bad shapes."""

from __future__ import annotations

import numpy as np
import pytest

from models.linear.lora import LORA_IMPLS, lora_delta


def reference(x, slots, a, b):
    out = np.zeros((x.shape[0], b.shape[-1]), np.float64)
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] = x[t].astype(np.float64) @ a[s] @ b[s]
    return out


@pytest.mark.parametrize("impl", LORA_IMPLS)
@pytest.mark.parametrize("slots", [[0, 1, 2, 3, -1, 1, 0], [-1] * 7, [2] * 7])
def test_each_token_gets_its_own_adapter(impl, slots):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 24)).astype(np.float32)
    a = rng.standard_normal((4, 24, 8)).astype(np.float32)
    b = rng.standard_normal((4, 8, 40)).astype(np.float32)
    a[3, :, 5:] = 0  # a rank-5 adapter padded to 8
    b[3, 5:] = 0
    slots = np.asarray(slots, np.int32)
    got = np.asarray(lora_delta(x, slots, a.transpose(1, 0, 2), b, impl))  # A [in, S, R]
    np.testing.assert_allclose(got, reference(x, slots, a, b), rtol=1e-4, atol=1e-4)
    assert not got[slots < 0].any()


def test_bad_inputs_are_value_errors():
    x, slots = np.zeros((3, 8), np.float32), np.zeros(3, np.int32)
    a, b = np.zeros((8, 2, 4), np.float32), np.zeros((2, 4, 6), np.float32)  # [in, S, R]
    with pytest.raises(ValueError, match="unknown LoRA impl 'bgmv'"):
        lora_delta(x, slots, a, b, "bgmv")
    with pytest.raises(ValueError, match=r"do not fit tokens \(3, 8\)"):
        lora_delta(x, slots, a, np.zeros((2, 5, 6), np.float32))
    with pytest.raises(ValueError, match="do not fit tokens"):
        lora_delta(np.zeros((3, 9), np.float32), slots, a, b)
