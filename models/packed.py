"""Packed weights: the `cpu` backend's serving form of a float32 or q8/q4 model (panel mode).

The CPU matmul kernel (`pallas_kernels/cpu_ffi/gemm.py`) multiplies by layer `i` of a whole
weight stack f32[L, K, N] packed into 16-column panels f32[L, P, K, 16] (P = 3 ceil(N / 48),
zero-padded), read in place with the traced layer index: the layer scan makes no per-layer
copy of the weights, and the panels spread over XLA's thread pool. The LM head [hidden,
vocab] is packed the same way, as f32[1, P, hidden, 16]; a tied embedding looks tokens up
in the head's panels (one copy of the table).

`pack_model` moves each such weight out of the "params" collection into `COLLECTION`,
packed, at the same module path and leaf name (`layers/self_attn/q_proj/kernel`, ...,
`lm_head/kernel`, or `embed_tokens/embedding` when tied; biases and norms stay), and lists
the modules in the plan (`QuantPlan.packed`), from which `models.qlayers.dense` and `embed`
pick `PackedDense` and `PackedEmbed` as they pick quantized layers. The model's `params`
is then the Flax variables dict {"params": ..., COLLECTION: ...}, and the layer scan
broadcasts COLLECTION whole to every layer (`models/decoder.py`). `unpack_model` undoes it.
The worker packs a model it serves on the `cpu` backend (`serving_model`); loaders never
do, and checkpoints are written unpacked.

A quantized model (`models.quant`: q8 or q4 leaves) is packed the same way, leaf by leaf:
each quantized layer matmul's and LM head's "qweight", "scales" (and "zeros") become
[L, P, rows, 16] panels (`pallas_kernels/cpu_ffi/qgemm.py`) under the module's path in
`COLLECTION`, read in place by the CPU quantized matmul kernel, which dequantizes them in
registers; `PackedDense` and `PackedEmbed` take the plan's format (`fmt`).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from models.config import ArchConfig
from models.quant import QuantFormat, QuantPlan
from pallas_kernels.cpu_ffi import gemm, qgemm
from pallas_kernels.quant_matmul.reference import dequantize

COLLECTION = "packed"  # the Flax variable collection of the packed weights
# (parent module, module) of every layer matmul that is packed.
LAYER_MATMULS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                 ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
                 ("mlp", "down_proj"))


class PackedDense(nn.Module):
    """A Dense layer whose kernel is layer `layer` of the packed stack at its path in
    `COLLECTION` (only its bias, if any, is a parameter of its own): float32 panels
    ("kernel", the CPU matmul kernel) or, with `fmt`, the quantized leaves' panels
    ("qweight", "scales"[, "zeros"], the CPU quantized matmul kernel)."""

    features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32
    layer: int | jax.Array = 0  # i32[] (traced inside the layer scan)
    fmt: QuantFormat | None = None
    rows: jax.Array | None = None  # i32[]: x's real rows (the rest is padding, y's rows 0)

    @nn.compact
    def __call__(self, x: jax.Array, rows: jax.Array | None = None) -> jax.Array:
        """y [T, features] of x [T, in]; `rows` (default `self.rows`) as that attribute."""
        rows = self.rows if rows is None else rows
        if self.fmt is None:
            y = gemm.stacked_gemm(x, _packed(self, "kernel"), self.layer, self.features, rows)
        else:
            leaves = {name: _packed(self, name) for name in qgemm.LEAVES[self.fmt.kind]}
            y = qgemm.stacked_qgemm(x, leaves, self.fmt.kind, self.layer, self.features, rows)
        y = y.astype(self.dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class PackedEmbed(nn.Module):
    """A tied embedding stored as the LM head's panels (at its path in `COLLECTION`): leaf
    "embedding" f32[1, P, hidden, 16], or with `fmt` the quantized leaves' panels
    ("qweight", "scales"[, "zeros"], [1, P, rows, 16]). `attend` is the LM head matmul
    (the CPU matmul kernels), `__call__` looks tokens up in the same panels (one copy of
    the table)."""

    num_embeddings: int
    features: int
    fmt: QuantFormat | None = None

    def __call__(self, ids: jax.Array) -> jax.Array:
        """f32[T, hidden] rows of `ids` i32[T]: column id % 16 of panel id // 16."""
        if self.fmt is None:
            return _packed(self, "embedding")[0, ids // gemm.PANEL, :, ids % gemm.PANEL]
        cols = qgemm.columns({name: _packed(self, name) for name in qgemm.LEAVES[self.fmt.kind]},
                             ids)  # [rows, T] each
        return dequantize(cols, self.fmt.kind).T

    def attend(self, h: jax.Array, rows: jax.Array | None = None) -> jax.Array:
        """f32[T, vocab] logits of hidden states h [T, hidden]: of the first `rows` (i32[]
        or None: all) only, the rest 0."""
        h = h.astype(jnp.float32)
        if self.fmt is None:
            return gemm.stacked_gemm(h, _packed(self, "embedding"), 0, self.num_embeddings, rows)
        leaves = {name: _packed(self, name) for name in qgemm.LEAVES[self.fmt.kind]}
        return qgemm.stacked_qgemm(h, leaves, self.fmt.kind, 0, self.num_embeddings, rows)


def _packed(module: nn.Module, name: str) -> jax.Array:
    """The module's packed weight; ValueError when the variables lack it."""
    w = module.get_variable(COLLECTION, name)
    if w is None:
        raise ValueError(f"{'/'.join(module.path)}: no packed weight {name!r} in the "
                         f"{COLLECTION!r} collection; build the model unpacked and pack it "
                         "with models.packed.pack_model")
    return w


def can_pack(model) -> bool:
    """Whether `model` can serve packed: the `cpu` backend, float32 compute on one device,
    a dense model (not a mixture of experts), and the CPU matmul kernel builds here; a
    quantized model also needs every layer matmul in a format the quantized kernel
    multiplies (`quant_packable`) and that kernel built."""
    if model.backend != "cpu" or jnp.dtype(model.dtype) != jnp.float32:
        return False
    if model.cfg.is_moe:  # NOTE: the experts are grouped matmuls, not packed panels
        return False
    if model.quant and not quant_packable(model.quant, model.cfg):
        return False
    leaves = jax.tree_util.tree_leaves(model.params)
    if any(len(x.sharding.device_set) > 1 for x in leaves if isinstance(x, jax.Array)):
        return False  # a tensor-parallel layout: the engine serves it on "xla"
    return gemm.available() and (not model.quant or qgemm.available())


def quant_packable(plan: QuantPlan, cfg: ArchConfig) -> bool:
    """Whether every layer matmul and the LM head (the tied embedding) that `plan`
    quantizes has a format the CPU quantized matmul kernel multiplies (q8 with any block
    dividing its input size, q4 in blocks of 32)."""
    head = "embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    for name in (*(name for _, name in LAYER_MATMULS), head):
        fmt = plan.get(name)
        k = cfg.hidden_size if name == head else _in_features(cfg, name)
        if fmt is not None and not qgemm.supports(fmt.kind, k, fmt.block_for(k)):
            return False
    return True


def is_packed(model) -> bool:
    """Whether `model` is in the packed form."""
    return bool(model.quant.packed)


def pack_model(model):
    """`model` in the packed form (the same model when it already is).

    Raises:
        ValueError: A model that cannot serve packed (`can_pack`).
    """
    if is_packed(model):
        return model
    if not can_pack(model):
        raise ValueError("packing the weights needs the 'cpu' backend with float32, "
                         "unquantized or q8/q4 weights on one device and the CPU matmul "
                         "kernels (got "
                         f"backend {model.backend!r}, dtype {jnp.dtype(model.dtype).name}, "
                         f"quantization {model.quant.to_dict() or None})")
    tied = model.cfg.tie_word_embeddings
    modules = (*(name for _, name in LAYER_MATMULS), "embed_tokens" if tied else "lm_head")
    return dataclasses.replace(model, params=pack_params(model.params, model.quant),
                               quant=dataclasses.replace(model.quant, packed=modules))


def unpack_model(model):
    """`model` in the standard form (the same model when it already is)."""
    if not is_packed(model):
        return model
    return dataclasses.replace(model, params=unpack_params(model.params, model.cfg),
                               quant=dataclasses.replace(model.quant, packed=()))


def pack_params(params: dict, plan: QuantPlan | None = None) -> dict:
    """The variables {"params": ..., COLLECTION: ...} of a standard params tree (new
    dicts; the input is left as it was). A layer matmul or LM head `plan` quantizes is
    packed as its quantized leaves' panels (`qgemm.pack`; an untied quantized embedding
    stays in "params")."""
    plan = plan or QuantPlan()
    rest = jax.tree_util.tree_map(lambda x: x, params)  # a copy of the dicts
    packed = {"layers": {}}
    for parent, name in LAYER_MATMULS:
        leaf = rest["layers"][parent][name]
        fmt = plan.get(name)
        if fmt is None:
            panels = {"kernel": gemm.pack(leaf.pop("kernel"))}
        else:
            panels = qgemm.pack({n: leaf.pop(n) for n in qgemm.LEAVES[fmt.kind]}, fmt.kind)
        packed["layers"].setdefault(parent, {})[name] = panels
        if not leaf:  # no bias left either
            del rest["layers"][parent][name]
            if not rest["layers"][parent]:
                del rest["layers"][parent]
    head = "lm_head" if "lm_head" in rest else "embed_tokens"  # tied: the embedding
    fmt, leaf = plan.get(head), rest.pop(head)
    if fmt is not None:  # quantized: the [hidden, vocab] layout either way
        packed[head] = qgemm.pack({n: np.asarray(leaf[n])[None]
                                   for n in qgemm.LEAVES[fmt.kind]}, fmt.kind)
    elif head == "lm_head":
        packed["lm_head"] = {"kernel": gemm.pack(np.asarray(leaf["kernel"])[None])}
    else:  # the embedding [vocab, hidden] is the head's transpose
        packed["embed_tokens"] = {"embedding": gemm.pack(np.asarray(leaf["embedding"]).T[None])}
    return {"params": rest, COLLECTION: packed}


def unpack_params(variables: dict, cfg: ArchConfig) -> dict:
    """The standard params tree of packed variables (the inverse of `pack_params`)."""
    params = jax.tree_util.tree_map(lambda x: x, variables["params"])
    packed = variables[COLLECTION]
    for parent, name in LAYER_MATMULS:
        panels, n = packed["layers"][parent][name], _out_features(cfg, name)
        leaves = ({"kernel": gemm.unpack(panels["kernel"], n)} if "kernel" in panels
                  else qgemm.unpack(panels, n))
        params["layers"].setdefault(parent, {}).setdefault(name, {}).update(leaves)
    head = "lm_head" if "lm_head" in packed else "embed_tokens"
    panels = packed[head]
    if "qweight" in panels:
        params[head] = {n: a[0] for n, a in qgemm.unpack(panels, cfg.vocab_size).items()}
    elif head == "lm_head":
        params["lm_head"] = {"kernel": gemm.unpack(panels["kernel"], cfg.vocab_size)[0]}
    else:
        params["embed_tokens"] = {"embedding": gemm.unpack(panels["embedding"],
                                                           cfg.vocab_size)[0].T}
    return params


def _in_features(cfg: ArchConfig, name: str) -> int:
    """Input size (K) of layer matmul `name`."""
    return {"o_proj": cfg.num_heads * cfg.head_dim,
            "down_proj": cfg.intermediate_size}.get(name, cfg.hidden_size)


def _out_features(cfg: ArchConfig, name: str) -> int:
    """Output columns of layer matmul `name` (its panels are padded past them)."""
    return {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
            "v_proj": cfg.num_kv_heads * cfg.head_dim, "o_proj": cfg.hidden_size,
            "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size,
            "down_proj": cfg.hidden_size}[name]


def broadcast_experts(model):
    """A mixture-of-experts model in its serving form: the experts' stacks
    (`layers/mlp/experts`, [L, E, ...]) moved from "params" into `COLLECTION`, which the
    layer scan broadcasts whole, so a step reads only the routed experts of each layer
    (`models.moe.Experts`). Other models, and weights on several devices, are returned
    as they are (the same model when already in that form), and so is a model mixing
    sparse and dense layers, whose MLP stacks are always broadcast (`models.mixed`)."""
    params = model.params
    if not model.cfg.is_moe or model.cfg.is_mixed or "params" in params:
        return model
    leaves = jax.tree_util.tree_leaves(params)
    if any(len(x.sharding.device_set) > 1 for x in leaves if isinstance(x, jax.Array)):
        return model
    rest = jax.tree_util.tree_map(lambda x: x, params)  # a copy of the dicts
    experts = rest["layers"]["mlp"].pop("experts")
    return dataclasses.replace(model, params={
        "params": rest, COLLECTION: {"layers": {"mlp": {"experts": experts}}}})


def gather_experts(params: dict) -> dict:
    """The standard params tree of a `broadcast_experts` form (the inverse; any other tree
    is returned as it is)."""
    experts = params.get(COLLECTION, {}).get("layers", {}).get("mlp", {}).get("experts")
    if "params" not in params or experts is None:
        return params
    rest = jax.tree_util.tree_map(lambda x: x, params["params"])
    rest["layers"]["mlp"]["experts"] = experts
    return rest
