"""Mixture-of-experts GGUF files: Mixtral (llama.cpp writes it as arch `llama` with
`expert_count`), `qwen2moe` and `qwen3moe`: their metadata as the Hugging Face config's
expert fields, and the stacked expert tensors served one expert at a time under the
Hugging Face names.

llama.cpp stores a layer's experts stacked, `blk.N.ffn_{gate,up,down}_exps.weight` with
numpy shape [E, out, in] (each expert a Linear weight, quantized along `in`), the router
as `ffn_gate_inp`, and Qwen2-MoE's shared expert as `ffn_{gate,up,down}_shexp` with its gate
`ffn_gate_inp_shexp`. What llama.cpp's graphs do that the file does not say: Qwen3-MoE
renormalizes the top-k weights and Qwen2-MoE does not (`expert_weights_norm`, written by
newer converters, wins), Mixtral takes a softmax over its top-k logits (the same weights);
every router is a softmax (`expert_gating_func`, when present, must say so).
"""

from __future__ import annotations

import re
from collections.abc import Callable

MOE_ARCHS = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}

# Per-layer GGUF tensor names of the sparse MLP -> the decoder's HF names (the experts'
# stacks named without an expert index: `expert_of` serves one expert of them).
MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# Older llama.cpp files kept one tensor per expert (`blk.N.ffn_gate.E.weight`).
PER_EXPERT_GGUF = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight")
_MIXTRAL = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(\w+)(\.weight)")
_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def canonical_name(name: str) -> str:
    """An HF tensor name with Mixtral's spelling (`block_sparse_moe`, experts' w1/w2/w3)
    replaced by the generic one (`mlp`, gate/down/up_proj)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    m = re.fullmatch(r"(.*\.experts\.\d+\.)(w[123])(\.weight)", name)
    return f"{m[1]}{_MIXTRAL[m[2]]}{m[3]}" if m else name


def expert_of(name: str) -> tuple[str, int] | None:
    """(the stacked tensor's HF name, the expert's index) for one expert's HF name
    (`model.layers.N.mlp.experts.E.gate_proj.weight`, or Mixtral's), else None."""
    m = _EXPERT.fullmatch(canonical_name(name))
    return (f"{m[1]}{m[3]}{m[4]}", int(m[2])) if m else None


def moe_fields(arch: str, key: Callable, where: str, ffn: int,
               rows_of: Callable[[str], int | None]) -> dict:
    """The Hugging Face config keys of a mixture-of-experts GGUF ({} for a dense file).

    Args:
        arch: The GGUF architecture ("llama" with experts is Mixtral).
        key: `key(name, default=None)` reads the metadata field `{arch}.{name}`.
        where: The file, for error messages.
        ffn: `feed_forward_length` (Mixtral's expert width).
        rows_of: Output rows of an HF-named tensor of layer 0 (None when absent): the
            widths older files leave out of the metadata.

    Raises:
        ValueError: A MoE architecture without experts, a missing field, or a router
            this loader cannot honour (named).
    """
    def fail(field: str, why: str):
        raise ValueError(f"{where}: {arch}.{field} {why}")

    count = key("expert_count")
    if not count:
        if arch in MOE_ARCHS:
            fail("expert_count", "is missing or 0 (a mixture of experts needs experts)")
        return {}
    used = key("expert_used_count")
    if not used:
        fail("expert_used_count", "is missing or 0")
    gating = key("expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX_GATING:
        fail("expert_gating_func", f"({gating}) is not supported: only a softmax router "
             f"({_SOFTMAX_GATING})")
    scale = key("expert_weights_scale")
    if scale is not None and float(scale) != 1.0:
        fail("expert_weights_scale", f"({scale}) is not supported: the routing weights are "
             "not scaled")
    count, used = int(count), int(used)

    def width(field: str, tensor: str) -> int:
        value = key(field) or rows_of(tensor)
        if not value:
            fail(field, f"is missing (and no {tensor} gives it)")
        return int(value)

    if arch == "llama":  # Mixtral: one expert's width is its intermediate_size
        return {"architectures": ["MixtralForCausalLM"], "num_local_experts": count,
                "num_experts_per_tok": used,
                "intermediate_size": int(key("expert_feed_forward_length") or ffn)}
    out = {"num_experts": count, "num_experts_per_tok": used,
           "moe_intermediate_size": width("expert_feed_forward_length",
                                          "model.layers.0.mlp.experts.gate_proj.weight"),
           "norm_topk_prob": bool(key("expert_weights_norm", arch == "qwen3moe"))}
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = width(
            "expert_shared_feed_forward_length",
            "model.layers.0.mlp.shared_expert.gate_proj.weight")
    return out
