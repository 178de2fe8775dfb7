"""The Llama 4 text family (`Llama4ForCausalLM`, and the language model of a
`Llama4ForConditionalGeneration` checkpoint): how its HF config maps onto `ArchConfig`."""

from __future__ import annotations

import logging

from models.family_base import ModelFamily, text_config
from models.moe_config import sparse_fields

logger = logging.getLogger(__name__)

# transformers' `Llama4TextConfig` defaults where a config leaves a field out.
DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "intermediate_size_mlp": 16384,
            "num_experts_per_tok": 1, "num_local_experts": 16, "interleave_moe_layer_step": 1,
            "use_qk_norm": True, "no_rope_layer_interval": 4, "attention_chunk_size": 8192,
            "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
            "attention_bias": False, "hidden_act": "silu"}
LAYER_TYPES = ("full_attention", "chunked_attention")


def _layer_list(hf, name: str, n: int) -> list[int]:
    value = list(hf[name])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name}={value} must list integers")
    return value


class Llama4(ModelFamily):
    """Llama 4 (Scout, Maverick), text: chunked local attention (`attention_chunk_size`) on
    the rotary layers, NoPE global layers (`no_rope_layers` 0) with attention temperature
    tuning, a weightless L2 (RMS) norm on the rotary layers' q and k after the rotary
    (`use_qk_norm`), the rotary on interleaved channel pairs with llama3 scaling, and MoE
    layers (`moe_layers` or every `interleave_moe_layer_step`-th) of top-k sigmoid routing
    that scales each expert's input, plus an ungated shared expert; the other layers a dense
    MLP of `intermediate_size_mlp`. Experts are stacked in the checkpoint
    (`models.loaders.llama4_names`)."""

    architectures = ("Llama4ForCausalLM", "Llama4ForConditionalGeneration")

    @classmethod
    def arch_config(cls, hf):
        hf = text_config(hf)
        # NOTE: a null `attention_chunk_size` is no chunking (transformers' None), not a default.
        hf = {**DEFAULTS, **{k: v for k, v in hf.items()
                             if v is not None or k == "attention_chunk_size"}}
        if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
            hf["rope_parameters"] = {"rope_type": "default", "rope_theta": hf["rope_theta"]}
        return super().arch_config(hf)

    @classmethod
    def _layers(cls, hf) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(layer_windows, nope_layers) as transformers' `Llama4TextConfig` derives them."""
        n = int(hf["num_hidden_layers"])
        interval = hf["no_rope_layer_interval"]
        if hf.get("no_rope_layers"):
            rope = _layer_list(hf, "no_rope_layers", n)
            if len(rope) < n or not set(rope) <= {0, 1}:
                raise ValueError(f"no_rope_layers={rope} must hold a 0 or 1 for each of the "
                                 f"{n} layers")
        else:
            if not isinstance(interval, int) or interval < 1:
                raise ValueError(f"no_rope_layer_interval={interval!r} must be an integer >= 1")
            rope = [int((i + 1) % interval != 0) for i in range(n)]
        chunk = hf.get("attention_chunk_size")
        types = hf.get("layer_types") or [
            "chunked_attention" if r and chunk is not None else "full_attention"
            for r in rope[:n]]
        if len(types) != n or not set(types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types={types} must name one of {', '.join(LAYER_TYPES)} "
                             f"for each of the {n} layers")
        if "chunked_attention" in types and not (isinstance(chunk, int) and chunk > 0):
            raise ValueError(f"attention_chunk_size={chunk!r}: chunked_attention layers need "
                             "a positive chunk")
        windows = tuple(-chunk if t == "chunked_attention" else 0 for t in types)
        return windows, tuple(i for i in range(n) if not rope[i])

    @classmethod
    def _moe(cls, hf) -> dict:
        """The expert fields: `moe_layers` (or every `interleave_moe_layer_step`-th layer)
        sparse, the others dense MLPs of `intermediate_size_mlp`."""
        n = int(hf["num_hidden_layers"])
        if hf.get("moe_layers") is not None:
            moe = _layer_list(hf, "moe_layers", n)
            if not all(0 <= i < n for i in moe):
                raise ValueError(f"moe_layers={moe} must be layer indices in 0..{n - 1}")
        else:
            step = hf["interleave_moe_layer_step"]
            if not isinstance(step, int) or isinstance(step, bool) or step < 1:
                raise ValueError(f"interleave_moe_layer_step={step!r} must be an integer >= 1")
            moe = list(range(step - 1, n, step))
        dense = dict(intermediate_size=int(hf["intermediate_size_mlp"]))
        if not moe:
            return dense
        width = int(hf["intermediate_size"])
        return dict(dense, router_order="topk_sigmoid", shared_expert_intermediate_size=width,
                    shared_expert_gated=False,
                    dense_layers=tuple(i for i in range(n) if i not in set(moe)),
                    **sparse_fields(hf, "num_local_experts", "intermediate_size"))

    @classmethod
    def extra_fields(cls, hf):
        if hf.get("router_jitter_noise"):
            logger.info("%s: router_jitter_noise is ignored (training only)",
                        hf["architectures"][0])
        for name in ("floor_scale", "attn_scale"):
            if not isinstance(hf[name], (int, float)) or not hf[name] > 0:
                raise ValueError(f"{name}={hf[name]!r} must be a positive number")
        windows, nope = cls._layers(hf)
        bias = bool(hf["attention_bias"])
        return dict(qkv_bias=bias, o_bias=bias, layer_windows=windows, nope_layers=nope,
                    rope_interleave=True, qk_l2_norm=bool(hf["use_qk_norm"]),
                    attn_temperature_tuning=bool(hf["attn_temperature_tuning"]),
                    floor_scale=float(hf["floor_scale"]), attn_scale=float(hf["attn_scale"]),
                    **cls._moe(hf))
