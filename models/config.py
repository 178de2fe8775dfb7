"""Architecture config of a decoder-only model, parsed from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from models.config_checks import check_linear, check_moe
from models.deepseek_config import check_mla
from models.gemma4_config import check_gemma4
from models.llama4_config import check_llama4
from models.rope import RopeScaling, check_rope_scaling

# HF activation names the gated MLP computes ("gelu_pytorch_tanh": GELU, tanh approximation).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
# The layer kinds of a linear-attention hybrid's `layer_types` (Qwen3-Next, Qwen3.5).
HYBRID_LAYER_TYPES = ("full_attention", "linear_attention")
# Every decoder layer's dense linear modules, as (block, module).
LAYER_MATMULS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                 ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
                 ("mlp", "down_proj"))


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
            sees keys at positions p - window + 1 .. p. A negative entry -C is chunked local
            attention (Llama 4's `attention_chunk_size` C): keys floor(p / C) * C .. p.
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
        partial_rotary_factor: The fraction of each head the rotary turns (its first
            `rotary_dim` channels; the rest pass unrotated: Phi-3.5/4-mini).
        qk_norm_full: With `qk_norm`, q and k are normed over their whole projection
            (`num_heads * head_dim`, OLMoE) instead of per head.
        num_experts: Routed experts of each sparse layer's MLP (0: a dense `GatedMLP`
            in every layer; else a `models.moe.MoEMLP` in every layer not in
            `dense_layers`).
        num_experts_per_tok: Experts each token is routed to (top-k).
        moe_intermediate_size: Hidden width of one routed expert.
        shared_expert_intermediate_size: Width of the shared expert every token also
            runs, gated by a sigmoid (Qwen2-MoE); 0: none.
        shared_expert_gated: Whether the shared expert's output is scaled by
            `sigmoid(shared_expert_gate(x))` (Qwen2-MoE, Qwen3-Next); False: added as it is
            (Granite 4.0's `shared_mlp`).
        norm_topk_prob: Whether the top-k probabilities are divided by their sum
            (`router_order` "softmax_topk").
        router_order: One of `ROUTER_ORDERS`.
        dense_layers: The layers of a mixture of experts whose MLP is a dense `GatedMLP`
            of `intermediate_size` (Qwen-MoE's `mlp_only_layers` and
            `decoder_sparse_step`; `models.mixed`); () when every layer is sparse.
        linear_layers: The layers whose token mixer is linear (`linear_kind`: a Gated DeltaNet
            or Mamba-2, with a recurrent state per request); the others are
            full attention (`models.hybrid`). (): every layer attends.
        linear_num_key_heads: Query/key heads of a Gated DeltaNet layer.
        linear_num_value_heads: Value heads (a multiple of the key heads: each key head
            serves that many consecutive value heads).
        linear_key_head_dim: Width of one query/key head.
        linear_value_head_dim: Width of one value head.
        linear_conv_kernel_dim: Taps of the causal depthwise convolution over q, k and v.
        linear_kind: One of `LINEAR_KINDS`: the linear layers' mixer. For "mamba2" the
            key heads are the B/C groups, their width the state size, the value heads and
            their width Mamba's heads and head channels (`models.mamba2`).
        linear_conv_bias: The linear layers' convolution has a bias (Mamba-2).
        linear_proj_bias: Their in and out projections have biases (Mamba-2).
        embedding_multiplier: Token embeddings are multiplied by it (Granite).
        residual_multiplier: Each block's output is multiplied by it before its residual
            add (Granite).
        logits_scaling: The LM head's logits are divided by it (Granite).
        attention_multiplier: The attention softmax scale itself (Granite); None: from
            `query_pre_attn_scalar` or `head_dim`.
        use_rope: Whether attention rotates q and k (False: no position embedding, Granite
            4.0-H's "nope").
        attn_output_gate: The full-attention layers' `q_proj` also gives a gate per head
            (its rows: each head's query then its gate) that scales the attention output
            by its sigmoid before `o_proj` (Qwen3-Next).
        kv_lora_rank: Multi-head latent attention (`models.mla`, DeepSeek) when positive:
            the width R of the compressed KV each token keeps in the page pool (with its
            roped key part, `head_dim` wide: `qk_rope_head_dim`). 0: GQA attention.
        q_lora_rank: MLA's query low-rank width (`q_a_proj`, `q_a_layernorm`, `q_b_proj`);
            0: one `q_proj`.
        qk_nope_head_dim: MLA: the unroped part of each query/key head.
        v_head_dim: MLA: each value head's width.
        mla_form: How MLA attends (`models.mla`), one of `models.deepseek_config.MLA_FORMS`:
            "absorbed" (queries into the latent space, attention over the latents),
            "expanded" (per-head keys and values rebuilt from the latents),
            "prefill_expanded" (expanded for requests of several new tokens, absorbed for
            decode rows). A serving choice: the same weights, pool and results.
        rope_interleave: The rotary turns interleaved channel pairs (DeepSeek) rather than
            the two halves of the rotated channels.
        n_group: Expert groups of the router (DeepSeek); top-k picks experts of the
            `topk_group` best groups only (1: no groups).
        topk_group: Groups each token's experts come from.
        routed_scaling_factor: The routing weights are multiplied by it (DeepSeek).
        moe_bias: The router and the routed experts' gate, up and down projections have
            biases (gpt-oss).
        swiglu_limit: Set: the routed experts' activation is gpt-oss's clamped SwiGLU
            (`models.moe_act.ClampedSwiGLU`: gate clamped above at it, up to +-it), not
            `hidden_act`. None: `hidden_act`.
        swiglu_alpha: The clamped SwiGLU's sigmoid gain.
        attention_sinks: Every attention layer has a learned logit per query head
            (`sinks` f32[num_heads]) in its softmax's denominator (gpt-oss).
        per_layer_input_size: Gemma 4's per-layer input embeddings (`models.gemma4`): each
            layer's small input per token (0: none); `per_layer_vocab_size` rows.
        per_layer_vocab_size: Rows of the per-layer embedding table.
        kv_shared_layers: The last this many layers compute no K/V: each reads the pool slot
            of the last earlier layer of its kind (Gemma 4's `num_kv_shared_layers`).
        attention_k_eq_v: The full-attention layers' values are their keys' projection
            (before the key norm and rotary; Gemma 4).
        v_norm: Values get an RMSNorm without a scale (Gemma 4).
        layer_scalar: Each layer's output is multiplied by its own learned scalar (Gemma 4).
        double_wide_mlp: The KV-shared layers' MLPs are twice `intermediate_size / 2`; the
            others are stored zero-padded to that width (Gemma 4's `use_double_wide_mlp`).
        global_head_dim: The full-attention layers' head width when it is not `head_dim`
            (0: the same); their weights are a stack of their own (`models.gemma4_heads`).
        global_kv_heads: The full-attention layers' KV heads when not `num_kv_heads` (0).
        mrope_section: Qwen2-VL's multimodal rotary: frequency bands turned by the temporal,
            height and width position rows (`models.mrope`); () for plain rotary.
        nope_layers: Layers whose attention has no rotary (Llama 4's NoPE layers, where
            `no_rope_layers` is 0); the others rotate as `use_rope` says.
        qk_l2_norm: q and k of the rotary layers get a weightless RMS norm after the
            rotary (Llama 4's `use_qk_norm`).
        attn_temperature_tuning: The queries of `nope_layers` are scaled per token by
            `log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1` (Llama 4).
        floor_scale: See `attn_temperature_tuning`.
        attn_scale: See `attn_temperature_tuning`.
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
    partial_rotary_factor: float = 1.0
    qk_norm_full: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True
    norm_topk_prob: bool = False
    router_order: str = "softmax_topk"
    dense_layers: tuple[int, ...] = ()
    linear_layers: tuple[int, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    attn_output_gate: bool = False
    linear_kind: str = "gated_deltanet"
    linear_conv_bias: bool = False
    linear_proj_bias: bool = False
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    use_rope: bool = True
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    mla_form: str = "absorbed"
    rope_interleave: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    kv_shared_layers: int = 0
    attention_k_eq_v: bool = False
    v_norm: bool = False
    layer_scalar: bool = False
    double_wide_mlp: bool = False
    global_head_dim: int = 0
    global_kv_heads: int = 0
    mrope_section: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()
    qk_l2_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1

    @property
    def is_mla(self) -> bool:
        """Whether attention is multi-head latent attention (one latent per token in the
        page pool, `models.mla`)."""
        return self.kv_lora_rank > 0

    @property
    def latent_dim(self) -> int:
        """Values one token keeps per MLA layer: c_kv (`kv_lora_rank`) then k_pe."""
        return self.kv_lora_rank + self.head_dim

    @property
    def is_moe(self) -> bool:
        """Whether the layers' MLPs are mixtures of experts (all, or all but
        `dense_layers`)."""
        return self.num_experts > 0

    @property
    def is_mixed(self) -> bool:
        """Whether the layers mix sparse and dense MLPs (`dense_layers`)."""
        return bool(self.dense_layers)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts (none for a dense model)."""
        if not self.is_moe:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def has_linear_attention(self) -> bool:
        """Whether some layers are linear (Gated DeltaNet or Mamba-2: a recurrent state per
        request)."""
        return bool(self.linear_layers)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The full-attention layers (every layer without `linear_layers`) that keep KV
        pages of their own (not Gemma 4's last `kv_shared_layers`)."""
        last = self.num_layers - self.kv_shared_layers
        return tuple(i for i in range(last) if i not in self.linear_layers)

    @property
    def has_global_heads(self) -> bool:
        """Whether the full-attention layers have another head shape than the others."""
        return bool(self.global_head_dim or self.global_kv_heads)

    @property
    def kv_pool_heads(self) -> tuple[int, int]:
        """(KV heads, head width) of the page pool: every layer's, or with global heads the
        least that holds both kinds (`models.gemma4_heads.pool_heads`)."""
        if not self.has_global_heads:
            return self.num_kv_heads, self.head_dim
        return (math.lcm(self.num_kv_heads, self.global_kv_heads or self.num_kv_heads),
                max(self.head_dim, self.global_head_dim or self.head_dim))

    @property
    def attention_windows(self) -> tuple[int, ...]:
        """`layer_windows` of the layers that keep KV pages (`attention_layers`): what the
        KV cache groups are made of (`models.kv_groups.kv_group_layout`)."""
        return tuple(self.layer_windows[i] for i in self.attention_layers)

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a linear layer's convolution: q, k and v side by side (Mamba-2: x, B
        and C)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def rotary_dim(self) -> int:
        """Channels of each head the rotary turns (transformers' `int(head_dim * factor)`)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def for_max_model_len(self, max_model_len: int) -> ArchConfig:
        """This config serving contexts of up to `max_model_len` tokens: LongRoPE's factor
        set is the long one exactly when `max_model_len` exceeds the original context
        (`RopeScaling.use_long_factors`, as vLLM); other fields unchanged."""
        def fix(s: RopeScaling) -> RopeScaling:
            if s.rope_type != "longrope":
                return s
            return dataclasses.replace(
                s, use_long_factors=max_model_len > s.original_max_position_embeddings)

        return dataclasses.replace(self, rope_scaling=fix(self.rope_scaling),
                                   local_rope_scaling=fix(self.local_rope_scaling))

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        # A list (JSON) becomes a tuple: the config is hashed as a static Flax attribute.
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
        object.__setattr__(self, "linear_layers", tuple(int(i) for i in self.linear_layers))
        object.__setattr__(self, "nope_layers", tuple(int(i) for i in self.nope_layers))
        object.__setattr__(self, "mrope_section", tuple(int(i) for i in self.mrope_section))
        if self.mrope_section and sum(self.mrope_section) * 2 != self.rotary_dim:
            raise ValueError(f"mrope_section {list(self.mrope_section)} must sum to half the "
                             f"rotary dimension {self.rotary_dim}")
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(
                f"layer_windows has {len(self.layer_windows)} entries for "
                f"{self.num_layers} layers"
            )
        if not (0 < self.partial_rotary_factor <= 1) or self.rotary_dim % 2 or not self.rotary_dim:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives a rotary "
                             f"dimension of {self.rotary_dim} for head_dim {self.head_dim}; it "
                             "must be a positive even number of channels")
        for name in ("rope_scaling", "local_rope_scaling"):
            check_rope_scaling(name, getattr(self, name), self.rotary_dim)
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)}")
        check_moe(self)
        check_linear(self)
        check_mla(self)
        check_gemma4(self)
        check_llama4(self)
        for name in ("attn_logit_softcap", "final_logit_softcap", "query_pre_attn_scalar",
                     "attention_multiplier", "logits_scaling"):
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
        d["nope_layers"] = tuple(d.get("nope_layers", ()))
        d["mrope_section"] = tuple(d.get("mrope_section", ()))
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return cls(**d)


def layer_matmul_shapes(cfg: ArchConfig) -> dict[tuple[str, str], tuple[int, int]]:
    """(in, out) of each of `cfg`'s decoder layer matmuls (`LAYER_MATMULS`; the MLP's of a
    dense layer)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    i = cfg.intermediate_size
    gated_q = 2 * q if cfg.attn_output_gate else q  # each head's query and its output gate
    return {("self_attn", "q_proj"): (h, gated_q), ("self_attn", "k_proj"): (h, kv),
            ("self_attn", "v_proj"): (h, kv), ("self_attn", "o_proj"): (q, h),
            ("mlp", "gate_proj"): (h, i), ("mlp", "up_proj"): (h, i),
            ("mlp", "down_proj"): (i, h)}
