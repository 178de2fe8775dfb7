"""The Gated DeltaNet token mixer of Qwen3-Next and Qwen3.5, and the cache pytree of models
that have such layers (the page pool plus each linear layer's per-request state slots)."""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ArchConfig
from models.linear import Linear, Methods
from pallas_kernels import AttentionMetadata

STATE_DTYPE = jnp.float32  # the kernels carry their states in float32 whatever the model's
L2_EPS = 1e-6  # transformers' (and FLA's) l2norm epsilon


class HybridCache(NamedTuple):
    """What a model with linear-attention layers carries from step to step (a pytree).

    Slot 0 of each state pool is the null slot (padded requests read and write it), as
    page 0 is the null page; a request owns one slot of every linear layer's pools.

    Attributes:
        pages: The full-attention layers' page pool (`pallas_kernels.metadata`), one pool
            slot per full-attention layer (`ArchConfig.attention_layers`).
        conv: f32[L_lin, num_slots, W - 1, C]: each request's last W - 1 inputs of every
            linear layer's convolution (C: `ArchConfig.linear_conv_dim`, grouped by key
            head as `in_proj_qkv`'s outputs; Mamba-2: x, B, C).
        recurrent: each request's recurrent state, its shape the layers' kind's
            (`state_shapes`): f32[L_lin, num_slots, Hv, dk, dv] for the delta rule,
            f32[L_lin, num_slots, H, P, N] for Mamba-2's SSD.
    """

    pages: jax.Array
    conv: jax.Array
    recurrent: jax.Array


def state_shapes(cfg: ArchConfig, num_slots: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The state pools of `num_slots` slots (slot 0 null): {"conv", "recurrent"} as
    `HybridCache` holds them; the recurrent one per `cfg.linear_kind` (Gated DeltaNet:
    [Hv, dk, dv]; Mamba-2: [H, P, N], `pallas_kernels.ops.ssd`'s)."""
    n = len(cfg.linear_layers)
    conv = (n, num_slots, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim)
    heads, dk, dv = (cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                     cfg.linear_value_head_dim)
    rec = (n, num_slots, heads, *((dv, dk) if cfg.linear_kind == "mamba2" else (dk, dv)))
    return {"conv": jax.ShapeDtypeStruct(conv, STATE_DTYPE),
            "recurrent": jax.ShapeDtypeStruct(rec, STATE_DTYPE)}


def state_bytes_per_slot(cfg: ArchConfig) -> int:
    """Bytes one request's state takes over all linear layers (conv and recurrent)."""
    return sum(s.size // s.shape[1] * jnp.dtype(s.dtype).itemsize
               for s in state_shapes(cfg, 1).values())


def _l2norm(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times its weight, then times `silu(gate)` (transformers'
    `Qwen3NextRMSNormGated`: the weight starts at one, no `1 +`)."""

    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        """x, gate [..., D] -> [..., D] in x's dtype."""
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        y = (scale * x32.astype(x.dtype)).astype(jnp.float32)
        return (y * nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer over the step's tokens (every request's on one axis), each
    request's state in its slot's rows.

    q, k, v come from `in_proj_qkv` through a causal depthwise convolution (SiLU) whose
    last inputs are kept per request; each value head's state decays by `exp(g)`, g =
    -exp(A_log) * softplus(a + dt_bias), and takes the delta-rule update with rate
    sigmoid(b); the output is normed per head, gated by silu(z) and projected back.
    """

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods

    @nn.compact
    def __call__(self, x: jax.Array, conv_state: jax.Array, rec_state: jax.Array,
                 md: AttentionMetadata):
        """x [T, hidden] -> ([T, hidden], conv_state, rec_state), the states one layer's
        pools (f32[S, W - 1, C], f32[S, Hv, dk, dv]) updated at `md.state_slots`."""
        cfg, ops = self.cfg, self.methods.attention
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        width = cfg.linear_conv_kernel_dim
        t = x.shape[0]

        def proj(n, name, h):
            return Linear(n, self.methods.linear(name), False, self.dtype, name=name)(h)

        # [T, C]: per key head g, its q, its k and its value heads' v (`models.loaders.gdn_fused`)
        qkv = proj(cfg.linear_conv_dim, "in_proj_qkv", x)
        z = proj(hv * dv, "in_proj_z", x).reshape(t, hv, dv)
        b = proj(hv, "in_proj_b", x)  # [T, Hv]
        a = proj(hv, "in_proj_a", x)  # [T, Hv]
        conv_w = self.param("conv1d", nn.initializers.lecun_normal(), (width, cfg.linear_conv_dim),
                            self.dtype)  # [W, C], oldest tap first
        a_log = self.param("A_log", nn.initializers.zeros, (hv,), self.dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (hv,), self.dtype)
        if self.is_initializing():  # only the parameters; no kernel traced
            core = jnp.zeros((t, hv, dv), x.dtype)
        else:
            slots, cu, lens = md.state_slots, md.cu_q_lens, md.kv_lens
            mixed, conv_state = ops.causal_conv1d(
                qkv.astype(jnp.float32), conv_w.astype(jnp.float32), None, conv_state, slots,
                cu, lens, activation="silu")  # f32[T, C]
            mixed = mixed.reshape(t, hk, -1)  # [T, Hk, 2 dk + Hv / Hk dv]: channels by key head
            q = _l2norm(mixed[..., :dk]) * dk ** -0.5  # [T, Hk, dk]
            k = _l2norm(mixed[..., dk:2 * dk])  # [T, Hk, dk]
            v = mixed[..., 2 * dk:].reshape(t, hv, dv)  # each key head's value heads in turn
            beta = jax.nn.sigmoid(b.astype(jnp.float32))  # f32[T, Hv]
            g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
                a.astype(jnp.float32) + dt_bias.astype(jnp.float32))  # f32[T, Hv], <= 0
            core, rec_state = ops.gated_delta_rule(q, k, v, g, beta, rec_state, slots,
                                                          cu, lens)  # f32[T, Hv, dv]
            core = core.astype(x.dtype)
        out = GatedRMSNorm(cfg.rms_norm_eps, self.dtype, name="norm")(core, z)
        return proj(cfg.hidden_size, "out_proj", out.reshape(t, hv * dv)), conv_state, rec_state
