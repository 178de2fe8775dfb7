"""Panel mode of the `cpu` backend: the decoder layers' matmul weights stored packed and
stacked (`pallas_kernels.cpu_ffi.gemm`) instead of as per-layer `kernel`s.

In panel mode `params["layer_panels"]` maps each projection name to f32[L, P, K, 16] and
the layers' `kernel` leaves are gone (biases and norms stay where they were); the LM head
[hidden, vocab] is packed too, as f32[1, P, hidden, 16] under `embed_tokens/panels` when
it is tied to the embedding (which then looks tokens up in it: one copy) or
`lm_head/panels` when not. `Model` converts on construction, both ways (`to_panels` /
`from_panels`), so callers may hand it either form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ArchConfig

# (parent module, projection) of every layer matmul the panels replace.
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
               ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
               ("mlp", "down_proj"))
KEY = "layer_panels"


def out_features(cfg: ArchConfig, name: str) -> int:
    """Output columns of projection `name`."""
    return {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
            "v_proj": cfg.num_kv_heads * cfg.head_dim, "o_proj": cfg.hidden_size,
            "gate_proj": cfg.intermediate_size, "up_proj": cfg.intermediate_size,
            "down_proj": cfg.hidden_size}[name]


def in_features(cfg: ArchConfig, name: str) -> int:
    """Input width of projection `name`."""
    return {"o_proj": cfg.num_heads * cfg.head_dim,
            "down_proj": cfg.intermediate_size}.get(name, cfg.hidden_size)


def panel_shapes(cfg: ArchConfig) -> dict[str, tuple[int, ...]]:
    """{projection: shape of its stacked panels}."""
    from pallas_kernels.cpu_ffi.gemm import PANEL, num_panels

    return {name: (cfg.num_layers, num_panels(out_features(cfg, name)), in_features(cfg, name),
                   PANEL) for _, name in PROJECTIONS}


def eligible(params: dict, dtype, quant, backend: str) -> bool:
    """Whether a model can serve in panel mode: the `cpu` backend, float32 unquantized
    weights on one device, and the kernel builds here."""
    if backend != "cpu" or jnp.dtype(dtype) != jnp.float32 or quant:
        return False
    leaves = jax.tree_util.tree_leaves(params)
    if any(len(x.sharding.device_set) > 1 for x in leaves if isinstance(x, jax.Array)):
        return False  # a tensor-parallel layout: the engine serves it on "xla"
    from pallas_kernels.cpu_ffi import gemm

    return gemm.available()


def is_panel_tree(params: dict) -> bool:
    """Whether `params` is in panel form."""
    return KEY in params


def to_panels(params: dict) -> dict:
    """The panel-form tree of a standard one (new dicts; the input is left as it was)."""
    from pallas_kernels.cpu_ffi.gemm import pack

    layers = jax.tree_util.tree_map(lambda x: x, params["layers"])  # a copy of the dicts
    panels = {}
    for parent, name in PROJECTIONS:
        leaf = layers[parent][name]
        panels[name] = pack(leaf.pop("kernel"))
        if not leaf:  # no bias left either
            del layers[parent][name]
            if not layers[parent]:
                del layers[parent]
    head = {}
    if "lm_head" in params:
        head["lm_head"] = {"panels": pack(np.asarray(params["lm_head"]["kernel"])[None])}
    else:  # tied: the embedding [vocab, hidden] is the head's transpose
        head["embed_tokens"] = {
            "panels": pack(np.asarray(params["embed_tokens"]["embedding"]).T[None])}
    return {**params, **head, "layers": layers, KEY: panels}


def from_panels(params: dict, cfg: ArchConfig) -> dict:
    """The standard tree of a panel-form one."""
    from pallas_kernels.cpu_ffi.gemm import unpack

    layers = jax.tree_util.tree_map(lambda x: x, params["layers"])
    for parent, name in PROJECTIONS:
        kernel = unpack(params[KEY][name], out_features(cfg, name))
        layers.setdefault(parent, {}).setdefault(name, {})["kernel"] = kernel
    head = {}
    if "lm_head" in params:
        head["lm_head"] = {"kernel": unpack(params["lm_head"]["panels"], cfg.vocab_size)[0]}
    else:
        head["embed_tokens"] = {
            "embedding": unpack(params["embed_tokens"]["panels"], cfg.vocab_size)[0].T}
    return {k: v for k, v in params.items() if k != KEY} | head | {"layers": layers}


def truncate(params: dict, num_layers: int) -> dict:
    """Panels of the first `num_layers` layers only (for a truncated draft model)."""
    return {**params, KEY: {k: v[:num_layers] for k, v in params[KEY].items()}}
