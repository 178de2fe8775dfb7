"""compressed-tensors checkpoints written by the `compressed-tensors` package's own
compressors (its `calculate_qparams`, each format's `compress`, its `QuantizationConfig`),
and the reference weights from its own `decompress`: the oracle's side of the tests."""

from __future__ import annotations

import os

import numpy as np

from tests.models.helpers import set_quantization_config

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


def compress(w, sch, g_idx=None) -> tuple[dict, np.ndarray]:
    """One Linear's compressed tensors (by the scheme's format's compressor) and the
    weight its decompressor gives back, in float32 (scales widened first: the reference is
    the exact dequantized value, not a bfloat16 rounding of it).

    With `g_idx` i32[K] (pack-quantized groups, actorder "group"), input k is quantized in
    group g_idx[k] as llm-compressor's GPTQ does: the inputs sorted by group (stable) are
    compressed in contiguous groups, then the codes (unpacked and repacked by
    compressed-tensors' own helpers) and the decompressed weight are put back in input
    order beside `weight_g_idx` (the installed compressor no longer writes it itself)."""
    import torch
    from compressed_tensors.compressors.base import BaseCompressor

    if sch.weights.type == "float" and sch.weights.num_bits == 4:  # MXFP4, NVFP4
        from tests.models.fp4_pack import compress_fp4

        return compress_fp4(w, sch)
    if g_idx is not None:
        from compressed_tensors.compressors.pack_quantized.helpers import (
            pack_to_int32,
            unpack_from_int32,
        )

        order = np.argsort(g_idx, kind="stable")  # sorted position j holds input order[j]
        out, back_sorted = compress(np.ascontiguousarray(w[:, order]), sch)
        bits = sch.weights.num_bits
        codes = unpack_from_int32(out["weight_packed"], bits, torch.Size(w.shape))
        unsorted = torch.empty_like(codes)
        unsorted[:, torch.from_numpy(order)] = codes
        back = np.empty_like(back_sorted)
        back[:, order] = back_sorted
        return {**out, "weight_packed": pack_to_int32(unsorted, bits),
                "weight_g_idx": torch.from_numpy(np.asarray(g_idx, np.int32))}, back

    # bfloat16 scales, as llm-compressor writes them for a bfloat16 model.
    wb = torch.from_numpy(w).to(torch.bfloat16)
    s, z = _qparams(wb, sch.weights)
    compressor = BaseCompressor.get_value_from_registry(sch.format)
    out = compressor.compress({"weight": wb, "weight_scale": s, "weight_zero_point": z}, sch)
    wide = {k: (v.float() if v.is_floating_point() and k == "weight_scale" else v)
            for k, v in out.items()}
    back = compressor.decompress(wide, sch)["weight"].float().numpy()
    return {k: v.contiguous() for k, v in out.items()}, back


def write_ct(directory: str, config: dict, sch, group_format: bool = True, act_order=None):
    """A tiny transformers model saved with every decoder Linear (experts too) compressed
    in scheme `sch`, its config.json carrying the QuantizationConfig compressed-tensors
    writes (`ignore` = lm_head and the router); returns (the HF model on the decompressed
    weights, the checkpoint's tensors). `act_order(name)` picks the Linears quantized in
    random act-order groups (`compress`'s g_idx), and the scheme then says
    `actorder: "group"`."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).float().eval()
    tensors, dense = {}, {}

    rng = np.random.default_rng(0)

    def put(base: str, w: np.ndarray) -> np.ndarray:
        g_idx = None
        if act_order is not None and act_order(base):
            group = sch.weights.group_size
            g_idx = rng.permutation(np.arange(w.shape[1]) // group).astype(np.int32)
        out, back = compress(w, sch, g_idx)
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
    quant_config = {"quant_method": "compressed-tensors",
                    **qc.model_dump(mode="json", exclude={"quant_method"})}
    if act_order is not None:  # what older compressed-tensors wrote (now refused by it)
        quant_config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    set_quantization_config(directory, quant_config)
    return hf, tensors
