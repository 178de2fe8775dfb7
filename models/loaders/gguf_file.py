"""Reads a GGUF file torch-free: metadata to an HF-style config, tensors dequantized.

Tensors are served under their Hugging Face names so `hf_names.build_params` fills the
model from GGUF exactly as from safetensors. llama.cpp stores Llama q/k projection rows
permuted for its rotary layout; they are un-permuted here. Gemma's names, norms and
metadata are in `gguf_gemma`; the mixtures of experts' (stacked experts served one
expert at a time) in `gguf_moe`.
"""

from __future__ import annotations

import os
import re
import sys

import gguf
import numpy as np
from gguf.quants import dequantize

from models.loaders.gguf_gemma import GEMMA_ARCHS, GEMMA_LAYER_NAMES, gemma_fields, unfold_norm
from models.loaders.gguf_moe import (
    MOE_ARCHS,
    MOE_LAYER_NAMES,
    PER_EXPERT_GGUF,
    canonical_name,
    expert_of,
    moe_fields,
)
from models.loaders.gguf_quant import GGUF_KEPT, decode_gguf_rows
from models.quant import QUANT_MODULES, QuantPlan

# GGUF architecture -> HF architecture name.
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", **GEMMA_ARCHS, **MOE_ARCHS}
# GGUF rope.scaling.type values served (Gemma 3 scales its global layers linearly).
_ROPE_SCALINGS = ("none", "linear")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


def hf_name_of_gguf(name: str, arch: str = "llama") -> str | None:
    """HF tensor name for a GGUF tensor name of architecture `arch`, or None for tensors
    the model does not use."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        layer, part, kind = m.groups()
        names = ({**_LAYER_NAMES, **GEMMA_LAYER_NAMES} if arch in GEMMA_ARCHS
                 else {**_LAYER_NAMES, **MOE_LAYER_NAMES})
        return f"model.layers.{layer}.{names[part]}.{kind}" if part in names else None
    base, _, kind = name.rpartition(".")
    return f"{_TOP_NAMES[base]}.{kind}" if base in _TOP_NAMES else None


class _ArrayField(gguf.ReaderField):
    """A metadata array read in one piece (`_CheckedReader`): its last parts are the
    values for numbers, or spans i64[n, 2] (offset, length) and the bytes u8[...] they
    index for strings; `data` has one entry per element, `contents` reads as gguf's
    `ReaderField`."""

    def contents(self, index_or_slice: int | slice = slice(None)):
        if self.types[-1] == gguf.GGUFValueType.STRING:
            spans, raw = self.parts[-2], self.parts[-1]

            def text(i: int) -> str:
                start, length = spans[i]
                return str(raw[start:start + length].tobytes(), encoding="utf-8")

            if isinstance(index_or_slice, int):
                return text(index_or_slice)
            # NOTE: slices of one bytes object, 3-4x faster than a NumPy slice per string
            # (the default model's vocabulary and merges are ~98k strings).
            data = raw.tobytes()
            return [data[start:start + length].decode("utf-8")
                    for start, length in spans[index_or_slice].tolist()]
        return self.parts[-1].tolist()[index_or_slice]


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader that names the first tensor a truncated file cannot hold, parses the
    metadata from a plain view of the mapping, and reads each metadata array in one
    piece."""

    _nested = False  # inside an array of arrays (`_get_field_parts`)

    def _get(self, offset, dtype, count=1, override_order=None):
        # NOTE: `np.memmap`'s slicing runs Python code for every slice, and the default
        # model's vocabulary and merges are ~250k of them: slices of a plain ndarray view
        # of the same mapping read the same bytes (BENCHMARKS.md, "reading the GGUF").
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = plain[offset:end].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs, raw_type):
        # NOTE: gguf reads an array element by element, two NumPy views per string and one
        # per number: ~250k small arrays for the default model's vocabulary, merges, token
        # types and scores, most of the metadata's parse time, and once freed they left
        # the C heap fragmented (~30 MB resident after the file was closed).
        if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY or self._nested:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        count = self._get(orig_offs + 4, np.uint64)
        itype, n, offs = gguf.GGUFValueType(raw_itype[0]), int(count[0]), orig_offs + 12
        types = [gguf.GGUFValueType.ARRAY, itype]
        nptype = self.gguf_scalar_to_np.get(itype)
        if itype != gguf.GGUFValueType.STRING and nptype is None:
            # Arrays of arrays: gguf's own reading, element by element all the way down
            # (its loop calls this method for every inner array).
            self._nested = True
            try:
                return super()._get_field_parts(orig_offs, raw_type)
            finally:
                self._nested = False
        self._get(offs, np.uint8)  # sets self._plain
        end = len(self._plain)
        least = np.dtype(nptype).itemsize if nptype is not None else 8  # a string: its length
        if n > (end - offs) // least:
            raise ValueError(f"a metadata array of {n} {itype.name.lower()} values at byte "
                             f"{orig_offs} does not fit the file ({end} bytes)")
        if nptype is not None:
            values = self._get(offs, nptype, n)
            return 12 + int(values.nbytes), [raw_itype, count, values], list(range(n)), types
        view = memoryview(self._plain)
        order = sys.byteorder if self.byte_order == "I" else (
            "big" if sys.byteorder == "little" else "little")
        spans = np.empty((n, 2), np.int64)  # i64[n, 2]: (offset from offs, length)
        pos = offs
        for i in range(n):
            length = int.from_bytes(view[pos:pos + 8], order)
            if pos + 8 + length > end:
                raise ValueError(f"string {i} of the metadata array at byte {orig_offs} runs "
                                 f"past the end of the file ({end} bytes)")
            spans[i] = (pos + 8 - offs, length)
            pos += 8 + length
        raw = self._plain[offs:pos]
        return 12 + pos - offs, [raw_itype, count, spans, raw], list(range(n)), types

    def _push_field(self, field, skip_sum=False):
        types = field.types
        if (len(types) == 2 and types[0] == gguf.GGUFValueType.ARRAY
                and (types[1] == gguf.GGUFValueType.STRING or types[1] in self.gguf_scalar_to_np)):
            field = _ArrayField(*field)  # read in one piece by `_get_field_parts`
        return super()._push_field(field, skip_sum)

    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset_tensor = field.parts
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_dtype[0])]
            end = int(start_offs + offset_tensor[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                name = bytes(name_data).decode("utf-8", "replace")
                raise ValueError(f"tensor {name!r} is truncated: needs bytes up to {end}, "
                                 f"file has {size}")
        super()._build_tensors(start_offs, fields)


class GGUFFile:
    """Tensor source and metadata of one GGUF file."""

    def __init__(self, path: str):
        if not os.path.exists(path):
            raise ValueError(f"GGUF file {path} does not exist")
        self.path = path
        try:
            self.reader = _CheckedReader(path)
        except (ValueError, IndexError, KeyError, OverflowError) as e:
            raise ValueError(f"{path}: truncated or corrupt GGUF file ({e})") from None
        self.arch = self.field("general.architecture")
        self._hf_config: dict | None = None
        self._tensors = {}
        for t in self.reader.tensors:
            if PER_EXPERT_GGUF.fullmatch(t.name):
                raise ValueError(f"{path}: tensor {t.name!r} holds one expert (an older "
                                 "llama.cpp layout); convert the model again to stack the "
                                 "experts (ffn_*_exps)")
            hf = hf_name_of_gguf(t.name, self.arch)
            if hf is not None:
                self._tensors[hf] = t

    def field(self, key: str, default=None):
        """Value of a metadata field (strings decoded, 1-element arrays unwrapped; a float32
        as the shortest decimal it stores, so 1e-6 reads back as 1e-6)."""
        f = self.reader.fields.get(key)
        if f is None:
            return default
        if f.types == [gguf.GGUFValueType.FLOAT32]:
            return float(str(np.float32(f.contents())))
        return f.contents()

    def where(self, name: str) -> str:
        return self.path

    def _lookup(self, name: str):
        """(GGUF tensor, its raw data, whether that is one expert of a stack) of an HF name:
        an expert's slice of a stacked experts tensor [E, out, in], Mixtral's names read as
        the generic ones. KeyError when absent."""
        name = canonical_name(name)
        stacked = expert_of(name)
        if stacked is None:
            t = self._tensors[name]
            return t, t.data, False
        t = self._tensors[stacked[0]]
        if stacked[1] >= t.data.shape[0]:
            raise KeyError(name)
        return t, t.data[stacked[1]], True

    def get(self, name: str) -> np.ndarray:
        t, data, one_expert = self._lookup(name)
        shape = tuple(reversed(t.shape.tolist()))
        if one_expert:
            shape = shape[1:]
        elif name.endswith("shared_expert_gate.weight") and len(shape) == 1:
            shape = (1, *shape)  # the converter may squeeze its [1, hidden]
        arr = np.asarray(dequantize(data, t.tensor_type).reshape(shape), dtype=np.float32)
        if self.arch in GEMMA_ARCHS:
            arr = unfold_norm(name, arr)
        heads = self._permuted_heads(name)
        return _unpermute(arr, heads) if heads else arr

    def _permuted_heads(self, name: str) -> int | None:
        """Head count of a tensor whose rows llama.cpp stored permuted (Llama q/k), else None."""
        if self.arch != "llama" or not (".q_proj." in name or ".k_proj." in name):
            return None
        return self.hf_config()["num_attention_heads" if ".q_proj." in name
                                else "num_key_value_heads"]

    def tensor_type(self, name: str) -> str:
        """GGUF storage type of an HF-named tensor ("F32", "Q4_1", ...)."""
        return self._lookup(name)[0].tensor_type.name

    def get_quant_rows(self, name: str) -> dict[str, np.ndarray]:
        """Row-form quantized leaves of a tensor kept in its stored type (`gguf_quant`)."""
        t, data, _ = self._lookup(name)
        rows = decode_gguf_rows(t.tensor_type.name, data, int(t.shape[0]))
        heads = self._permuted_heads(name)
        return {k: _unpermute(v, heads) for k, v in rows.items()} if heads else rows

    def quant_plan(self) -> QuantPlan:
        """The plan that keeps every module whose tensors share one kept type quantized.

        A module (say `down_proj`, or the routed experts' `experts.down_proj` stacks) stays
        quantized when all its layers are stored in types of one on-device format (Q8_0;
        or Q4_0/Q4_1/Q4_K); otherwise (F16, Q6_K, mixed types) it is dequantized to the
        model dtype.
        """
        kinds: dict[str, set] = {}
        for hf, t in self._tensors.items():
            module = hf.split(".")[-2]
            if ".mlp.experts." in hf:  # a stack of routed experts (`EXPERT_MODULES`)
                module = f"experts.{module}"
            if module not in QUANT_MODULES or not hf.endswith(".weight"):
                continue
            fmt = GGUF_KEPT.get(t.tensor_type.name)
            kinds.setdefault(module, set()).add(fmt)
        formats = tuple((m, next(iter(f))) for m, f in sorted(kinds.items())
                        if len(f) == 1 and None not in f)
        return QuantPlan(formats, "gguf")

    def hf_config(self) -> dict:
        """An HF-style `config.json` dict built from the GGUF metadata (computed once)."""
        if self._hf_config is None:
            self._hf_config = self._build_hf_config()
        return self._hf_config

    def _build_hf_config(self) -> dict:
        arch = self.arch
        if arch not in GGUF_ARCHS:
            raise ValueError(f"{self.path}: unsupported GGUF architecture {arch!r}; supported: "
                             f"{', '.join(sorted(GGUF_ARCHS))}")
        if "rope_freqs.weight" in {t.name for t in self.reader.tensors}:
            raise ValueError(f"{self.path}: GGUF rope_freqs (Llama 3.1 rope scaling) is not "
                             "supported; load the Hugging Face directory instead")
        key = lambda k, default=None: self.field(f"{arch}.{k}", default)

        def required(k: str):
            if key(k) is None:
                raise ValueError(f"{self.path}: GGUF metadata field {arch}.{k} is missing")
            return key(k)

        heads = int(required("attention.head_count"))
        hidden = int(required("embedding_length"))
        layers = int(required("block_count"))
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = key("vocab_size") or (len(tokens.data) if tokens else None)
        if arch in GEMMA_ARCHS and "model.embed_tokens.weight" in self._tensors:
            # Gemma 3's converter drops the embedding rows past the tokenizer's vocabulary.
            vocab = int(self._tensors["model.embed_tokens.weight"].shape[-1])
        if vocab is None:
            raise ValueError(f"{self.path}: the vocabulary size is unknown (no {arch}.vocab_size "
                             "and no tokenizer.ggml.tokens)")
        cfg = {
            "architectures": [GGUF_ARCHS[arch]],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(required("feed_forward_length")),
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": int(key("attention.head_count_kv", heads)),
            "head_dim": int(key("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(key("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(key("context_length", 2048)),
            "tie_word_embeddings": "lm_head.weight" not in self._tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }
        scaling = key("rope.scaling.type")
        if scaling is not None and scaling not in _ROPE_SCALINGS:
            raise ValueError(f"{self.path}: unsupported GGUF {arch}.rope.scaling.type "
                             f"{scaling!r}; supported: {', '.join(_ROPE_SCALINGS)}")
        if scaling == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear",
                                   "factor": float(required("rope.scaling.factor"))}
        if arch == "llama" and "model.layers.0.self_attn.q_proj.bias" in self._tensors:
            cfg["attention_bias"] = True
        if arch in ("qwen3", "qwen3moe") and "model.layers.0.self_attn.q_proj.bias" in \
                self._tensors:
            cfg["attention_bias"] = True
        if arch in GEMMA_ARCHS:
            cfg.update(gemma_fields(arch, key, self.path, hidden, heads, cfg["head_dim"],
                                    layers))
        cfg.update(moe_fields(arch, key, self.path, cfg["intermediate_size"], self._rows_of))
        return cfg

    def _rows_of(self, name: str) -> int | None:
        """Output rows of an HF-named tensor (a stack's per expert), None when absent."""
        t = self._tensors.get(name)
        return None if t is None else int(t.shape[1])


# abspath -> ((mtime_ns, size), GGUFFile): the files `open_gguf` keeps, oldest first.
_OPEN: dict[str, tuple[tuple[int, int], GGUFFile]] = {}
_MAX_OPEN = 2


def open_gguf(path: str) -> GGUFFile:
    """A `GGUFFile` for `path`, shared by the weight and tokenizer loaders of one process.

    NOTE: parsing the metadata of a 49k-token vocabulary takes seconds; the last two
    files are kept, keyed by modification time and size so a rewritten file is parsed
    again, until `close_gguf` forgets one.
    """
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise ValueError(f"GGUF file {path} does not exist")
    stat = os.stat(path)
    key = (stat.st_mtime_ns, stat.st_size)
    kept = _OPEN.get(path)
    if kept is not None and kept[0] == key:
        return kept[1]
    opened = GGUFFile(path)
    _OPEN.pop(path, None)
    while len(_OPEN) >= _MAX_OPEN:
        _OPEN.pop(next(iter(_OPEN)))
    _OPEN[path] = (key, opened)
    return opened


def close_gguf(path: str) -> None:
    """Forgets the `GGUFFile` `open_gguf` keeps for `path` (if any), so its reader and
    file mapping go once nothing else holds them.

    A reader holds the file mapped (its pages resident once the weights were read) and
    its metadata as many small NumPy arrays: together about twice the file's size for
    the default model. Nothing needs them once the weights and the tokenizer are
    loaded; a later `open_gguf` parses the file again.
    """
    _OPEN.pop(os.path.abspath(path), None)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's q/k row permutation (interleaved -> half-split rotary)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)
