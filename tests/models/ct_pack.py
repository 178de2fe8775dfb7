"""compressed-tensors checkpoints written by the `compressed-tensors` package's own
compressors (its `calculate_qparams`, each format's `compress`, its `QuantizationConfig`),
and the reference weights from its own `decompress`: the oracle's side of the tests."""

from __future__ import annotations

import json
import os

import numpy as np

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
IGNORE = ["lm_head", "re:.*mlp.gate$"]


def scheme(fmt: str, input_activations: dict | None = None, **weights):
    """A compressed-tensors `QuantizationScheme` targeting every Linear."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    ia = None if input_activations is None else QuantizationArgs(**input_activations)
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights),
                              input_activations=ia, format=fmt)


def _qparams(w, args):
    """compressed-tensors' scale and zero point of `w` [N, K] over the strategy's blocks."""
    import torch
    from compressed_tensors.quantization.utils import calculate_qparams

    n, k = w.shape
    if args.strategy == "group":
        blocks = w.reshape(n, k // args.group_size, args.group_size)
        mn, mx = blocks.amin(-1), blocks.amax(-1)
    elif args.strategy == "channel":
        mn, mx = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk, dtype=w.dtype)
        padded[:n, :k] = w
        blocks = padded.reshape(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
        mn, mx = blocks.amin((1, 3)), blocks.amax((1, 3))
    else:
        mn, mx = w.amin(), w.amax()
    return calculate_qparams(mn, mx, args)


def compress(w, sch) -> tuple[dict, np.ndarray]:
    """One Linear's compressed tensors (by the scheme's format's compressor) and the
    weight its decompressor gives back, in float32 (scales widened first: the reference is
    the exact dequantized value, not a bfloat16 rounding of it)."""
    import torch
    from compressed_tensors.compressors.base import BaseCompressor

    if sch.weights.type == "float" and sch.weights.num_bits == 4:  # MXFP4, NVFP4
        from tests.models.fp4_pack import compress_fp4

        return compress_fp4(w, sch)
    # bfloat16 scales, as llm-compressor writes them for a bfloat16 model.
    wb = torch.from_numpy(w).to(torch.bfloat16)
    s, z = _qparams(wb, sch.weights)
    compressor = BaseCompressor.get_value_from_registry(sch.format)
    out = compressor.compress({"weight": wb, "weight_scale": s, "weight_zero_point": z}, sch)
    wide = {k: (v.float() if v.is_floating_point() and k == "weight_scale" else v)
            for k, v in out.items()}
    back = compressor.decompress(wide, sch)["weight"].float().numpy()
    return {k: v.contiguous() for k, v in out.items()}, back


def write_ct(directory: str, config: dict, sch, group_format: bool = True):
    """A tiny transformers model saved with every decoder Linear (experts too) compressed
    in scheme `sch`, its config.json carrying the QuantizationConfig compressed-tensors
    writes (`ignore` = lm_head and the router); returns (the HF model on the decompressed
    weights, the checkpoint's tensors)."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).float().eval()
    tensors, dense = {}, {}

    def put(base: str, w: np.ndarray) -> np.ndarray:
        out, back = compress(w, sch)
        tensors.update({f"{base}.{k}": v for k, v in out.items()})
        return back

    for name, p in hf.state_dict().items():
        w = p.detach().numpy().astype(np.float32)
        parts = name.rsplit(".", 2)
        if name.endswith(".weight") and parts[-2] in LINEARS and w.ndim == 2:
            dense[name] = put(name[:-7], w)
        elif name.endswith("experts.gate_up_proj"):  # transformers' fused [E, 2I, H]
            half = w.shape[1] // 2
            dense[name] = np.stack([np.concatenate(
                [put(f"{name[:-12]}{e}.{proj}", part)
                 for proj, part in (("gate_proj", we[:half]), ("up_proj", we[half:]))])
                for e, we in enumerate(w)])
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            dense[name] = np.stack([put(f"{name[:-9]}{e}.down_proj", we)
                                    for e, we in enumerate(w)])
        else:
            dense[name] = w
            tensors[name] = torch.from_numpy(w.copy())
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in dense.items()})
    hf.save_pretrained(directory, safe_serialization=True)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    qc = QuantizationConfig(config_groups={"group_0": sch}, ignore=IGNORE,
                            format=sch.format if group_format else None,
                            quantization_status="compressed")
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "compressed-tensors",
                                  **qc.model_dump(mode="json", exclude={"quant_method"})}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    return hf, tensors
