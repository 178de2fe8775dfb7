"""Test-side writers of GPTQ and AWQ checkpoints, from each format's published definition
(written independently of `models.loaders.quant_formats`): a group quantizer, the packers,
and a tiny transformers model saved with its Linear weights replaced by the packed tensors.
"""

from __future__ import annotations

import os

import numpy as np

from tests.models.helpers import set_quantization_config

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of a word holds value AWQ_ORDER[i]


def act_order_g_idx(k: int, group: int, rng) -> np.ndarray:
    """i32[K]: a random act-order assignment of K inputs to groups of `group` (GPTQ's
    desc_act: the inputs visited by decreasing activation, each run of `group` of them one
    group), so input k's group g_idx[k] follows no order."""
    return rng.permutation(np.arange(k) // group).astype(np.int32)


def quantize_groups(w: np.ndarray, bits: int, group: int, sym: bool, rng, min_zero: int = 0,
                    g_idx: np.ndarray | None = None):
    """Round-to-nearest group quantization of f32[N, K] (w ~ (q - z) * s per group of K;
    z >= `min_zero`: the original GPTQ format stores z - 1 in `bits` bits, so z = 0 wraps).
    With `g_idx` (act-order), group g is the inputs k with g_idx[k] = g, wherever they are:
    w[:, k] ~ (q[:, k] - z[:, g_idx[k]]) * s[:, g_idx[k]].

    Returns:
        (q i64[N, K] in [0, 2^bits), z i64[N, G], s f16[N, G], the dequantized f32[N, K]).
    """
    n, k = w.shape
    g = k if group == -1 else group
    if g_idx is not None:  # each group's members, group by group (in input order within)
        members = np.stack([np.flatnonzero(g_idx == j) for j in range(k // g)])  # [G, g]
        wb = w[:, members]  # [N, G, g]
    else:
        wb = w.reshape(n, k // g, g)
    top = 2 ** bits - 1
    if sym:
        s = (np.abs(wb).max(-1) / (2 ** (bits - 1) - 0.5)).astype(np.float16)
        z = np.full(s.shape, 2 ** (bits - 1), np.int64)
    else:
        lo, hi = wb.min(-1), wb.max(-1)
        s = ((hi - lo) / top).astype(np.float16)
        z = np.clip(np.rint(-lo / s.astype(np.float32)), min_zero, top).astype(np.int64)
        # Some zero points off-centre, so a wrong zero shows.
        z = np.where(rng.random(z.shape) < 0.1, rng.integers(min_zero, top + 1, z.shape), z)
    s32 = s.astype(np.float32)[..., None]
    q = np.clip(np.rint(wb / s32) + z[..., None], 0, top).astype(np.int64)  # [N, G, g]
    if g_idx is None:
        return q.reshape(n, k), z, s, ((q - z[..., None]).astype(np.float32) * s32).reshape(n, k)
    q_in = np.empty((n, k), np.int64)
    q_in[:, members] = q  # back to input order
    # The published dequantization, input by input: its group's zero point and scale.
    deq = (q_in - z[:, g_idx]).astype(np.float32) * s.astype(np.float32)[:, g_idx]
    return q_in, z, s, deq


def pack_along(values: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """int32 words of 32 / bits values along `axis`; bit slot i of a word holds value i of
    its run, or value order[i]."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint64), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    word = np.zeros(v.shape[:-1], np.uint64)
    for slot in range(per):
        value = slot if order is None else order[slot]
        word |= v[..., value] << np.uint64(bits * slot)
    return np.ascontiguousarray(np.moveaxis(word.astype(np.uint32).view(np.int32), -1, axis))


def gptq_tensors(q, z, s, bits: int, v1: bool, g_idx=None) -> dict[str, np.ndarray]:
    """GPTQ's tensors of one Linear: qweight packed along K ([K * bits / 32, N]), qzeros
    along N (z - 1 in the original format), scales [G, N], g_idx [K] (each input's group:
    k // group_size, or act-order's)."""
    n, k = q.shape
    groups = s.shape[1]
    if g_idx is None:
        g_idx = np.arange(k) // (k // groups)
    return {"qweight": pack_along(q.T, bits, 0),
            "qzeros": pack_along((z - (1 if v1 else 0)).T & (2 ** bits - 1), bits, 1),
            "scales": np.ascontiguousarray(s.T),
            "g_idx": np.asarray(g_idx, np.int32)}


def awq_tensors(q, z, s) -> dict[str, np.ndarray]:
    """AWQ GEMM's tensors of one Linear: qweight [K, N / 8] and qzeros [G, N / 8], both
    packed along N in AWQ's interleaved order, and scales [G, N]."""
    return {"qweight": pack_along(q.T, 4, 1, AWQ_ORDER),
            "qzeros": pack_along(z.T, 4, 1, AWQ_ORDER),
            "scales": np.ascontiguousarray(s.T)}


def write_quantized(directory: str, config: dict, quant_config: dict, pack, bits: int,
                    group: int, sym: bool, min_zero: int = 0, act_order=None):
    """A tiny transformers model saved with every decoder Linear (experts too) replaced by
    `pack(q, z, s)`'s tensors (`pack(q, z, s, g_idx)` for the Linears `act_order(name)`
    picks: quantized in random act-order groups, `act_order_g_idx`); returns (the HF model
    holding the dequantized weights, its dense tensors as a state dict)."""
    import torch
    from safetensors.numpy import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).float().eval()
    rng = np.random.default_rng(0)
    tensors, dense = {}, {}
    def quantize(base: str, w: np.ndarray) -> np.ndarray:  # one Linear [N, K]
        g_idx = (act_order_g_idx(w.shape[1], group, rng)
                 if act_order is not None and act_order(base) else None)
        q, z, s, deq = quantize_groups(w, bits, group, sym, rng, min_zero, g_idx)
        packed = pack(q, z, s) if g_idx is None else pack(q, z, s, g_idx)
        for field, arr in packed.items():
            tensors[f"{base}.{field}"] = arr
        return deq

    for name, p in hf.state_dict().items():
        w = p.detach().numpy().astype(np.float32)
        parts = name.rsplit(".", 2)
        if name.endswith(".weight") and parts[-2] in LINEARS and w.ndim == 2:
            dense[name] = quantize(name[:-7], w)
        elif name.endswith("experts.gate_up_proj"):  # transformers' fused [E, 2I, H]
            half = w.shape[1] // 2  # a checkpoint stores experts.{e}.gate_proj / up_proj
            dense[name] = np.stack([np.concatenate(
                [quantize(f"{name[:-12]}{e}.{proj}", part)
                 for proj, part in (("gate_proj", we[:half]), ("up_proj", we[half:]))])
                for e, we in enumerate(w)])
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            dense[name] = np.stack([quantize(f"{name[:-9]}{e}.down_proj", we)
                                    for e, we in enumerate(w)])
        else:
            tensors[name] = dense[name] = np.ascontiguousarray(w)
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in dense.items()})
    hf.save_pretrained(directory, safe_serialization=True)
    os.remove(os.path.join(directory, "model.safetensors"))
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    set_quantization_config(directory, quant_config)
    return hf, dense


def write_gptq_act_order(directory, config: dict, act_order, bits: int = 4, group: int = 32,
                         sym: bool = True, v1: bool = True):
    """A GPTQ checkpoint (`desc_act: true`) whose Linears `act_order(name)` picks are
    quantized in random act-order groups (the others' g_idx in order); returns
    `write_quantized`'s (HF model on the dequantized weights, dense tensors)."""
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym,
          "desc_act": True, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    return write_quantized(str(directory), config, qc,
                           lambda q, z, s, g_idx=None: gptq_tensors(q, z, s, bits, v1, g_idx),
                           bits, group, sym, min_zero=1 if v1 else 0, act_order=act_order)
