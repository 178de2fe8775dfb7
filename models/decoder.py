"""The Flax decoder shared by every family: layers stacked and run with `nn.scan`.

`Decoder.__call__(input_ids, positions, kv_pages, md)` runs one step (any mix of prefill
chunks and decode tokens, on one token axis) and returns `(kv_pages, hidden)`; the page
pool rides in the scan carry so each layer's KV write updates it in place. Every weight
is a `models.linear` layer of the method its `Methods` gives it, and attention is
`Methods.attention`'s: the decoder says what is computed, never with which kernel. With a
hybrid KV cache (`kv_layout`, `models.kv_groups`) each layer also carries its pool slot and
KV cache group: weights stay indexed by the layer, KV by the slot, through the group's
block tables. A linear-attention hybrid (Qwen3-Next, Qwen3.5) carries a
`models.gated_deltanet.HybridCache` instead of the pool and runs each layer's token mixer
through `models.hybrid.HybridMixer` (gated attention or Gated DeltaNet, by the layer).
`compute_logits` applies the LM head to whichever rows the caller wants sampled.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ArchConfig
from models.eagle3 import capture_aux, start_aux
from models.gated_deltanet import HybridCache
from models.gemma4 import (
    per_layer_inputs,
    per_layer_modules,
    per_layer_residual,
    plain_rms,
    values_of,
    writes_kv,
)
from models.gemma4_config import kv_slot_index
from models.gemma4_heads import GlobalHeadsAttention, kind_rope
from models.gemma4_moe import Gemma4MoEBlock, has_moe_block
from models.hybrid import ATTENTION, LINEAR, HybridMixer, linear_mixer
from models.kv_groups import KVGroupLayout
from models.layers import GatedMLP, RMSNorm, apply_rope, layer_cos_sin, rope_cos_sin
from models.linear import STACKS, Embedding, Linear, Methods
from models.llama4_attn import per_layer_rope, rope_qk, window_args
from models.lora import COLLECTION as LORA
from models.mixed import MixedMLP
from models.mla import MLAttention
from models.moe import MoEMLP
from models.moe_parallel import ExpertSharding
from models.mrope import mrope_cos_sin
from pallas_kernels import AttentionMetadata


class Attention(nn.Module):
    """GQA self-attention writing K/V into the page pool and reading it back paged.

    Attributes:
        cfg: Architecture config.
        dtype: Parameter dtype.
        methods: The model's methods.
        phase: "whole" (write K/V, attend, project out); "qkv" returns (q, gate, k, v)
            after norms and rotary, and "attend" takes that (q, gate) as `x` and attends
            over pages that already hold the step's K/V: `models.hybrid.HybridMixer` splits
            a layer so no `lax.cond` branch carries the page pool (XLA copied it); "out"
            takes the attention's output [T, Hq, D] as `x` and projects it (`o_proj`).
    """

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods
    phase: str = "whole"

    @nn.compact
    def __call__(self, x, cos, sin, kv_pages, layer, window, md: AttentionMetadata, slot=None,
                 writes=None):
        """`layer` indexes the weights, `slot` (default: the layer) the pool's axis 0; `md`
        is the layer's group's (2-D block tables); `writes` (bool[] or None: yes) whether
        the layer writes its K/V (not a Gemma 4 KV-shared layer, which reads its source's)."""
        cfg, ops = self.cfg, self.methods.attention
        slot = layer if slot is None else slot
        inv = self.methods.batch_invariant

        def proj(n, bias, name, h):
            return Linear(n, self.methods.linear(name), bias, self.dtype, layer, name=name)(h)

        # gpt-oss's learned sinks: one more logit per query head in the softmax.
        sinks = (self.param("sinks", nn.initializers.zeros, (cfg.num_heads,), jnp.float32)
                 if cfg.attention_sinks else None)  # f32[Hq]
        if self.phase == "attend":
            q, gate = x
            return self._attend(q, gate, kv_pages, slot, window, md, proj, sinks)
        if self.phase == "out":  # the attention's output [T, Hq, D] (`models.gemma4_heads`)
            return proj(cfg.hidden_size, cfg.o_bias, "o_proj", x.reshape(x.shape[0], -1))
        num_tokens = x.shape[0]
        gated = cfg.attn_output_gate
        q = proj(cfg.num_heads * cfg.head_dim * (2 if gated else 1), cfg.qkv_bias, "q_proj", x)
        gate = None
        if gated:  # each head's query then its gate (Qwen3-Next's q_proj rows)
            q = q.reshape(num_tokens, cfg.num_heads, 2 * cfg.head_dim)
            q, gate = q[..., :cfg.head_dim], q[..., cfg.head_dim:]  # [T, Hq, D] each
            q = q.reshape(num_tokens, cfg.num_heads * cfg.head_dim)
        k = proj(cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, "k_proj", x)
        v = proj(cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, "v_proj", x)
        v = values_of(cfg, k, v, window)  # Gemma 4's attention_k_eq_v
        if cfg.qk_norm and cfg.qk_norm_full:  # OLMoE: over the whole projection
            q = RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_offset, inv, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_offset, inv, name="k_norm")(k)
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)  # [T, Hq, D]
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        if cfg.qk_norm and not cfg.qk_norm_full:
            q = RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_offset, inv, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_offset, inv, name="k_norm")(k)
        if cfg.v_norm:
            v = plain_rms(v, cfg.rms_norm_eps)
        cos, sin = layer_cos_sin(cos, sin, window)
        if per_layer_rope(cfg):  # Llama 4: NoPE layers, q/k norm, temperature
            q, k = rope_qk(cfg, q, k, cos, sin, layer, md)
        elif cfg.use_rope:
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        if self.phase == "qkv":
            return q, gate, k, v
        if not self.is_initializing():
            # A layer that writes nothing writes to the null page's first slot.
            mapping = md.slot_mapping if writes is None else jnp.where(writes, md.slot_mapping, 0)
            kv_pages = ops.write_kv(kv_pages, slot, k, v, mapping)
        return self._attend(q, gate, kv_pages, slot, window, md, proj, sinks), kv_pages

    def _attend(self, q, gate, kv_pages, slot, window, md: AttentionMetadata, proj,
                sinks=None):
        """[T, hidden] output of queries q [T, Hq, D] (gated by `gate` [T, Hq, D] or None)
        over the pages, which already hold this step's K/V (`sinks` f32[Hq] or None)."""
        cfg = self.cfg
        if self.is_initializing():
            # NOTE: `init` only makes the parameters (`abstract_params` traces it on every
            # load) and attention has none: its trace was most of init's.
            out = q  # [T, Hq, D]
        else:
            scale = (cfg.attention_multiplier  # Granite gives the scale itself
                     or (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5)
            out = self.methods.attention.attend(
                q, kv_pages, slot, md, sm_scale=scale, **window_args(cfg, window),
                soft_cap=cfg.attn_logit_softcap, sinks=sinks)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate.astype(out.dtype))
        out = out.reshape(q.shape[0], cfg.num_heads * cfg.head_dim)
        return proj(cfg.hidden_size, cfg.o_bias, "o_proj", out)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then gated MLP (a mixture of experts when
    `cfg.num_experts`: `models.moe.MoEMLP`, or `models.mixed.MixedMLP` when some layers
    stay dense, their experts split over a mesh by `expert_sharding`); with
    `cfg.sandwich_norms` (Gemma) each block's output is normed again before its residual
    add."""

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods
    expert_sharding: ExpertSharding | None = None
    capture_routing: bool = False

    @nn.compact
    def __call__(self, carry, xs, cos, sin, md: AttentionMetadata):
        hidden, kv_pages, *aux = carry  # aux: an EAGLE-3 capture (`models.eagle3.capture_aux`)
        # (layer, window) with one KV cache group; (layer, window, slot, group) with several;
        # (layer, window, slot) when layers share KV in one group; then the per-layer input.
        cfg, methods = self.cfg, self.methods
        layer, window, *grouped = xs
        aux = [capture_aux(a, hidden, layer) for a in aux]
        ple = grouped.pop() if cfg.per_layer_input_size else None  # [T, P]
        slot = None
        if len(grouped) == 2:
            slot, group = grouped
            md = md.for_group(group)
        elif grouped:
            (slot,) = grouped
        norm = lambda name: RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_offset,
                                    methods.batch_invariant, name=name)
        # Granite scales each block's output before its residual add (static: others unchanged).
        residual = ((lambda y: y) if cfg.residual_multiplier == 1.0
                    else (lambda y: y * cfg.residual_multiplier))
        h = norm("input_layernorm")(hidden)
        if cfg.is_mla:  # DeepSeek: one latent per token in the pool (`models.mla`)
            attn_out, kv_pages = MLAttention(cfg, self.dtype, methods, name="self_attn")(
                h, cos, sin, kv_pages, layer, md, slot)
        elif cfg.has_global_heads:  # Gemma 4: two head shapes, two stacks
            attn_out, kv_pages = GlobalHeadsAttention(cfg, self.dtype, methods, Attention,
                                                      name="heads")(
                h, cos, sin, kv_pages, layer, window, md, layer if slot is None else slot,
                writes_kv(cfg, layer))
        elif not cfg.has_linear_attention:
            attn_out, kv_pages = Attention(cfg, self.dtype, methods, name="self_attn")(
                h, cos, sin, kv_pages, layer, window, md, slot, writes_kv(cfg, layer))
        elif self.is_initializing():
            # Both mixers' weights for every layer; `models.hybrid.hybrid_init` cuts each
            # stack to its layers.
            attn_out, _ = Attention(cfg, self.dtype, methods, name=ATTENTION)(
                h, cos, sin, None, layer, window, md)
            attn_out = attn_out + linear_mixer(cfg)(cfg, self.dtype, methods, name=LINEAR)(
                h, None, None, md)[0]
        else:  # linear-attention hybrid: one of two stacks per layer
            attn_out, kv_pages = HybridMixer(cfg, self.dtype, methods, Attention, name="mixer")(
                h, cos, sin, kv_pages, layer, window, md)
        routed = None  # i32[T, top_k] this layer's routed experts, when captured
        if cfg.is_mixed:  # sparse and dense layers: one of two stacks per layer
            mlp = MixedMLP(cfg, self.dtype, methods, sharding=self.expert_sharding,
                           return_ids=self.capture_routing, name="mlp")
        elif has_moe_block(cfg):  # Gemma 4: a dense MLP and routed experts side by side
            mlp = Gemma4MoEBlock(cfg, self.dtype, methods, sharding=self.expert_sharding,
                                 return_ids=self.capture_routing, name="mlp")
        elif cfg.is_moe:  # every layer sparse
            mlp = MoEMLP(cfg, self.dtype, methods, sharding=self.expert_sharding,
                         return_ids=self.capture_routing, name="mlp")
        else:
            mlp = GatedMLP(cfg, self.dtype, methods, name="mlp")
        if cfg.sandwich_norms:
            hidden = hidden + norm("post_attention_layernorm")(attn_out)
            h = norm("pre_feedforward_layernorm")(hidden)
        else:
            hidden = hidden + residual(attn_out)
            h = norm("post_attention_layernorm")(hidden)
        # Gemma 4's MoE block also reads the residual stream (its router and experts).
        mlp_out = mlp(h, layer, hidden) if has_moe_block(cfg) else mlp(h, layer)
        if self.capture_routing:
            mlp_out, routed = mlp_out
        if cfg.sandwich_norms:
            mlp_out = norm("post_feedforward_layernorm")(mlp_out)
        hidden = hidden + residual(mlp_out)
        if cfg.per_layer_input_size or cfg.layer_scalar:  # Gemma 4
            hidden = per_layer_residual(self, hidden, ple, layer)
        return (hidden, kv_pages, *aux), routed


class Decoder(nn.Module):
    """Decoder-only causal LM over a paged KV cache.

    Attributes:
        cfg: Architecture config.
        dtype: Parameter and activation dtype (float32 or bfloat16).
        methods: Every weight's linear method and the attention kernels
            (`models.linear.choose_methods`).
        kv_layout: The KV cache groups (`models.kv_groups`) when there are several; None
            (or a one-group layout): the plain pool, slot = layer, 2-D block tables.
        expert_sharding: How a device mesh splits a mixture of experts' routed experts
            (`models.moe_parallel`); None: one device, or the experts replicated.
        capture_routing: Also return each token's routed experts in every layer (a
            mixture of experts only; vLLM's `enable_return_routed_experts`).
        aux_layers: Also return the residual stream entering each of these layers (an
            EAGLE-3 draft head's inputs; vLLM's numbering, 0 the embedding, `num_layers` the
            stream after the last layer, before the final norm: an MTP layer's); () none.
    """

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods
    kv_layout: KVGroupLayout | None = None
    expert_sharding: ExpertSharding | None = None
    capture_routing: bool = False
    aux_layers: tuple[int, ...] = ()

    def setup(self):
        cfg, methods = self.cfg, self.methods
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, methods.embedding)
        # NOTE: each layer's params are sliced out of their stack; weights a method reads
        # whole at the traced layer index live in `STACKS`, which the scan broadcasts (and
        # so are the LoRA stacks a kernel reads whole).
        whole = (STACKS, LORA) if methods.lora_whole else STACKS
        self.layers = nn.scan(
            DecoderLayer,
            variable_axes={"params": 0} if methods.lora_whole else {"params": 0, LORA: 0},
            variable_broadcast=whole,
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
            length=cfg.num_layers,
            # NOTE: flax's invariant check traces the layer once more to find what the
            # broadcast collections return; serving creates no variables, so only `init`
            # (which creates them inside the body) needs it. Tracing a step once instead
            # of twice: issue 49's startup, docs/development.md "trace time".
            check_constancy_invariants=self.is_initializing(),
        )(cfg, self.dtype, methods, self.expert_sharding, self.capture_routing)
        self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype, cfg.norm_offset, methods.batch_invariant)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.vocab_size, methods.linear("lm_head"), dtype=self.dtype)
        if cfg.per_layer_input_size:  # Gemma 4's per-layer inputs (`models.gemma4`)
            (self.embed_tokens_per_layer, self.per_layer_model_projection,
             self.per_layer_projection_norm) = per_layer_modules(cfg, self.dtype, methods)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_pages,
                 md: AttentionMetadata, mm_embeds: tuple | None = None,
                 rope_positions: jax.Array | None = None) -> tuple:
        """Runs one step.

        Args:
            input_ids: i32[num_tokens] token ids (padding: any id).
            positions: i32[num_tokens] absolute position of each token.
            kv_pages: dtype[num_slots, 2, num_kv_heads, num_pages, page_size, head_dim]
                (num_slots: the layers, or `kv_layout.num_slots`); for a model with
                linear-attention layers a `HybridCache` (pages of the full-attention layers
                and the state pools, `md.state_slots` saying each request's slot), returned
                updated the same way.
            md: Attention metadata of this step (with several KV cache groups, its slot
                mapping and block tables per group: `AttentionMetadata.for_group`).
            mm_embeds: (rows [N, hidden_size], i32[num_tokens] each token's row or -1):
                the tokens with a row take it as their embedding (an image's placeholders
                take the vision encoder's outputs, after the embedding scale, as
                transformers puts them); None: every token its own embedding.
            rope_positions: i32[3, num_tokens] the multimodal rotary's (temporal, height,
                width) positions of a model with `mrope_section` (`models.mrope`); None:
                `positions` on all three rows (a text-only step).

        Returns:
            (kv_pages, hidden) with hidden [num_tokens, hidden_size] after the final norm;
            with `aux_layers`, then [num_tokens, len(aux_layers), hidden_size] the residual
            stream entering each of those layers; with `capture_routing`, then
            i32[num_tokens, num_layers, top_k] each token's routed experts per layer, -1 on
            a mixed model's dense layers.

        Raises:
            ValueError: `md` carries another number of KV cache groups than `kv_layout`;
                a hybrid's cache that is not a `HybridCache` or metadata without
                `state_slots`.
        """
        if self.cfg.has_linear_attention and not self.is_initializing():
            if not isinstance(kv_pages, HybridCache) or md.state_slots is None:
                raise ValueError(f"{self.cfg.architecture} has linear-attention layers: its "
                                 "cache is a models.gated_deltanet.HybridCache and its "
                                 "metadata carries state_slots")
        lay = self.kv_layout if self.kv_layout is not None and self.kv_layout.is_hybrid else None
        groups = 1 if lay is None else lay.num_groups
        grouped = lay is not None
        if (md.num_groups != groups or md.block_tables.ndim != 2 + grouped
                or md.slot_mapping.ndim != 1 + grouped):
            raise ValueError(f"block_tables {md.block_tables.shape} and slot_mapping "
                             f"{md.slot_mapping.shape} do not carry the {groups} KV cache "
                             f"group(s) of the model's layout")
        if self.cfg.mrope_section:  # Qwen2-VL's rotary: a position row per band
            rows = (jnp.broadcast_to(positions, (3, positions.shape[0]))
                    if rope_positions is None else rope_positions)
            cos, sin = mrope_cos_sin(rows, self.cfg.rotary_dim, self.cfg.rope_theta,
                                     self.cfg.mrope_section)
        elif self.cfg.has_global_heads:
            cos, sin = kind_rope(positions, self.cfg)
        else:
            cos, sin = rope_cos_sin(positions, self.cfg)
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        if self.cfg.embed_scale:  # the factor rounded to the dtype first, as transformers
            hidden = hidden * jnp.asarray(self.cfg.hidden_size ** 0.5, hidden.dtype)
        if self.cfg.embedding_multiplier != 1.0:  # Granite
            hidden = hidden * self.cfg.embedding_multiplier
        if mm_embeds is not None:
            rows, index = mm_embeds  # [N, H], i32[num_tokens]
            hidden = jnp.where(index[:, None] >= 0,
                               rows[jnp.maximum(index, 0)].astype(hidden.dtype), hidden)
        xs = (jnp.arange(self.cfg.num_layers, dtype=jnp.int32),
              jnp.asarray(self.cfg.layer_windows, dtype=jnp.int32))
        # A KV-shared layer (Gemma 4) takes its source's slot and group.
        kv = kv_slot_index(self.cfg) if self.cfg.kv_shared_layers else None
        if lay is not None:  # NOTE: the window stays the layer's (masking never changes)
            slots, groups = lay.layer_slot, lay.layer_group
            if kv is not None:
                slots, groups = [slots[k] for k in kv], [groups[k] for k in kv]
            xs += (jnp.asarray(slots, jnp.int32), jnp.asarray(groups, jnp.int32))
        elif kv is not None:
            xs += (jnp.asarray(kv, jnp.int32),)
        if self.cfg.per_layer_input_size:
            modules = (self.embed_tokens_per_layer, self.per_layer_model_projection,
                       self.per_layer_projection_norm)
            xs += (per_layer_inputs(self.cfg, modules, input_ids, hidden),)
        carry = (hidden, kv_pages)
        if self.aux_layers:  # rides in the carry: one buffer, not a stack of every layer's
            carry += (start_aux(self.aux_layers, hidden),)
        (hidden, kv_pages, *aux), routed = self.layers(carry, xs, cos, sin, md)
        out = (kv_pages, self.norm(hidden))
        if aux:  # [n, T, H] in the carry; id num_layers: the stream after the last layer
            out += (jnp.swapaxes(capture_aux(aux[0], hidden, self.cfg.num_layers)[0], 0, 1),)
        if self.capture_routing:  # routed: i32[L, T, k] from the scan
            out += (jnp.swapaxes(routed, 0, 1),)
        return out

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """LM head: f32[num_rows, vocab_size] logits from final hidden states (divided by
        `logits_scaling`, soft-capped where the family caps them)."""
        if self.cfg.tie_word_embeddings:
            logits = self.embed_tokens.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        logits = logits.astype(jnp.float32)
        if self.cfg.logits_scaling != 1.0:  # Granite divides them
            logits = logits / self.cfg.logits_scaling
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else cap * jnp.tanh(logits / cap)
