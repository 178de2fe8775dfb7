"""Linear-attention hybrids (Qwen3-Next, Qwen3.5; Granite 4.0): full-attention and Gated
DeltaNet (or Mamba-2) layers inside the one layer scan, as `models.mixed` does for sparse
and dense MLPs.

The scan slices every "params" leaf per layer, so it needs one parameter structure for all
layers. A hybrid's token mixers are therefore two stacks of their own lengths in the params
tree (what loads, saves and shards): the full-attention layers' `Attention` weights [L_attn,
...] at `layers/self_attn` and the linear layers' weights (`linear_mixer`: `GatedDeltaNet`
or `Mamba2Mixer`) [L_lin, ...] at `layers/linear_attn` (`hybrid_init` cuts them from an init
that made both for every layer). At apply time `broadcast_mixers` moves both into the
collection the scan broadcasts whole (`models.linear.STACKS`,
`layers/mixer/{attention,linear}`), and `HybridMixer` runs one of them per layer under
`jax.lax.cond` on the traced layer's kind, at the layer's index in its stack
(`mixer_index`). That index is also where the layer keeps its cache: a full-attention
layer's pool slot in the pages, a linear layer's row of the state pools
(`models.gated_deltanet.HybridCache`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ArchConfig
from models.gated_deltanet import GatedDeltaNet, HybridCache
from models.linear import STACKS, Methods
from models.mamba2 import Mamba2Mixer
from pallas_kernels import AttentionMetadata

ATTENTION, LINEAR = "self_attn", "linear_attn"  # the two mixer stacks in the params tree


def linear_mixer(cfg: ArchConfig) -> type[nn.Module]:
    """The linear layers' module class for `cfg.linear_kind`: called as
    `(cfg, dtype, methods)(x, conv_state, rec_state, md) -> (out, conv_state, rec_state)`."""
    return Mamba2Mixer if cfg.linear_kind == "mamba2" else GatedDeltaNet


def mixer_index(cfg: ArchConfig) -> np.ndarray:
    """i32[L]: each layer's index in the stack of its kind (full attention or linear)."""
    index = np.zeros(cfg.num_layers, np.int32)
    for kind in (cfg.attention_layers, cfg.linear_layers):
        index[list(kind)] = np.arange(len(kind), dtype=np.int32)
    return index


def hybrid_init(cfg: ArchConfig, init: Callable) -> Callable:
    """A hybrid's init function (RNG key -> params tree) from `init`, one that made both
    mixers' weights for every layer: each stack cut to its own layers."""
    attn_ids, lin_ids = np.asarray(cfg.attention_layers), np.asarray(cfg.linear_layers)

    def cut(key):
        params = init(key)
        layers = dict(params["layers"])
        layers[ATTENTION] = jax.tree_util.tree_map(lambda a: a[attn_ids], layers[ATTENTION])
        layers[LINEAR] = jax.tree_util.tree_map(lambda a: a[lin_ids], layers[LINEAR])
        return {**params, "layers": layers}

    return cut


def broadcast_mixers(variables: dict) -> dict:
    """The Flax variables a hybrid applies with: its two mixer stacks moved from "params"
    into `STACKS` (`layers/mixer/{attention,linear}`), which the layer scan broadcasts
    whole. Other models' variables are returned as they are."""
    layers = variables["params"].get("layers", {})
    if LINEAR not in layers:
        return variables
    rest = {k: v for k, v in layers.items() if k not in (ATTENTION, LINEAR)}
    collection = dict(variables.get(STACKS, {}))
    collection["layers"] = {**collection.get("layers", {}),
                            "mixer": {"attention": layers[ATTENTION], "linear": layers[LINEAR]}}
    return {**variables, "params": {**variables["params"], "layers": rest},
            STACKS: collection}


class HybridMixer(nn.Module):
    """A hybrid's token mixer in the layer scan: the layer's gated `Attention` over its
    pool slot of the pages when it is a full-attention layer, its linear mixer over its
    row of the state pools otherwise.

    The kind is traced (the layer scan's index), so each layer picks its branch with
    `jax.lax.cond`; but no branch carries the page pool or the state pools: XLA copied a
    buffer that one branch updates and the other passes through, the whole page pool every
    layer. The first cond gives either the linear mixer's output and its requests' new
    state rows, or the attention's (q, gate, k, v); then K/V are written (nowhere on a
    linear layer: every token's slot is the null page's) and the state rows scattered
    (dropped on an attention layer), both in place outside the cond; the second cond attends
    over the pages (read only) on an attention layer.

    Attributes:
        cfg: Architecture config with `linear_layers`.
        dtype: Parameter dtype.
        methods: The model's methods.
        attention_cls: The full-attention module class (`models.decoder.Attention`).
    """

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods
    attention_cls: type

    @nn.compact
    def __call__(self, x, cos, sin, cache: HybridCache, layer, window, md: AttentionMetadata):
        """x [T, H] -> ([T, H], cache) through layer `layer`'s (i32[]) mixer.

        Raises:
            ValueError: The variables lack the stacks (applied without `broadcast_mixers`).
        """
        attn = self.get_variable(STACKS, "attention")
        lin = self.get_variable(STACKS, "linear")
        if attn is None or lin is None:
            raise ValueError("a hybrid model's mixer stacks are not in the "
                             f"{STACKS!r} collection; apply it with "
                             "models.model.variables(params)")
        cfg, args = self.cfg, (self.cfg, self.dtype, self.methods)
        kinds = np.isin(np.arange(cfg.num_layers), cfg.linear_layers)  # bool[L]: linear
        is_linear = jnp.asarray(kinds)[layer]  # bool[]
        index = jnp.asarray(mixer_index(cfg))[layer]  # i32[]: the layer in its kind's stack
        at = lambda tree: jax.tree_util.tree_map(lambda a: a[index], tree)
        attention = lambda phase: self.attention_cls(*args, phase=phase, parent=None)
        slots = md.state_slots  # i32[R]: each request's state slot (0: the null slot)
        rows = jnp.arange(slots.shape[0], dtype=jnp.int32)  # the kernels' slots in the rows
        qkv_shapes = jax.eval_shape(
            lambda: attention("qkv").apply({"params": at(attn)}, x, cos, sin, None, index,
                                           window, md))

        def run_linear(x, conv, rec):
            # f32[R, W - 1, C] and the recurrent state's [R, ...]: the step's requests' rows
            conv_rows, rec_rows = conv[index, slots], rec[index, slots]
            out, conv_rows, rec_rows = linear_mixer(cfg)(*args, parent=None).apply(
                {"params": at(lin)}, x, conv_rows, rec_rows,
                dataclasses.replace(md, state_slots=rows))
            qkv = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), qkv_shapes)
            return out, conv_rows, rec_rows, qkv

        def run_qkv(x, conv, rec):
            qkv = attention("qkv").apply({"params": at(attn)}, x, cos, sin, None, index,
                                         window, md)
            zeros = lambda a: jnp.zeros((slots.shape[0], *a.shape[2:]), a.dtype)
            return jnp.zeros_like(x), zeros(conv), zeros(rec), qkv

        out, conv_rows, rec_rows, (q, gate, k, v) = jax.lax.cond(
            is_linear, run_linear, run_qkv, x, cache.conv, cache.recurrent)
        ops = self.methods.attention
        pages = ops.write_kv(cache.pages, jnp.where(is_linear, 0, index), k, v,
                             jnp.where(is_linear, 0, md.slot_mapping))
        # An attention layer's rows go out of range and are dropped.
        put = jnp.where(is_linear, slots, cache.conv.shape[1])  # i32[R]
        layer_at = jnp.minimum(index, cache.conv.shape[0] - 1)
        conv = cache.conv.at[layer_at, put].set(conv_rows, mode="drop")
        rec = cache.recurrent.at[layer_at, put].set(rec_rows, mode="drop")
        out = jax.lax.cond(
            is_linear, lambda q, gate, pages: out,
            lambda q, gate, pages: attention("attend").apply(
                {"params": at(attn)}, (q, gate), cos, sin, pages, index, window, md),
            q, gate, pages)
        return out, HybridCache(pages, conv, rec)
