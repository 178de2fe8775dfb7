"""vLLM's defaults that follow the hardware: `dtype="auto"` (float32 on the CPU, the
checkpoint's dtype on a GPU/TPU, here a mocked backend) and `max_model_len` (the model's
context length, or the longest request the KV pool holds)."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.runner.worker import Worker
from models.linear import ServingChoice
from models.loaders import load_model, resolve_model, serving_dtype
from models.loaders.serving_dtype import auto_dtype, checkpoint_dtype, resolve_dtype
from models.model import Model, random_params
from tests.conftest import TINY_HF_CONFIG
from tests.models.test_kv_groups_decoder import CFG as HYBRID_CFG

# Engine sizes without max_model_len and dtype (the defaults under test); no warm-up, and
# the worker alone: nothing compiles.
SIZES = dict(max_num_seqs=16, max_num_batched_tokens=64, attention_backend="xla",
             warmup=False)


def with_dtype(src: str, dst, value: str | None, key: str = "torch_dtype") -> str:
    """`src` (an HF directory) again at `dst` with config.json's dtype field set to `value`
    (None: no dtype field); the other files linked."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.pop("torch_dtype", None)
    if value is not None:
        config[key] = value
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return str(dst)


@pytest.fixture(scope="module")
def dirs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("dtypes")
    return SimpleNamespace(
        bf16=with_dtype(tiny_model_dir, root / "bf16", "bfloat16"),
        f16=with_dtype(tiny_model_dir, root / "f16", "float16", key="dtype"),
        f32=with_dtype(tiny_model_dir, root / "f32", "float32"),
        none=with_dtype(tiny_model_dir, root / "none", None))


def worker(model, **kwargs) -> Worker:
    return Worker(EngineConfig.from_kwargs(model=model, **{**SIZES, **kwargs}))


# ------------------------------------------------------------------------------ dtype


def test_checkpoint_dtype_reads_config_json_and_gguf(dirs, smollm2_path, tmp_path):
    import gguf

    assert checkpoint_dtype("hf", dirs.bf16) == "bfloat16"  # torch_dtype (transformers 4)
    assert checkpoint_dtype("hf", dirs.f16) == "float16"  # dtype (transformers 5)
    assert checkpoint_dtype("hf", dirs.none) is None
    assert checkpoint_dtype("gguf", smollm2_path) is None  # Q4_1: a quantized file
    for file_type, name in [(0, "float32"), (1, "float16"), (32, "bfloat16")]:
        path = str(tmp_path / f"{name}.gguf")  # llama.cpp's general.file_type, no tensors
        writer = gguf.GGUFWriter(path, "llama")
        writer.add_file_type(file_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert checkpoint_dtype("gguf", path) == name


@pytest.mark.parametrize("stored, backend, chosen", [
    ("bfloat16", "cpu", "float32"), ("float32", "cpu", "float32"),
    ("bfloat16", "tpu", "bfloat16"), ("bfloat16", "gpu", "bfloat16"),
    ("float32", "gpu", "bfloat16"),  # vLLM downcasts float32 to the platform's preferred
    ("float16", "gpu", "bfloat16"),  # jaxserve serves no float16
    (None, "tpu", "bfloat16"),
])
def test_auto_dtype_rule(stored, backend, chosen):
    assert auto_dtype(stored, backend) == chosen


def test_auto_is_float32_on_the_cpu_even_for_a_bfloat16_checkpoint(dirs, caplog):
    assert EngineConfig.from_kwargs().model.dtype == "auto"  # the default
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        w = worker(dirs.bf16, num_kv_blocks=300)
    assert w.model.dtype == np.float32 and w.dtype == "float32"
    assert "emulates" not in caplog.text
    # The draft model of speculative decoding loads in the target's resolved dtype.
    assert w.draft_runner_args(4)["dtype"] == "float32"


def test_auto_follows_the_checkpoint_on_a_mocked_accelerator(dirs, monkeypatch):
    monkeypatch.setattr(serving_dtype, "current_platform", lambda: "tpu")
    assert resolve_dtype("auto", *resolve_model(dirs.bf16)) == "bfloat16"
    assert resolve_dtype("auto", *resolve_model(dirs.f32)) == "bfloat16"
    assert resolve_dtype("float32", *resolve_model(dirs.bf16)) == "float32"  # as asked
    model = load_model(dirs.bf16)  # dtype="auto": the load follows the same rule
    assert model.dtype == jax.numpy.bfloat16


def test_bfloat16_and_fp8_on_the_cpu_warn_and_are_honoured(dirs, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        w = worker(dirs.f32, dtype="bfloat16", kv_cache_dtype="fp8", num_kv_blocks=300)
    assert w.model.dtype == jax.numpy.bfloat16
    assert "dtype='bfloat16' on the CPU backend: XLA emulates bfloat16" in caplog.text
    assert "kv_cache_dtype='fp8' on the CPU backend: XLA emulates fp8" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        w = worker(dirs.f32, kv_cache_dtype="bfloat16", num_kv_blocks=300)
    assert "kv_cache_dtype='bfloat16' on the CPU backend: XLA converts the whole" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        worker(dirs.f32, kv_cache_dtype="float16", num_kv_blocks=300)
    assert "kv_cache_dtype" not in caplog.text  # float16 pages: no warning


def test_bad_dtype_is_named():
    with pytest.raises(ValueError, match=r"dtype must be one of \('auto', 'float32', "
                                         r"'bfloat16'\), got 'float16'"):
        EngineConfig.from_kwargs(dtype="float16")


# ---------------------------------------------------------------------- max_model_len


def test_default_max_model_len_is_the_models_context_length(dirs, caplog):
    # 299 pages of 16 tokens hold a 4096-token request (256 pages and the null page).
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        w = worker(dirs.f32, num_kv_blocks=300)
    assert w.limits.max_model_len == TINY_HF_CONFIG["max_position_embeddings"] == 4096
    assert "max_model_len" not in caplog.text


def test_default_max_model_len_shrinks_to_what_the_pool_holds(dirs, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        w = worker(dirs.f32, num_kv_blocks=65)
    assert w.limits.max_model_len == 64 * 16  # every page but the null page
    assert ("max_model_len=1024, not the model's context length 4096: the KV pool (65 pages "
            "of 16 tokens, from num_kv_blocks=65)") in caplog.text


def test_default_max_model_len_from_the_memory_budget(dirs, caplog):
    # The tiny model's float32 page: 2 layers x K,V x 3 heads x 16 x 16 tokens x 4 bytes.
    page = 2 * 2 * 3 * 16 * 16 * 4
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        w = worker(dirs.f32, kv_cache_memory_gib=101 * page / 2**30)
    assert w.limits.num_pages == 101 and w.limits.max_model_len == 1600
    assert "from the KV memory budget" in caplog.text


def test_a_given_max_model_len_is_kept_when_the_pool_is_smaller(dirs, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        w = worker(dirs.f32, num_kv_blocks=65, max_model_len=2048)
    assert w.limits.max_model_len == 2048
    assert "hold less than one max_model_len=2048 sequence" in caplog.text


def test_over_the_models_context_length_is_an_error(dirs):
    with pytest.raises(ValueError, match="max_model_len=8192 exceeds the model's "
                                         "max_position_embeddings=4096"):
        worker(dirs.f32, max_model_len=8192, num_kv_blocks=65)


@pytest.mark.parametrize("num_pages, hybrid, expected", [
    (10, True, 40),  # full group 5 pages + 2 sliding groups of 2 + the null page
    (13, True, 64),  # the whole context: 8 + 2 + 2 + 1
    (10, False, 64),  # one group: 8 pages + the null page
    (5, False, 32),
    # 8 tokens fit the three groups (4 pages); at that length the windows of 8 count as
    # full attention: one group of every layer.
    (4, True, 8),
])
def test_the_fit_counts_sliding_groups_by_their_window(num_pages, hybrid, expected):
    model = Model(HYBRID_CFG, random_params(HYBRID_CFG), serving=ServingChoice("xla"))
    config = EngineConfig.from_kwargs(block_size=8, num_kv_blocks=num_pages,
                                      attention_backend="xla")
    w = Worker(config, model, SimpleNamespace(eos_token_id=None), kv_layout=hybrid)
    assert w.model.is_hybrid == (hybrid and expected > 8)
    assert w.limits.max_model_len == expected
