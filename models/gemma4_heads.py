"""Gemma 4's full-attention layers of their own head shape (`global_head_dim`, and with
`attention_k_eq_v` `num_global_key_value_heads`) inside the one layer scan.

The scan slices every "params" leaf per layer, so layers of two head shapes keep their
attention weights in two stacks (as `models.mixed` does for sparse and dense MLPs): the
sliding layers' at `layers/self_attn` [L_local, ...] and the full-attention layers' at
`layers/global_attn` [L_global, ...] (the checkpoint's `layers.{i}.self_attn`), moved at
apply time into the collection the scan broadcasts whole (`models.linear.STACKS`,
`layers/heads/{local,global}`).

The page pool has one shape, the least that holds both kinds (`ArchConfig.kv_pool_heads`):
lcm of the KV head counts and the wider head. A layer's keys and values are written into
it with each KV head repeated (so the query heads' grouping over the pool's heads is the
layer's own) and zeros past its width (which add nothing to q.k and give zero outputs
there). `GlobalHeadsAttention` picks the layer's projections with `jax.lax.cond` on its
traced kind, writes and attends outside the cond (no branch carries the pool: XLA would
copy it), and projects the attention's output, cut to the layer's width, through the
kind's `o_proj`. The cost: a sliding layer attends over the wider head, a full layer over
the repeated heads, and each page holds the pool's shape for both kinds (docs/design.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ArchConfig
from models.layers import rope_cos_sin
from models.linear import STACKS, Methods
from models.llama4_attn import window_args
from pallas_kernels import AttentionMetadata

LOCAL, GLOBAL = "self_attn", "global_attn"  # the two attention stacks in the params tree


def global_layers(cfg: ArchConfig) -> tuple[int, ...]:
    """The full-attention layers (window 0): the `global_attn` stack's, in order."""
    return tuple(i for i, w in enumerate(cfg.layer_windows) if w == 0)


def local_layers(cfg: ArchConfig) -> tuple[int, ...]:
    """The sliding-window layers: the `self_attn` stack's, in order."""
    return tuple(i for i, w in enumerate(cfg.layer_windows) if w != 0)


def kind_config(cfg: ArchConfig, is_global: bool) -> ArchConfig:
    """`cfg` as one kind's layers see it: their head shape, their rotary alone."""
    if is_global:
        return dataclasses.replace(
            cfg, head_dim=cfg.global_head_dim or cfg.head_dim,
            num_kv_heads=cfg.global_kv_heads or cfg.num_kv_heads, global_head_dim=0,
            global_kv_heads=0, local_rope_theta=None)
    theta = cfg.rope_theta if cfg.local_rope_theta is None else cfg.local_rope_theta
    scaling = cfg.rope_scaling if cfg.local_rope_theta is None else cfg.local_rope_scaling
    return dataclasses.replace(cfg, global_head_dim=0, global_kv_heads=0, rope_theta=theta,
                               rope_scaling=scaling, local_rope_theta=None)


def kind_rope(positions: jax.Array, cfg: ArchConfig) -> tuple[tuple, tuple]:
    """(cos, sin), each (local, global) f32[num_tokens, rotary_dim of the kind]: the tables
    the decoder broadcasts to the layers instead of `rope_cos_sin`'s."""
    local = rope_cos_sin(positions, kind_config(cfg, False))
    full = rope_cos_sin(positions, kind_config(cfg, True))
    return (local[0], full[0]), (local[1], full[1])


def stack_index(cfg: ArchConfig) -> np.ndarray:
    """i32[L]: each layer's index in its kind's stack."""
    index = np.zeros(cfg.num_layers, np.int32)
    for kind in (local_layers(cfg), global_layers(cfg)):
        index[list(kind)] = np.arange(len(kind), dtype=np.int32)
    return index


def global_heads_init(cfg: ArchConfig, init_of: Callable[[ArchConfig], Callable]) -> Callable:
    """The init function (RNG key -> params tree) of a model with global heads, from
    `init_of(cfg)`, a model's init function: every layer's weights of the local shape with
    `self_attn` cut to the sliding layers, and the full layers' attention (of the global
    shape) as `global_attn`."""
    local_init = init_of(kind_config(cfg, False))
    global_init = init_of(kind_config(cfg, True))
    local_ids, global_ids = np.asarray(local_layers(cfg)), np.asarray(global_layers(cfg))

    def init(key):
        params = local_init(key)
        wide = global_init(key)["layers"][LOCAL]
        layers = dict(params["layers"])
        layers[LOCAL] = jax.tree_util.tree_map(lambda a: a[local_ids], layers[LOCAL])
        layers[GLOBAL] = jax.tree_util.tree_map(lambda a: a[global_ids], wide)
        return {**params, "layers": layers}

    return init


def broadcast_heads(variables: dict) -> dict:
    """The Flax variables a model with global heads applies with: both attention stacks
    moved from "params" into `STACKS` (`layers/heads/{local,global}`); others' variables
    are returned as they are."""
    layers = variables["params"].get("layers", {})
    if GLOBAL not in layers:
        return variables
    rest = {k: v for k, v in layers.items() if k not in (LOCAL, GLOBAL)}
    collection = dict(variables.get(STACKS, {}))
    collection["layers"] = {**collection.get("layers", {}),
                            "heads": {"local": layers[LOCAL], "global": layers[GLOBAL]}}
    return {**variables, "params": {**variables["params"], "layers": rest},
            STACKS: collection}


def _to_pool(x: jax.Array, heads: int, width: int) -> jax.Array:
    """x [T, h, d] as [T, heads, width]: each head repeated heads/h times, zeros past d."""
    x = jnp.repeat(x, heads // x.shape[1], axis=1) if heads != x.shape[1] else x
    return jnp.pad(x, ((0, 0), (0, 0), (0, width - x.shape[2])))


class GlobalHeadsAttention(nn.Module):
    """A layer's attention in a model with global heads (above): the layer's kind's
    projections, norms and rotary, then the pool's write and attention, then its `o_proj`.

    Attributes:
        cfg: Architecture config with `has_global_heads`.
        dtype: Parameter dtype.
        methods: The model's methods.
        attention_cls: The attention module class (`models.decoder.Attention`, whose
            "qkv" and "out" phases run each kind's weights).

    The decoder names it "heads", so it reads the stacks `broadcast_heads` puts at
    `layers/heads/{local,global}`.
    """

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods
    attention_cls: type

    @nn.compact
    def __call__(self, x, cos, sin, kv_pages, layer, window, md: AttentionMetadata, slot,
                 writes=None):
        """x [T, H] -> ([T, H], kv_pages) through layer `layer`'s (i32[]) attention; `cos`
        and `sin` are `kind_rope`'s pairs, `slot` the layer's pool slot, `writes` as
        `models.decoder.Attention`'s.

        Raises:
            ValueError: The variables lack the stacks (applied without `broadcast_heads`).
        """
        stacks = {"local": self.get_variable(STACKS, "local"),
                  "global": self.get_variable(STACKS, "global")}
        if stacks["local"] is None or stacks["global"] is None:
            raise ValueError("a model with global_head_dim keeps its attention stacks in the "
                             f"{STACKS!r} collection; apply it with "
                             "models.model.variables(params)")
        cfg = self.cfg
        heads, width = cfg.kv_pool_heads
        is_global = jnp.asarray(np.asarray(cfg.layer_windows) == 0)[layer]  # bool[]
        index = jnp.asarray(stack_index(cfg))[layer]  # i32[]: the layer in its kind's stack
        at = lambda tree: jax.tree_util.tree_map(lambda a: a[index], tree)
        kinds = {False: kind_config(cfg, False), True: kind_config(cfg, True)}
        module = lambda g, phase: self.attention_cls(kinds[g], self.dtype, self.methods,
                                                     phase=phase, parent=None)
        params = {False: stacks["local"], True: stacks["global"]}

        def qkv(g):
            def run(x):
                q, _, k, v = module(g, "qkv").apply(
                    {"params": at(params[g])}, x, cos[g], sin[g], None, index, window, md)
                return (_to_pool(q, q.shape[1], width), _to_pool(k, heads, width),
                        _to_pool(v, heads, width))
            return run

        q, k, v = jax.lax.cond(is_global, qkv(True), qkv(False), x)
        ops = self.methods.attention
        mapping = md.slot_mapping if writes is None else jnp.where(writes, md.slot_mapping, 0)
        kv_pages = ops.write_kv(kv_pages, slot, k, v, mapping)
        out = ops.attend(q, kv_pages, slot, md, sm_scale=cfg.attention_multiplier,
                         **window_args(cfg, window), soft_cap=cfg.attn_logit_softcap)

        def project(g):
            d = kinds[g].head_dim
            return lambda out: module(g, "out").apply({"params": at(params[g])}, out[..., :d],
                                                      None, None, None, index, window, md)

        return jax.lax.cond(is_global, project(True), project(False), out), kv_pages
