"""`batch_invariant=True` is refused, with a ValueError naming why, where it is not built:
the "pallas" backend, a tensor-parallel mesh, a mixture of experts, LoRA, 8-bit KV pages;
the engine argument's type is checked; a served model carries the flag."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve import LLM
from jaxserve.config import EngineConfig
from jaxserve.runner.serving import check_batch_invariant
from tests.conftest import TINY_ENGINE


def fake_model(backend="xla", moe=False):
    return SimpleNamespace(serving=SimpleNamespace(backend=backend),
                           cfg=SimpleNamespace(is_moe=moe))


@pytest.mark.parametrize("kwargs, model, layout, message", [
    ({}, fake_model("pallas"), None, "attention backend 'pallas'"),
    ({"tensor_parallel_size": 2}, fake_model(), SimpleNamespace(num_devices=2),
     "tensor_parallel_size 2"),
    ({}, fake_model(moe=True), None, "a mixture of experts"),
    ({"enable_lora": True}, fake_model(), None, "enable_lora"),
    ({"kv_cache_dtype": "int8"}, fake_model(), None, "kv_cache_dtype 'int8'"),
])
def test_refused_where_not_built(kwargs, model, layout, message):
    config = EngineConfig.from_kwargs(batch_invariant=True, **kwargs)
    with pytest.raises(ValueError, match=f"batch_invariant=True is not built for {message}"):
        check_batch_invariant(config, model, layout)


def test_allowed_and_off():
    for backend in ("xla", "cpu"):
        check_batch_invariant(EngineConfig.from_kwargs(batch_invariant=True),
                              fake_model(backend), None)
    check_batch_invariant(EngineConfig.from_kwargs(), fake_model("pallas", moe=True), None)


def test_not_a_bool_is_an_error():
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        EngineConfig.from_kwargs(batch_invariant="yes")


def test_pallas_engine_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="not built for attention backend 'pallas'"):
        LLM(tiny_model_dir, **{**TINY_ENGINE, "attention_backend": "pallas",
                               "batch_invariant": True, "warmup": False})


def test_served_model_carries_the_flag(tiny_model_dir):
    from jaxserve.runner.serving import serving_model

    on = serving_model(EngineConfig.from_kwargs(model=tiny_model_dir, attention_backend="xla",
                                                batch_invariant=True), None)[0]
    assert on.serving.batch_invariant and on.methods.batch_invariant
    assert on.methods.linear("q_proj").row_tile > 0 and on.methods.attention.batch_invariant
    off = serving_model(EngineConfig.from_kwargs(model=tiny_model_dir,
                                                 attention_backend="xla"), on)[0]
    assert not off.serving.batch_invariant and off.methods.linear("q_proj").row_tile == 0
    assert not off.methods.attention.batch_invariant
