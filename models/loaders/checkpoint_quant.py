"""A Hugging Face checkpoint's own quantization (its `quantization_config`): which format
it stores, the plan that keeps it, and the reader of each format's tensors.

Each checkpoint format (FP8, AWQ, GPTQ, compressed-tensors, ...) registers a builder under
its `quant_method` (`register`); the builder reads the config and returns a
`CheckpointFormat`: the `QuantPlan` its weights are kept in and a reader that gives a
weight's row-form quantized leaves (`models.quant`'s [N, K] form, as `get_quant_rows` of a
GGUF file). `load_model` serves the checkpoint's own format under `quantization=None` or
"auto", and refuses another (`check_requested`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import numpy as np

from models.config import ArchConfig
from models.quant import QuantPlan

# `quantization` values that serve a checkpoint's own format.
OWN_FORMAT = (None, "auto")


@dataclasses.dataclass(frozen=True)
class CheckpointFormat:
    """What a quantized checkpoint stores and how its weights are read.

    Attributes:
        name: The served format's name (the plan's, shown by the startup log and
            `/v1/models`): "fp8", "awq", "gptq", "compressed-tensors", ...
        plan: The modules kept quantized, and their formats.
        reader: `(source, weight name) -> {leaf: row-form array}`: the quantized leaves
            of a weight the plan keeps (`source` is the checkpoint's `TensorSource`; the
            name is the weight's, e.g. `model.layers.0.self_attn.q_proj.weight`).
        dense_reader: `(source, tensor name) -> array`: a tensor the model reads as float,
            dequantized where the checkpoint stores it quantized (DeepSeek's `kv_b_proj`
            in an FP8 checkpoint, `models.mla`), else as stored; None: read as stored.
    """

    name: str
    plan: QuantPlan
    reader: Callable[[object, str], dict[str, np.ndarray]]
    dense_reader: Callable[[object, str], np.ndarray] | None = None


Builder = Callable[[dict, str, ArchConfig], CheckpointFormat]
_BUILDERS: dict[str, Builder] = {}


def register(*quant_methods: str) -> Callable[[Builder], Builder]:
    """Registers a builder `(quantization_config, directory, cfg) -> CheckpointFormat`
    under the `quant_method` values it reads."""

    def add(builder: Builder) -> Builder:
        for method in quant_methods:
            _BUILDERS[method] = builder
        return builder

    return add


def read_quantization_config(path: str) -> dict | None:
    """The checkpoint's quantization config: `config.json`'s `quantization_config`, or an
    older GPTQ file's `quantize_config.json` (its `quant_method` taken as "gptq"); None
    for a checkpoint that is not quantized.

    Raises:
        ValueError: A config that is not a JSON object.
    """
    cfg_path = os.path.join(path, "config.json")
    old_path = os.path.join(path, "quantize_config.json")
    qc = None
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            qc = json.load(f).get("quantization_config")
    if qc is None and os.path.exists(old_path):
        with open(old_path) as f:
            qc = {"quant_method": "gptq", **json.load(f)}
    if qc is not None and not isinstance(qc, dict):
        raise ValueError(f"{cfg_path}: quantization_config must be a JSON object, got "
                         f"{type(qc).__name__}")
    return qc


def checkpoint_format(path: str, cfg: ArchConfig) -> CheckpointFormat | None:
    """The format a Hugging Face directory stores its weights in, None when unquantized.

    Raises:
        ValueError: An unknown or missing `quant_method`, or a config its builder refuses
            (the message names the field).
    """
    qc = read_quantization_config(path)
    if qc is None:
        return None
    _load_builders()
    method = qc.get("quant_method")
    builder = _BUILDERS.get(method)
    if builder is None:
        known = ", ".join(sorted(_BUILDERS)) or "none yet"
        raise ValueError(f"{path}: quantization_config.quant_method {method!r} is not "
                         f"supported (supported: {known})")
    return builder(qc, path, cfg)


def check_requested(fmt: CheckpointFormat, quantization: str | None, path: str) -> None:
    """Refuses a `quantization` other than the checkpoint's own.

    Raises:
        ValueError: Naming both the requested and the stored format.
    """
    if quantization not in (*OWN_FORMAT, fmt.name):
        raise ValueError(f"quantization={quantization!r}: {path} stores its weights as "
                         f"{fmt.name!r}; serve them as they are (quantization='auto')")


def _load_builders() -> None:
    """Imports the format modules, each of which registers its builders."""
    # NOTE: imported here, not at the top: each format module imports this one.
    from models.loaders import quant_formats  # noqa: F401


class QuantizedSource:
    """A `TensorSource` over a quantized checkpoint that also gives the kept weights'
    quantized leaves (`get_quant_rows`, read by `hf_names.build_params`); the float leaves'
    tensors come through the format's `dense_reader`.

    Args:
        source: The checkpoint's tensors.
        fmt: Its format.
    """

    def __init__(self, source, fmt: CheckpointFormat):
        self.source = source
        self.fmt = fmt

    def get(self, name: str) -> np.ndarray:
        """Tensor `name` as the model's float leaves read it (the format's `dense_reader`)."""
        if self.fmt.dense_reader is None:
            return self.source.get(name)
        return self.fmt.dense_reader(self.source, name)

    def where(self, name: str) -> str:
        return self.source.where(name)

    def get_quant_rows(self, name: str) -> dict[str, np.ndarray]:
        """Row-form quantized leaves of the weight `name` (KeyError when absent)."""
        return self.fmt.reader(self.source, name)
