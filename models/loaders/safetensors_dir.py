"""Reads a Hugging Face model directory: `config.json` plus one or many `*.safetensors`.

The safetensors format is parsed here directly (8-byte header length, JSON header,
raw little-endian data) so truncated or malformed files are reported per tensor, and
bfloat16 needs no torch.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn,
}


def read_safetensors_header(path: str) -> tuple[dict, int]:
    """Returns (header dict, offset of the data section).

    Raises:
        ValueError: The file is too short or its header is not valid JSON.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path}: truncated safetensors header ({n} bytes announced, "
                             f"{size - 8} present)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


# Where a multimodal checkpoint keeps its language model (Gemma 3 ForConditionalGeneration:
# transformers 5 saves `model.language_model.*`, earlier versions `language_model.model.*`
# and `language_model.lm_head.*`), and the names the decoder asks for instead.
LANGUAGE_MODEL_PREFIXES = (("model.language_model.", "model."),
                           ("language_model.model.", "model."),
                           ("language_model.lm_head.", "lm_head."))
# A bare decoder's tensors (`Qwen3Model.save_pretrained`, as Qwen3-Embedding ships):
# `embed_tokens.*`, `layers.*`, `norm.*` without the `model.` prefix the decoder asks for.
BARE_DECODER_PREFIXES = ("embed_tokens.", "layers.", "norm.")


class SafetensorsDir:
    """Tensor source over the safetensors files of an HF directory (sharded or not)."""

    def __init__(self, directory: str):
        self.directory = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p for p in os.listdir(directory) if p.endswith(".safetensors"))
            if not files:
                raise ValueError(f"no *.safetensors files in {directory}")
        self._entries: dict[str, tuple[str, dict, int]] = {}
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise ValueError(f"safetensors shard {path} listed in the index is missing")
            header, data_start = read_safetensors_header(path)
            for tensor, info in header.items():
                self._entries[tensor] = (path, info, data_start)
        for tensor in list(self._entries):  # the language model of a multimodal checkpoint
            for old, new in LANGUAGE_MODEL_PREFIXES:
                if tensor.startswith(old):
                    self._entries.setdefault(new + tensor[len(old):], self._entries[tensor])
        if not any(t.startswith("model.") for t in self._entries):
            for tensor in list(self._entries):
                if tensor.startswith(BARE_DECODER_PREFIXES):
                    self._entries.setdefault("model." + tensor, self._entries[tensor])
        self._maps: dict[str, np.memmap] = {}

    def tensor_bytes(self) -> int:
        """Bytes the files' tensors hold (their data sections; each tensor once, aliases
        of a multimodal checkpoint's language model not counted twice)."""
        spans = {(path, *info["data_offsets"]) for path, info, _ in self._entries.values()
                 if isinstance(info, dict) and "data_offsets" in info}
        return sum(end - begin for _, begin, end in spans)

    def where(self, name: str) -> str:
        entry = self._entries.get(name)
        return entry[0] if entry else f"the safetensors files of {self.directory}"

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> np.ndarray:
        path, info, data_start = self._entries[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name!r} in {path} has unsupported dtype {info['dtype']}")
        dtype = np.dtype(_DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        file_size = os.path.getsize(path)
        if data_start + end > file_size:
            raise ValueError(
                f"tensor {name!r} in {path} is truncated: needs bytes up to "
                f"{data_start + end}, file has {file_size}"
            )
        if end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise ValueError(f"tensor {name!r} in {path}: {end - begin} bytes do not hold "
                             f"shape {shape} of {info['dtype']}")
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        raw = self._maps[path][data_start + begin:data_start + end]
        return np.asarray(raw.view(dtype).reshape(shape))


def read_config(directory: str) -> dict:
    """Loads `config.json` of an HF directory, with a clear error when absent or corrupt."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"{directory} has no config.json (not a Hugging Face model directory)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
