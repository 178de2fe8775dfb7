"""Architecture config of a decoder-only model, parsed from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# HF activation names the gated MLP computes ("gelu_pytorch_tanh": GELU, tanh approximation).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (HF `rope_scaling` / `rope_parameters`).

    Attributes:
        rope_type: "default" (none), "linear" or "llama3".
        factor: Scaling factor (linear and llama3).
        low_freq_factor: Llama 3 low-frequency factor.
        high_freq_factor: Llama 3 high-frequency factor.
        original_max_position_embeddings: Llama 3 original context length.
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ArchConfig:
    """Everything the Flax decoder needs to know about a model's shape and numerics.

    Attributes:
        architecture: HF architecture name, e.g. "LlamaForCausalLM".
        vocab_size: Number of token ids.
        hidden_size: Residual stream width.
        intermediate_size: MLP hidden width.
        num_layers: Number of decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (GQA when fewer than `num_heads`).
        head_dim: Width of one head.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: Rotary base.
        rope_scaling: Rotary frequency scaling.
        max_position_embeddings: Longest context the model was trained for.
        tie_word_embeddings: Whether the LM head reuses the embedding matrix.
        qkv_bias: Whether q/k/v projections have a bias (Qwen2).
        o_bias: Whether the output projection has a bias.
        mlp_bias: Whether the MLP projections have biases.
        qk_norm: Whether q and k get a per-head RMSNorm before rotary (Qwen3).
        layer_windows: Per-layer sliding window (0 = full attention); a query at position p
            sees keys at positions p - window + 1 .. p.
        bos_token_id: Beginning-of-sequence id, if any.
        eos_token_ids: End-of-sequence ids.
        hidden_act: The gated MLP's activation, one of `SUPPORTED_ACTIVATIONS`.
        norm_offset: RMSNorm multiplies by `norm_offset + weight` (1.0: Gemma's
            `(1 + weight)`, weights initialised at zero).
        embed_scale: Whether token embeddings are multiplied by `sqrt(hidden_size)` (Gemma).
        sandwich_norms: Whether attention and MLP outputs get their own norms before the
            residual add, and the MLP a pre-norm of its own (Gemma 2/3:
            `post_attention_layernorm`, `pre_feedforward_layernorm`,
            `post_feedforward_layernorm`).
        query_pre_attn_scalar: Attention logits are scaled by its inverse square root
            (None: by `head_dim ** -0.5`).
        attn_logit_softcap: Attention logits become `cap * tanh(logits / cap)` (Gemma 2).
        final_logit_softcap: The LM head's logits are soft-capped the same way.
        local_rope_theta: Rotary base of the sliding-window layers (Gemma 3); None: every
            layer uses `rope_theta`.
        local_rope_scaling: Frequency scaling of the sliding-window layers' rotary.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    layer_windows: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"
    norm_offset: float = 0.0
    embed_scale: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling = field(default_factory=RopeScaling)

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries for "
                f"{self.num_layers} layers"
            )
        for scaling in (self.rope_scaling, self.local_rope_scaling):
            if scaling.rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope type {scaling.rope_type!r}; supported: "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}"
                )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)}")
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive (or None), got {value}")

    def to_json(self) -> str:
        """Serialises the config (inverse of `from_json`)."""
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ArchConfig:
        """Parses what `to_json` wrote."""
        d = json.loads(text)
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        if "local_rope_scaling" in d:
            d["local_rope_scaling"] = RopeScaling(**d["local_rope_scaling"])
        d["layer_windows"] = tuple(d["layer_windows"])
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return cls(**d)


def parse_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Reads rotary settings from either transformers 5 (`rope_parameters`) or 4 style."""
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = dict(hf.get("rope_scaling") or {})
    scaling.update(params)
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, RopeScaling()
    kwargs = {
        k: scaling[k]
        for k in ("factor", "low_freq_factor", "high_freq_factor",
                  "original_max_position_embeddings")
        if scaling.get(k) is not None
    }
    return theta, RopeScaling(rope_type=rope_type, **kwargs)


def _eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def common_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The config fields every supported family spells the same way."""
    act_field = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
    act = hf.get(act_field) or "silu"
    if act not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"unsupported {act_field} {act!r}; supported: "
                         f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    num_heads = int(hf["num_attention_heads"])
    theta, scaling = parse_rope(hf)
    return dict(
        architecture=hf["architectures"][0],
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // num_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf),
        hidden_act=act,
    )


def windows_from_layer_types(hf: dict[str, Any]) -> tuple[int, ...]:
    """Per-layer windows from HF `layer_types` ("sliding_attention" gets `sliding_window`).

    Raises:
        ValueError: An entry that is not one of `LAYER_TYPES`.
    """
    for t in hf["layer_types"]:
        if t not in LAYER_TYPES:
            raise ValueError(f"unsupported layer_types entry {t!r}; supported: "
                             f"{', '.join(LAYER_TYPES)}")
    window = int(hf.get("sliding_window") or 0)
    return tuple(window if t == "sliding_attention" else 0 for t in hf["layer_types"])
