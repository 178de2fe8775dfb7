"""Writes a transformers Gemma 2 / Gemma 3 model as a GGUF file the way llama.cpp's
`convert_hf_to_gguf.py` does (its metadata keys, tensor names and `+1` norm fold), for
tests: the converter itself is not installed.

Checked once against the real converter (the copy vendored in the llama-cpp-python 0.3.36
sdist, `--outtype f32`, on the test's tiny models): the same `gemma2.*`/`gemma3.*` keys and
values and bit-identical tensors; only `general.*` bookkeeping keys differ.
"""

from __future__ import annotations

import gguf
import numpy as np

GGUF_ARCH = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3"}


def _metadata(w: gguf.GGUFWriter, arch: str, c) -> None:
    """The keys the converter writes for `arch` from the transformers config `c`."""
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "gemma2":  # Gemma2Model writes the caps and the window unconditionally
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
        return
    rope = c.rope_parameters  # Gemma3Model: the base class's rope keys, then its own
    w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    if rope["full_attention"].get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
    w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if c.final_logit_softcapping:
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if getattr(c, "sliding_window_pattern", None) != 1:
        w.add_sliding_window(c.sliding_window)


def _tokenizer(w: gguf.GGUFWriter, source) -> None:
    """Copies the tokenizer fields of another GGUF file (a `GGUFFile`)."""
    for name, field in source.reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = source.field(name)
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(name, value)
        else:
            w.add_key_value(name, value, vtype)


def write_gemma_gguf(hf_model, path: str, tokenizer_source=None) -> None:
    """Writes `hf_model` (float32) as an F32 GGUF file at `path`.

    Args:
        hf_model: A transformers `Gemma2ForCausalLM` or `Gemma3ForCausalLM`.
        path: The file to write.
        tokenizer_source: Optional `GGUFFile` whose `tokenizer.*` fields are copied.
    """
    c = hf_model.config
    arch = GGUF_ARCH[type(hf_model).__name__]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA2 if arch == "gemma2"
                                     else gguf.MODEL_ARCH.GEMMA3, c.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    _metadata(w, arch, c)
    if tokenizer_source is not None:
        _tokenizer(w, tokenizer_source)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight":  # the converter skips it: Gemma ties the LM head
            continue
        data = tensor.detach().float().numpy()
        if name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # Gemma's RMSNorm scales by (1 + weight)
        base, _, suffix = name.rpartition(".")
        w.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
