"""Random-weight Llama checkpoints written in the quantized formats people download (FP8 in
128x128 blocks, symmetric GPTQ int4/int8, asymmetric AWQ int4) and in float32, for timing
how each format serves.

The weights are random, not a quantized float model: a benchmark times the format's
tensors (their shapes, dtypes, packing and group scales), not the values, so the codes are
random words and the scales small constants' neighbourhood. The correctness oracles of these
formats are the test-side writers (`tests/models/int_packers.py`, `fp8_pack.py`), written
from each format's definition and checked against transformers.
"""

from __future__ import annotations

import dataclasses
import json
import os

import ml_dtypes
import numpy as np

# name -> (quant_method, bits, group size; 0: one scale per output channel): FP8's 128x128
# blocks, int groups of 128 (the common published choice; `gptq-int4-g32`: GGUF's block, the
# finest group), and llm-compressor's presets in compressed-tensors ("ct-"):
# W4A16 (pack-quantized int4, groups of 128), W8A8 int8 and FP8_DYNAMIC (per channel), and
# the FP4 ones: MXFP4A16 (E2M1 codes, E8M0 scales per 32) and NVFP4A16 (e4m3 scales per 16
# and a global scale).
CT = "compressed-tensors"
FORMATS = {"float32": (None, 32, 0), "fp8": ("fp8", 8, 128), "gptq-int4": ("gptq", 4, 128),
           "awq-int4": ("awq", 4, 128), "gptq-int8": ("gptq", 8, 128),
           "gptq-int4-g32": ("gptq", 4, 32), "ct-w4a16": (CT, 4, 128),
           "ct-w8a8-int8": (CT, 8, 0), "ct-fp8-dynamic": (CT, 8, 0),
           "ct-mxfp4": (CT, 4, 32), "ct-nvfp4": (CT, 4, 16)}
CT_FORMATS = {"ct-w4a16": "pack-quantized", "ct-w8a8-int8": "int-quantized",
              "ct-fp8-dynamic": "float-quantized", "ct-mxfp4": "mxfp4-pack-quantized",
              "ct-nvfp4": "nvfp4-pack-quantized"}
FP4_STRATEGIES = {"ct-mxfp4": "group", "ct-nvfp4": "tensor_group"}
LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama decoder's sizes.

    Attributes:
        hidden: Hidden size.
        intermediate: MLP width.
        layers: Decoder layers.
        vocab: Vocabulary (embedding and LM head rows).
        head_dim: Attention head width; hidden / head_dim query heads.
        kv_heads: Key/value heads.
    """

    hidden: int = 1024
    intermediate: int = 2816
    layers: int = 8
    vocab: int = 8192
    head_dim: int = 64
    kv_heads: int = 4

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each decoder Linear's [out, in] (`<block>.<proj>` names)."""
        h, i, kv = self.hidden, self.intermediate, self.kv_heads * self.head_dim
        outs = {"q_proj": (h, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, h),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
        return {f"{block}.{p}": outs[p] for block, projs in LINEARS.items() for p in projs}


def hf_config(shape: Shape) -> dict:
    """The transformers `config.json` of a float32 Llama of `shape`."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
            "num_hidden_layers": shape.layers,
            "num_attention_heads": shape.hidden // shape.head_dim,
            "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "vocab_size": shape.vocab, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
            "hidden_act": "silu"}


def quantization_config(fmt: str) -> dict | None:
    """`config.json`'s `quantization_config` of format `fmt` (None for float32).

    Raises:
        ValueError: A format not in `FORMATS`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    method, bits, group = FORMATS[fmt]
    if method is None:
        return None
    if method == CT:
        return compressed_tensors_config(fmt, bits, group)
    if method == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [group, group]}
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True,
                "version": "gemm"}
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": True,
            "desc_act": False, "checkpoint_format": "gptq"}


def compressed_tensors_config(fmt: str, bits: int, group: int) -> dict:
    """The `quantization_config` llm-compressor writes for one scheme over every Linear but
    the LM head (its W4A16, W8A8 int8 and FP8_DYNAMIC presets; activations dynamic)."""
    kind = "float" if fmt == "ct-fp8-dynamic" or fmt in FP4_STRATEGIES else "int"
    weights = {"num_bits": bits, "type": kind, "symmetric": True, "dynamic": False,
               "strategy": FP4_STRATEGIES.get(fmt, "group" if group else "channel"),
               "group_size": group or None}
    acts = None if bits == 4 else {"num_bits": 8, "type": kind, "symmetric": True,
                                   "dynamic": True, "strategy": "token"}
    return {"quant_method": CT, "quantization_status": "compressed", "format": CT_FORMATS[fmt],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts}},
            "ignore": ["lm_head"]}


def random_words(rng, shape) -> np.ndarray:
    """int32 words of uniformly random bits (every packed code uniform)."""
    return rng.integers(0, 2 ** 32, shape, dtype=np.uint32).view(np.int32)


def repeated_word(code: int, bits: int, shape) -> np.ndarray:
    """int32 words holding `code` in every `bits`-bit slot."""
    word = 0
    for slot in range(32 // bits):
        word |= code << (bits * slot)
    return np.full(shape, np.uint32(word)).view(np.int32)


def linear_tensors(fmt: str, out: int, inp: int, rng) -> dict[str, np.ndarray]:
    """One Linear's tensors in `fmt` (field suffix -> array; "" is the bare `weight`)."""
    method, bits, group = FORMATS[fmt]
    scales = lambda rows, cols: (0.02 / 8 * (1 + 0.1 * rng.random((rows, cols)))  # noqa: E731
                                 ).astype(np.float16)
    if method is None:
        return {"weight": (0.02 * rng.standard_normal((out, inp), np.float32))}
    if fmt == "ct-w4a16":  # [N, K / 8] along K, stored q + 8; scales [N, G]
        return {"weight_packed": random_words(rng, (out, inp // 8)),
                "weight_shape": np.array([out, inp], np.int64),
                "weight_scale": scales(out, inp // group)}
    if fmt in FP4_STRATEGIES:  # E2M1 codes, two a byte along K: every byte is a code pair
        codes = rng.integers(0, 256, (out, inp // 2), dtype=np.uint8)
        if fmt == "ct-mxfp4":  # E8M0 exponents around 2^-7
            return {"weight_packed": codes,
                    "weight_scale": rng.integers(119, 122, (out, inp // group), dtype=np.uint8)}
        block = (0.02 * (1 + 0.1 * rng.random((out, inp // group)))).astype(np.float32)
        return {"weight_packed": codes,
                "weight_scale": block.astype(ml_dtypes.float8_e4m3fn),
                "weight_global_scale": np.array([1.0], np.float32)}
    if fmt == "ct-w8a8-int8":  # q int8[N, K], per-channel scales [N, 1]
        return {"weight": rng.integers(-128, 128, (out, inp), dtype=np.int8),
                "weight_scale": scales(out, 1)}
    if fmt == "ct-fp8-dynamic":
        codes = rng.standard_normal((out, inp), np.float32).astype(ml_dtypes.float8_e4m3fn)
        return {"weight": codes, "weight_scale": np.full((out, 1), 0.02, np.float32)}
    if method == "fp8":  # codes of N(0, 1) values (every finite e4m3 value near zero occurs)
        codes = rng.standard_normal((out, inp), np.float32).astype(ml_dtypes.float8_e4m3fn)
        blocks = (-(-out // group), -(-inp // group))
        return {"weight": codes, "weight_scale_inv": np.full(blocks, 0.02, np.float32)}
    groups = inp // group
    if method == "awq":  # [K, N / 8] along N; asymmetric random zero points
        return {"qweight": random_words(rng, (inp, out // 8)),
                "qzeros": random_words(rng, (groups, out // 8)),
                "scales": scales(groups, out)}
    # GPTQ packs codes along K; the original format stores zero - 1 (symmetric: 2^(bits-1)).
    return {"qweight": random_words(rng, (inp * bits // 32, out)),
            "qzeros": repeated_word(2 ** (bits - 1) - 1, bits, (groups, out * bits // 32)),
            "scales": scales(groups, out),
            "g_idx": (np.arange(inp) // group).astype(np.int32)}


def write_checkpoint(directory: str, fmt: str, shape: Shape = Shape(), seed: int = 0) -> int:
    """Writes a random Llama of `shape` in `fmt` (a `FORMATS` name) as a Hugging Face directory
    (`config.json`, `model.safetensors`); the embedding, the norms and the LM head stay
    float32, as every one of these formats leaves them.

    Returns:
        The checkpoint's tensor bytes.

    Raises:
        ValueError: An unknown format, or a shape whose widths the group does not divide.
    """
    from safetensors.numpy import save_file

    qc = quantization_config(fmt)
    group = FORMATS[fmt][2] if FORMATS[fmt][0] != "fp8" else 0  # FP8 blocks may be partial
    if group and (shape.hidden % group or shape.intermediate % group):
        raise ValueError(f"hidden {shape.hidden} and intermediate {shape.intermediate} must be "
                         f"multiples of {fmt}'s group size {group}")
    rng = np.random.default_rng(seed)
    normal = lambda *s: 0.02 * rng.standard_normal(s, np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": normal(shape.vocab, shape.hidden),
               "model.norm.weight": np.ones(shape.hidden, np.float32),
               "lm_head.weight": normal(shape.vocab, shape.hidden)}
    for layer in range(shape.layers):
        base = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{base}.{norm}.weight"] = np.ones(shape.hidden, np.float32)
        for name, (out, inp) in shape.linears().items():
            for field, arr in linear_tensors(fmt, out, inp, rng).items():
                tensors[f"{base}.{name}.{field}"] = arr
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(shape)
    if qc is not None:
        config["quantization_config"] = qc
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return sum(a.nbytes for a in tensors.values())
