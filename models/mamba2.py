"""The Mamba-2 token mixer of IBM Granite 4.0 (`GraniteMoeHybridForCausalLM`): one layer over
the step's ragged tokens, each request's conv and SSD state in its slot of the layer's pools.

The fields are the linear layers' (`ArchConfig.linear_*`, `linear_kind` "mamba2"), read as
Mamba-2's duality with linear attention reads them: the H heads of P channels are the value
heads (`linear_num_value_heads`, `linear_value_head_dim`), the G groups sharing B and C the
key heads (`linear_num_key_heads`; B the keys, C the queries) and the state size N their
width (`linear_key_head_dim`). The conv then covers x, B and C side by side
(`linear_conv_dim` = H P + 2 G N), and a request's state is [H, P, N]
(`models.gated_deltanet.state_shapes`).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ArchConfig
from models.linear import Linear, Methods
from pallas_kernels import AttentionMetadata


class GroupGatedRMSNorm(nn.Module):
    """`x * silu(gate)` normed over each of `groups` equal slices of the channels, times the
    weight (transformers' `GraniteMoeHybridRMSNormGated`: the gate before the norm)."""

    eps: float
    groups: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        """x, gate [T, C] -> [T, C] in the parameters' dtype."""
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
        y = x.astype(jnp.float32) * nn.silu(gate.astype(jnp.float32))  # f32[T, C]
        y = y.reshape(*y.shape[:-1], self.groups, -1)  # f32[T, G, C / G]
        y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + self.eps)
        return (scale.astype(jnp.float32) * y.reshape(x.shape)).astype(self.dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer (Granite 4.0's `mamba`): `in_proj` into the gate z, the conv's
    input xBC and the step sizes dt; a causal depthwise conv (SiLU) over xBC with its
    carried state; the selective scan (`AttentionOps.ssd`, the D skip inside) over x, B, C
    with dt = softplus(dt + dt_bias) and A = -exp(A_log); the gated norm per group; and
    `out_proj`.

    Attributes:
        cfg: Architecture config (`linear_kind` "mamba2").
        dtype: Parameter dtype.
        methods: The model's methods (its projections' and the state kernels).
    """

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods

    @nn.compact
    def __call__(self, x: jax.Array, conv_state: jax.Array, rec_state: jax.Array,
                 md: AttentionMetadata):
        """x [T, hidden] -> ([T, hidden], conv_state, rec_state), the states one layer's
        pools (f32[S, W - 1, C], f32[S, H, P, N]) updated at `md.state_slots`."""
        cfg, ops = self.cfg, self.methods.attention
        heads, head_dim = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        groups, state_size = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        inner, conv_dim, t = heads * head_dim, cfg.linear_conv_dim, x.shape[0]

        def proj(n, name, h):
            return Linear(n, self.methods.linear(name), cfg.linear_proj_bias, self.dtype,
                          name=name)(h)

        zxbcdt = proj(inner + conv_dim + heads, "in_proj", x)  # [T, inner + C + H]
        z, xbc, dt = jnp.split(zxbcdt, (inner, inner + conv_dim), axis=-1)
        conv_w = self.param("conv1d", nn.initializers.lecun_normal(),
                            (cfg.linear_conv_kernel_dim, conv_dim), self.dtype)  # [W, C]
        conv_b = (self.param("conv1d_bias", nn.initializers.zeros, (conv_dim,), self.dtype)
                  if cfg.linear_conv_bias else None)  # [C]
        a_log = self.param("A_log", nn.initializers.zeros, (heads,), self.dtype)
        d_skip = self.param("D", nn.initializers.ones, (heads,), self.dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (heads,), self.dtype)
        if self.is_initializing():  # only the parameters; no kernel traced
            y = jnp.zeros((t, inner), jnp.float32)
        else:
            slots, cu, lens = md.state_slots, md.cu_q_lens, md.kv_lens
            f32 = lambda a: None if a is None else a.astype(jnp.float32)
            xbc, conv_state = ops.causal_conv1d(f32(xbc), f32(conv_w), f32(conv_b), conv_state,
                                                slots, cu, lens, activation="silu")  # f32[T, C]
            xs = xbc[:, :inner].reshape(t, heads, head_dim)  # f32[T, H, P]
            b = xbc[:, inner:inner + groups * state_size].reshape(t, groups, state_size)
            c = xbc[:, inner + groups * state_size:].reshape(t, groups, state_size)
            # f32[T, H]; transformers' default time_step_limit (0, inf) clamps nothing
            # (`models.mamba_config` refuses another).
            step = jax.nn.softplus(dt.astype(jnp.float32) + f32(dt_bias))
            y, rec_state = ops.ssd(xs, step, -jnp.exp(f32(a_log)), b, c, f32(d_skip),
                                   rec_state, slots, cu, lens)  # f32[T, H, P]
            y = y.reshape(t, inner)
        y = GroupGatedRMSNorm(cfg.rms_norm_eps, groups, self.dtype, name="norm")(y, z)
        return proj(cfg.hidden_size, "out_proj", y.astype(x.dtype)), conv_state, rec_state
