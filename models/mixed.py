"""Mixtures of experts whose layers mix sparse and dense MLPs (Qwen-MoE's `mlp_only_layers`,
`decoder_sparse_step`: `ArchConfig.dense_layers`) inside the one layer scan.

The scan slices every "params" leaf per layer, so it needs one parameter structure for all
layers. A mixed model's MLP weights are therefore two stacks of their own: the sparse
layers' `MoEMLP` weights (router `gate`, `experts`, Qwen2-MoE's shared expert)
[L_sparse, ...] at `layers/mlp`, and the dense layers' `GatedMLP` weights [L_dense, ...]
at `layers/dense_mlp` (the params tree that is loaded, saved and sharded). At apply time
`broadcast_mlp` moves both into the collection the scan broadcasts whole
(`models.linear.STACKS`, as {"sparse": ..., "dense": ...} under `layers/mlp`), and
`MixedMLP` runs one of them per layer under `jax.lax.cond` on the layer's kind, reading
its stack at the layer's index in it (`mlp_index`): a layer runs only its own MLP, the
experts read in place as in the serving form (`models.moe.Experts`). Models whose layers
are all sparse or all dense never come here: their programs are unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ArchConfig
from models.layers import GatedMLP
from models.linear import STACKS, Methods
from models.moe import MoEMLP
from models.moe_parallel import ExpertSharding

DENSE = "dense_mlp"  # the dense layers' MLP stack in the params tree, beside `mlp`


def mlp_index(cfg: ArchConfig) -> np.ndarray:
    """i32[L]: each layer's index in the stack of its kind (sparse or dense)."""
    index = np.zeros(cfg.num_layers, np.int32)
    for kind in (cfg.sparse_layers, cfg.dense_layers):
        index[list(kind)] = np.arange(len(kind), dtype=np.int32)
    return index


def stack_layers(cfg: ArchConfig, keys: tuple[str, ...]) -> list[int]:
    """The layers a stacked leaf (`keys`: its path under "layers") holds, in order: the
    sparse layers for `layers/mlp` and the dense ones for `layers/dense_mlp` of a mixed
    model, the full-attention and linear layers for a hybrid's `layers/self_attn` and
    `layers/linear_attn` (`models.hybrid`), the sliding and full-attention layers for
    `layers/self_attn` and `layers/global_attn` of a model with global heads
    (`models.gemma4_heads`), else every layer."""
    if cfg.has_linear_attention and keys[1] == "self_attn":
        return list(cfg.attention_layers)
    if cfg.has_linear_attention and keys[1] == "linear_attn":
        return list(cfg.linear_layers)
    if cfg.is_mixed and keys[1] == "mlp":
        return list(cfg.sparse_layers)
    if cfg.is_mixed and keys[1] == DENSE:
        return list(cfg.dense_layers)
    if cfg.has_global_heads and keys[1] in ("self_attn", "global_attn"):  # models.gemma4_heads
        return [i for i, w in enumerate(cfg.layer_windows) if (w == 0) == (keys[1] != "self_attn")]
    return list(range(cfg.num_layers))


def mixed_init(cfg: ArchConfig, init_of: Callable[[ArchConfig], Callable]) -> Callable:
    """A mixed model's init function (RNG key -> params tree), from `init_of(cfg)`, the
    init function of a model: the all-sparse model's weights with its MLP stacks cut to
    the sparse layers, and the all-dense model's MLPs of the dense layers as
    `layers/dense_mlp`."""
    sparse_init = init_of(dataclasses.replace(cfg, dense_layers=()))
    dense_init = init_of(dataclasses.replace(cfg, num_experts=0, dense_layers=()))
    sparse_ids, dense_ids = np.asarray(cfg.sparse_layers), np.asarray(cfg.dense_layers)

    def init(key):
        params = sparse_init(key)
        dense = dense_init(key)["layers"]["mlp"]
        layers = dict(params["layers"])
        layers["mlp"] = jax.tree_util.tree_map(lambda a: a[sparse_ids], layers["mlp"])
        layers[DENSE] = jax.tree_util.tree_map(lambda a: a[dense_ids], dense)
        return {**params, "layers": layers}

    return init


def broadcast_mlp(variables: dict) -> dict:
    """The Flax variables a mixed model applies with: its two MLP stacks moved from
    "params" into `STACKS` (`layers/mlp/{sparse,dense}`), which the layer scan
    broadcasts whole. Other models' variables are returned as they are."""
    layers = variables["params"].get("layers", {})
    if DENSE not in layers:
        return variables
    rest = {k: v for k, v in layers.items() if k not in ("mlp", DENSE)}
    collection = dict(variables.get(STACKS, {}))
    collection["layers"] = {**collection.get("layers", {}),
                            "mlp": {"sparse": layers["mlp"], "dense": layers[DENSE]}}
    return {**variables, "params": {**variables["params"], "layers": rest},
            STACKS: collection}


def first_layers(cfg: ArchConfig, params: dict, num_layers: int) -> tuple[ArchConfig, dict]:
    """A mixed model's config and params tree cut to its first `num_layers` layers (a
    truncated draft model): each MLP stack keeps its layers among them, and a model left
    with one kind of layer becomes all-sparse or dense, in that kind's usual form."""
    n = num_layers
    sparse = sum(i < n for i in cfg.sparse_layers)
    dense = tuple(i for i in cfg.dense_layers if i < n)
    cut = lambda tree, k: jax.tree_util.tree_map(lambda a: a[:k], tree)
    layers = {k: cut(v, n) for k, v in params["layers"].items() if k not in ("mlp", DENSE)}
    cfg = dataclasses.replace(cfg, num_layers=n, layer_windows=cfg.layer_windows[:n],
                              dense_layers=dense if sparse else ())
    if sparse:
        layers["mlp"] = cut(params["layers"]["mlp"], sparse)
    else:  # every layer left is dense: a dense model
        cfg = dataclasses.replace(cfg, num_experts=0, num_experts_per_tok=0,
                                  moe_intermediate_size=0, shared_expert_intermediate_size=0)
        layers["mlp"] = cut(params["layers"][DENSE], len(dense))
    if sparse and dense:
        layers[DENSE] = cut(params["layers"][DENSE], len(dense))
    return cfg, {**params, "layers": layers}


class MixedMLP(nn.Module):
    """A mixed model's MLP in the layer scan: the layer's `MoEMLP` when it is sparse, its
    dense `GatedMLP` otherwise, as a `jax.lax.cond` on the (traced) layer, each branch
    reading layer `mlp_index(cfg)[layer]` of its stack in `STACKS` (`broadcast_mlp`).

    Attributes:
        cfg: Architecture config with `dense_layers`.
        dtype: Parameter dtype.
        methods: The model's methods (both MLPs use them as they would alone).
        sharding: How a device mesh splits the sparse layers' experts
            (`models.moe_parallel`), handed to their `MoEMLP`; None: one device.
        return_ids: Also return the routed expert ids (`MoEMLP.return_ids`).
    """

    cfg: ArchConfig
    dtype: jnp.dtype
    methods: Methods
    sharding: ExpertSharding | None = None
    return_ids: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, layer: jax.Array):
        """x [T, H] -> [T, H] through layer `layer`'s (i32[]) MLP; with `return_ids`,
        (that, i32[T, top_k] the routed experts, -1 on a dense layer).

        Raises:
            ValueError: The variables lack the stacks (applied without `broadcast_mlp`).
        """
        sparse = self.get_variable(STACKS, "sparse")
        dense = self.get_variable(STACKS, "dense")
        if sparse is None or dense is None:
            raise ValueError("a mixed model's MLP stacks are not in the "
                             f"{STACKS!r} collection; apply it with "
                             "models.model.variables(params)")
        cfg, args = self.cfg, (self.cfg, self.dtype, self.methods)
        kinds = np.isin(np.arange(cfg.num_layers), cfg.sparse_layers)  # bool[L]: sparse
        is_sparse = jnp.asarray(kinds)[layer]  # bool[]
        index = jnp.asarray(mlp_index(cfg))[layer]  # i32[]: the layer in its kind's stack
        at = lambda tree: jax.tree_util.tree_map(lambda a: a[index], tree)

        def run_sparse(x):
            # NOTE: the experts stay whole ([L_sparse, E, ...]): they read their layer.
            small = {k: v for k, v in sparse.items() if k != "experts"}
            return MoEMLP(*args, sharding=self.sharding, return_ids=self.return_ids,
                          parent=None).apply(
                {"params": at(small), STACKS: {"experts": sparse["experts"]}}, x, index)

        def run_dense(x):
            out = GatedMLP(*args, parent=None).apply({"params": at(dense)}, x)
            if not self.return_ids:
                return out
            return out, jnp.full((x.shape[0], cfg.num_experts_per_tok), -1, jnp.int32)

        return jax.lax.cond(is_sparse, run_sparse, run_dense, x)
