"""Writes a tiny transformers mixture-of-experts model (its saved Hugging Face directory) as
a GGUF file the way llama.cpp's `convert_hf_to_gguf.py` does, for tests (the converter is
not installed): Mixtral as arch `llama` with `expert_count` and its q/k rows permuted
(`LlamaModel.permute`), Qwen2-MoE and Qwen3-MoE as `qwen2moe`/`qwen3moe`; each layer's
experts stacked into `ffn_{gate,up,down}_exps` [E, out, in], the shared expert's gate 1-D
(transformers' GGUF loader expects it so); tensor names from gguf-py's own map
(`gguf.get_tensor_name_map`), metadata keys from its writer.

With a block type (say Q8_0), every weight of two or more axes whose rows fit the block is
stored in it, as llama-quantize does, except norms and routers (`ffn_gate_inp*`), which
it keeps in float.
"""

from __future__ import annotations

import json
import os
import re

import gguf
import numpy as np
from gguf.quants import quantize
from safetensors.numpy import load_file

ARCHS = {"MixtralForCausalLM": gguf.MODEL_ARCH.LLAMA,
         "Qwen2MoeForCausalLM": gguf.MODEL_ARCH.QWEN2MOE,
         "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE}
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(\w+)\.weight")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (half-split rotary -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def _metadata(w: gguf.GGUFWriter, c: dict, arch: str) -> None:
    rope = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(float(rope))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(c.get("num_local_experts") or c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id)):
        if c.get(key) is not None:  # the converter writes them with the tokenizer
            add(c[key])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
        return
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])


def _hf_tensors(directory: str) -> dict[str, np.ndarray]:
    """The checkpoint's tensors with each layer's experts stacked under
    `....experts.{gate_proj|w1|...}.weight` [E, out, in]."""
    out, experts = {}, {}
    for name, arr in load_file(os.path.join(directory, "model.safetensors")).items():
        m = _EXPERT.fullmatch(name)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = arr
        else:
            out[name] = arr
    for base, by_expert in experts.items():
        out[f"{base}.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_moe_gguf(directory: str, path: str,
                   qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
                   drop: tuple[str, ...] = ()) -> None:
    """Writes the Hugging Face MoE model saved in `directory` as a GGUF file at `path`.

    Args:
        directory: A `save_pretrained` directory (config.json, model.safetensors).
        path: The file to write.
        qtype: F32, or a block type for the weights (module docstring).
        drop: GGUF tensor names to leave out (a broken file).
    """
    with open(os.path.join(directory, "config.json")) as f:
        c = json.load(f)
    model_arch = ARCHS[c["architectures"][0]]
    arch = gguf.MODEL_ARCH_NAMES[model_arch]
    names = gguf.get_tensor_name_map(model_arch, c["num_hidden_layers"])
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    _metadata(w, c, arch)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == gguf.GGMLQuantizationType.F32
                    else gguf.LlamaFileType.MOSTLY_Q8_0)
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for name, data in _hf_tensors(directory).items():
        data = np.ascontiguousarray(data.astype(np.float32))
        if arch == "llama" and name.endswith("q_proj.weight"):
            data = _permute(data, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            data = _permute(data, kv_heads)
        base, _, suffix = name.rpartition(".")
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if gguf_name in drop:
            continue
        if "ffn_gate_inp_shexp" in gguf_name:
            data = data.reshape(-1)  # stored 1-D, as llama.cpp reads it ({n_embd})
        keep_float = "norm" in gguf_name or "ffn_gate_inp" in gguf_name
        if (qtype == gguf.GGMLQuantizationType.F32 or keep_float or data.ndim < 2
                or data.shape[-1] % block):
            w.add_tensor(gguf_name, data)
        else:
            q = quantize(data, qtype)
            w.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
