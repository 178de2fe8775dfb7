"""Gemma 4's numerics inside the shared decoder: per-layer input embeddings, the value norm,
the per-layer scalar, and the traced per-layer facts KV sharing and `attention_k_eq_v` need.

Per-layer inputs (PLE), as transformers' `Gemma4TextModel`: a second table
`embed_tokens_per_layer` [V_ple, L * P] scaled by `sqrt(P)` gives each token one P-wide row
per layer; `per_layer_model_projection` of the (scaled) token embedding, times
`1 / sqrt(hidden)` and RMS-normed per layer (`per_layer_projection_norm`), is added and the
sum scaled by `1 / sqrt(2)`. Layer l then adds, after its MLP,
`post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(h)) * ple[l]))`
to its residual stream, and multiplies the result by its `layer_scalar`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import ArchConfig
from models.layers import ACTIVATIONS, RMSNorm
from models.linear import Embedding, Linear, Methods


def plain_rms(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm without a scale over the last axis, in float32 and cast back (Gemma 4's
    `v_norm`)."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(mean + eps)).astype(x.dtype)


def values_of(cfg: ArchConfig, k: jax.Array, v: jax.Array, window: jax.Array) -> jax.Array:
    """The values a layer attends with, [T, Hkv * D]: with `attention_k_eq_v` a full
    layer's (traced window 0) are its key projection (before the key norm and rotary)."""
    if not cfg.attention_k_eq_v:
        return v
    return jnp.where(window == 0, k, v)


def writes_kv(cfg: ArchConfig, layer: jax.Array) -> jax.Array | None:
    """bool[]: whether layer `layer` (traced) writes K/V (not one of the last
    `kv_shared_layers`); None when no layer shares."""
    if not cfg.kv_shared_layers:
        return None
    return layer < cfg.num_layers - cfg.kv_shared_layers


def per_layer_modules(cfg: ArchConfig, dtype, methods: Methods) -> tuple:
    """The decoder's per-layer input modules, for its `setup` to keep under transformers'
    names: (`embed_tokens_per_layer`, `per_layer_model_projection`,
    `per_layer_projection_norm`)."""
    width = cfg.num_layers * cfg.per_layer_input_size
    return (Embedding(cfg.per_layer_vocab_size, width, methods.embedding),
            Linear(width, methods.linear("per_layer_model_projection"), dtype=dtype),
            RMSNorm(cfg.rms_norm_eps, dtype, cfg.norm_offset, methods.batch_invariant))


def per_layer_inputs(cfg: ArchConfig, modules: tuple, input_ids: jax.Array,
                     embeds: jax.Array) -> jax.Array:
    """[L, T, P] inputs of each layer from ids i32[T] and the scaled token embeddings
    [T, hidden], through `per_layer_modules` (the layer axis first: the layer scan's xs)."""
    embed, project, norm = modules
    shape = (input_ids.shape[0], cfg.num_layers, cfg.per_layer_input_size)
    table = embed(input_ids)  # [T, L * P]
    table = (table * jnp.asarray(cfg.per_layer_input_size ** 0.5, table.dtype)).reshape(shape)
    proj = project(embeds) * cfg.hidden_size ** -0.5  # [T, L * P]
    proj = norm(proj.reshape(shape))  # [T, L, P]
    return jnp.swapaxes((proj + table) * 2.0 ** -0.5, 0, 1)  # [L, T, P]


def per_layer_residual(module: nn.Module, hidden: jax.Array, ple: jax.Array | None,
                       layer: jax.Array) -> jax.Array:
    """A decoder layer's output after its MLP residual: the per-layer input block (with
    `ple` [T, P]) then the learned `layer_scalar`, declared in `module` (the
    `DecoderLayer`, whose compact call this is) under transformers' names."""
    cfg, methods = module.cfg, module.methods
    if cfg.per_layer_input_size:
        def dense(n, name, h):
            return Linear(n, methods.linear(name), False, module.dtype, layer, name=name)(h)

        gate = ACTIVATIONS[cfg.hidden_act](dense(cfg.per_layer_input_size,
                                                 "per_layer_input_gate", hidden))
        out = dense(cfg.hidden_size, "per_layer_projection", gate * ple)  # [T, hidden]
        out = RMSNorm(cfg.rms_norm_eps, module.dtype, cfg.norm_offset, methods.batch_invariant,
                      name="post_per_layer_input_norm")(out)
        hidden = hidden + out
    if cfg.layer_scalar:
        scalar = module.param("layer_scalar", nn.initializers.ones, (1,), module.dtype)
        hidden = hidden * scalar
    return hidden
