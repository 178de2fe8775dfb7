"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) over a latent page pool, absorbed form.

Each token keeps one latent row per layer in the pool (`pallas_kernels.metadata.
latent_pages_shape`: [num_slots, 1, 1, num_pages, page_size, R + Dr]): its compressed KV
c_kv (`kv_a_proj_with_mqa`'s first R = `kv_lora_rank` outputs, RMS-normed by
`kv_a_layernorm`) then its roped key part k_pe (the last Dr = `qk_rope_head_dim`, shared by
every head). Keys and values are never expanded: `kv_b_proj` [R, H * (Dn + Dv)] is split
per head into W_UK [R, H, Dn] and W_UV [R, H, Dv]; each query's unroped part q_nope [H, Dn]
is projected into the latent space (q_latent = q_nope W_UK^T, [H, R]), attention runs over
the latents (`AttentionOps.mla_attend`: q_latent . c_kv + q_pe . k_pe), and its [H, R]
output goes through W_UV then `o_proj`. `ArchConfig.mla_form` "expanded" instead rebuilds
per-head keys [c_kv W_UK, k_pe] and values c_kv W_UV from each request's gathered latents
(`AttentionOps.mla_attend_expanded`, output [H, Dv]); "prefill_expanded" does so for
requests of several new tokens and keeps decode rows absorbed (vLLM's split).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ArchConfig
from models.layers import RMSNorm, apply_rope
from models.linear import Linear, LinearMethod, Methods
from pallas_kernels import AttentionMetadata

# transformers' DeepSeek builds `q_a_layernorm` and `kv_a_layernorm` with the RMSNorm's
# default epsilon, not the config's `rms_norm_eps`.
LATENT_NORM_EPS = 1e-6


def deinterleave(x: jax.Array) -> jax.Array:
    """x [..., D] with its channels reordered even ones first, then odd ones: DeepSeek's
    rotary turns pairs (x0, x1), (x2, x3), ..., which half-split rotary (`apply_rope`)
    turns once they are so reordered (transformers' `rope_interleave`). q and k are
    reordered alike, so their dot products are those of the interleaved rotation."""
    perm = np.concatenate([np.arange(0, x.shape[-1], 2), np.arange(1, x.shape[-1], 2)])
    return x[..., perm]


class LinearWeight(nn.Module):
    """A linear layer's weight as a float kernel [in, out] (for matmuls a `Linear` cannot
    express: `kv_b_proj` read per head, transposed), declared as its method stores it."""

    in_features: int
    features: int
    method: LinearMethod
    dtype: jnp.dtype

    @nn.compact
    def __call__(self) -> jax.Array:
        w = self.method.weights(self, self.in_features, self.features)
        return self.method.dense(w, self.dtype)


class MLAttention(nn.Module):
    """Multi-head latent attention writing one latent per token into the page pool.

    Attributes:
        cfg: Architecture config (`is_mla`).
        dtype: Parameter dtype.
        methods: The model's methods (every projection a `Linear` of its name's method).
    """

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods

    @nn.compact
    def __call__(self, x, cos, sin, pool, layer, md: AttentionMetadata, slot=None):
        """x [T, hidden] -> ([T, hidden], the pool with this step's latents in slot `slot`,
        default the layer); `cos`/`sin` f32[T, Dr]."""
        cfg = self.cfg
        slot = layer if slot is None else slot
        h, rank, rope = cfg.num_heads, cfg.kv_lora_rank, cfg.head_dim
        nope, dv = cfg.qk_nope_head_dim, cfg.v_head_dim
        num_tokens = x.shape[0]

        def proj(n, name, inp):
            return Linear(n, self.methods.linear(name), False, self.dtype, layer, name=name)(inp)

        def norm(name, inp):
            return RMSNorm(LATENT_NORM_EPS, self.dtype, cfg.norm_offset,
                           self.methods.batch_invariant, name=name)(inp)

        if cfg.q_lora_rank:
            q = proj(h * (nope + rope), "q_b_proj",
                     norm("q_a_layernorm", proj(cfg.q_lora_rank, "q_a_proj", x)))
        else:
            q = proj(h * (nope + rope), "q_proj", x)
        q = q.reshape(num_tokens, h, nope + rope)  # [T, H, Dn + Dr]
        q_nope, q_pe = q[..., :nope], q[..., nope:]
        kv = proj(rank + rope, "kv_a_proj_with_mqa", x)  # [T, R + Dr]
        c_kv = norm("kv_a_layernorm", kv[:, :rank])  # [T, R]
        k_pe = kv[:, None, rank:]  # [T, 1, Dr]
        if cfg.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)
        w_kv = LinearWeight(rank, h * (nope + dv), self.methods.linear("kv_b_proj"), self.dtype,
                            name="kv_b_proj")().reshape(rank, h, nope + dv)  # [R, H, Dn + Dv]
        w_uk, w_uv = w_kv[..., :nope], w_kv[..., nope:]  # [R, H, Dn], [R, H, Dv]
        if self.is_initializing():
            # `init` makes the parameters only (attention has none).
            v = jnp.zeros((num_tokens, h, dv), x.dtype)
        else:
            latent = jnp.concatenate([c_kv, k_pe[:, 0]], axis=-1)  # [T, R + Dr]
            pool = self.methods.attention.write_latent(pool, slot, latent, md.slot_mapping)
            scale = cfg.attention_multiplier or (nope + rope) ** -0.5
            v = self._attend(q_nope, q_pe, pool, slot, md, w_uk, w_uv, scale).astype(x.dtype)
        return proj(cfg.hidden_size, "o_proj", v.reshape(num_tokens, h * dv)), pool

    def _attend(self, q_nope, q_pe, pool, slot, md, w_uk, w_uv, scale):
        """[T, H, Dv] attention output in `cfg.mla_form` (module docstring)."""
        ops = self.methods.attention
        if self.cfg.mla_form != "absorbed":
            return ops.mla_attend_expanded(
                q_nope, q_pe.astype(q_nope.dtype), pool, slot, md, w_uk, w_uv,
                sm_scale=scale, absorbed_decode=self.cfg.mla_form == "prefill_expanded")
        q_latent = jnp.einsum("thn,rhn->thr", q_nope, w_uk.astype(q_nope.dtype))  # [T, H, R]
        out = ops.mla_attend(q_latent, q_pe.astype(q_latent.dtype), pool, slot, md,
                             sm_scale=scale)  # [T, H, R]
        return jnp.einsum("thr,rhv->thv", out, w_uv.astype(out.dtype))  # [T, H, Dv]


def kv_bytes_report(cfg: ArchConfig, itemsize: int) -> str:
    """A line on what one token costs in the pool, its latents over every layer, beside the
    GQA-equivalent layout (each head's key, `qk_nope_head_dim + qk_rope_head_dim`, and
    value, `v_head_dim`) and their ratio: the tokens the latent pool holds for each token
    that layout would."""
    latent = cfg.num_layers * cfg.latent_dim * itemsize
    gqa = cfg.num_layers * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.head_dim
                                            + cfg.v_head_dim) * itemsize
    return (f"latent KV {latent} bytes per token ({cfg.num_layers} layers x "
            f"{cfg.kv_lora_rank} + {cfg.head_dim} values); the GQA-equivalent layout "
            f"{gqa} bytes (x{gqa / latent:.1f} the tokens in the same bytes)")
