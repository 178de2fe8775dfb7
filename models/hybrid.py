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
    row of the state pools otherwise, as a `jax.lax.cond` on the (traced) layer.

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

        def run_attention(x, cache):
            out, pages = self.attention_cls(*args, parent=None).apply(
                {"params": at(attn)}, x, cos, sin, cache.pages, None, window, md, index)
            return out, cache._replace(pages=pages)

        def run_linear(x, cache):
            out, conv, rec = linear_mixer(cfg)(*args, parent=None).apply(
                {"params": at(lin)}, x, cache.conv[index], cache.recurrent[index], md)
            return out, cache._replace(conv=cache.conv.at[index].set(conv),
                                       recurrent=cache.recurrent.at[index].set(rec))

        return jax.lax.cond(is_linear, run_linear, run_attention, x, cache)
