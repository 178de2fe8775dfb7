"""The dtype a model is served in: `dtype="auto"` (vLLM's default) from the checkpoint's own
dtype and the platform.

vLLM's rule, for the dtypes jaxserve serves (float32 and bfloat16): on a GPU or TPU a
bfloat16 checkpoint stays bfloat16 and a float32 one (or one that names no dtype) is
downcast to the platform's preferred dtype, bfloat16; a float16 checkpoint, which vLLM
keeps on a GPU that runs float16, is served in bfloat16 (jaxserve has no float16 path).
On the CPU "auto" is float32: XLA:CPU emulates bfloat16 (and fp8) matmuls, far
slower than float32 (docs/development.md), so a smaller dtype buys nothing there.
"""

from __future__ import annotations

import logging

from models.linear.registry import platform as current_platform
from models.loaders import orbax_ckpt
from models.loaders.gguf_file import open_gguf
from models.loaders.safetensors_dir import read_config

logger = logging.getLogger("jaxserve")
AUTO = "auto"
# GGUF `general.file_type` (llama.cpp's LlamaFileType) of the unquantized files; every other
# value is a quantized file, whose float type the platform picks.
_GGUF_FLOAT_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
# The checkpoint's dtype -> what "auto" serves it in on a GPU or TPU (None: names none).
_ACCELERATOR = {"float32": "bfloat16", "bfloat16": "bfloat16", "float16": "bfloat16",
                None: "bfloat16"}


def checkpoint_dtype(kind: str, path: str) -> str | None:
    """The float dtype a model source stores its weights in, or None when it names none.

    Args:
        kind: "hf" (config.json's `dtype`, or `torch_dtype` as transformers 4 wrote it),
            "gguf" (`general.file_type`: F32, F16 or BF16; None for a quantized file) or
            "jaxserve" (the checkpoint's saved dtype).
        path: The source (`models.loaders.resolve_model`'s path).
    """
    if kind == "jaxserve":
        return orbax_ckpt.read_checkpoint_meta(path)[1]
    if kind == "gguf":
        return _GGUF_FLOAT_TYPES.get(open_gguf(path).field("general.file_type"))
    config = read_config(path)
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for cfg in (config, text):
        value = cfg.get("dtype") or cfg.get("torch_dtype")
        if isinstance(value, str):
            return value.removeprefix("torch.")
    return None


def auto_dtype(checkpoint: str | None, platform: str) -> str:
    """What `dtype="auto"` serves a checkpoint of dtype `checkpoint` in on `platform`
    ("cpu", "gpu", "tpu"; see the module docstring)."""
    if platform == "cpu":
        return "float32"
    return _ACCELERATOR.get(checkpoint, "bfloat16")


def resolve_dtype(dtype: str, kind: str, path: str, platform: str | None = None) -> str:
    """`dtype`, with "auto" made concrete for the source at `path` (`auto_dtype`).

    Args:
        dtype: "auto", "float32" or "bfloat16" (the last two are returned as given).
        kind: The source's kind (`checkpoint_dtype`).
        path: The source.
        platform: The JAX platform (default: the one serving, `registry.platform()`).
    """
    if dtype != AUTO:
        return dtype
    platform = platform or current_platform()
    stored = checkpoint_dtype(kind, path)
    chosen = auto_dtype(stored, platform)
    logger.info("jaxserve: dtype auto -> %s (%s stores %s; %s platform)", chosen, path,
                stored or "no dtype", platform)
    return chosen
