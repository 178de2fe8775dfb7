"""Maps Hugging Face tensor names onto the decoder's parameter tree and builds the tree.

The expected tree (from `jax.eval_shape` of the model's init) drives loading: every leaf
names the HF tensor(s) it needs, so a missing tensor or a wrong shape is reported with
the tensor's name and the file it came from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ArchConfig
from models.gemma4_heads import GLOBAL
from models.loaders import gdn_fused
from models.loaders.gemma4_moe_names import Gemma4MoESource
from models.loaders.gemma4_names import Gemma4Source, is_gemma4
from models.loaders.gpt_oss_names import GptOssSource, is_gpt_oss
from models.loaders.granite_names import get_granite, granite_name, is_granite
from models.loaders.llama4_names import Llama4Source, is_llama4
from models.mixed import DENSE, stack_layers
from models.quant import to_leaves


class TensorSource(Protocol):
    """Anything that serves HF-named tensors as NumPy arrays."""

    def get(self, name: str) -> np.ndarray:
        """Returns the tensor; raises `KeyError` when absent."""

    def where(self, name: str) -> str:
        """Describes where `name` lives (the file), for error messages."""


# Linear layers' leaves (`models.gated_deltanet`, `models.mamba2`) that are parameters of the
# layer itself: the HF name after the layer's module. The convolution is stored [C, 1, W]
# (`unfold_conv`).
_BARE_LEAVES = {"A_log": "A_log", "dt_bias": "dt_bias", "D": "D", "conv1d": "conv1d.weight",
                "conv1d_bias": "conv1d.bias",
                # DeepSeek-V3's router bias (`models.moe.MoEMLP`), a buffer of its `gate`
                "e_score_correction_bias": "gate.e_score_correction_bias",
                "sinks": "sinks",  # gpt-oss's attention sinks
                # Gemma 4's router (`models.gemma4_moe.Gemma4Router`)
                "router_scale": "scale", "per_expert_scale": "per_expert_scale"}
# Leaves kept in float32 whatever the model's dtype (transformers keeps them so too).
_F32_LEAVES = ("e_score_correction_bias", "sinks")
# Families whose shared experts are `mlp.shared_experts` (the decoder's `shared_expert`).
_SHARED_EXPERTS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def unfold_conv(name: str, arr: np.ndarray) -> np.ndarray:
    """A depthwise conv1d weight [C, 1, W] as [C, W] (`hf_name` transposes it to the
    decoder's [W, C], oldest tap first); other tensors as they are."""
    if name.endswith("conv1d.weight") and arr.ndim == 3 and arr.shape[1] == 1:
        return arr[:, 0, :]
    return arr


def hf_name(path: tuple[str, ...], layer: int | None) -> tuple[str, bool]:
    """HF tensor name of one parameter leaf, and whether it is stored transposed.

    Args:
        path: Leaf path in the params tree, e.g. ("layers", "self_attn", "q_proj", "kernel").
        layer: Layer index for leaves under "layers".

    Returns:
        (name, transpose): HF keeps Linear weights as [out, in]; Flax as [in, out].
    """
    *mods, leaf = path
    if mods == ["embed_tokens"]:
        return "model.embed_tokens.weight", False
    if mods == ["lm_head"]:
        return "lm_head.weight", True
    prefix = "model." + (f"layers.{layer}." if mods[0] == "layers" else "")
    mods = mods[1:] if mods[0] == "layers" else mods
    if not mods:  # a parameter of the layer itself (Gemma 4's `layer_scalar`)
        return prefix + leaf, False
    if leaf in _BARE_LEAVES:  # a linear layer's own parameters, no module around them
        return prefix + ".".join(mods) + "." + _BARE_LEAVES[leaf], leaf == "conv1d"
    suffix = "bias" if leaf == "bias" else "weight"
    return prefix + ".".join(mods) + "." + suffix, leaf == "kernel"


# Mixtral's checkpoint names for the sparse MLP (`block_sparse_moe`) and its experts.
MIXTRAL_EXPERTS = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


def family_hf_name(cfg: ArchConfig, path: tuple[str, ...], layer: int | None,
                   expert: int | None = None) -> tuple[str, bool]:
    """`hf_name` for `cfg`'s family: also the routed experts' leaves (`layers/mlp/experts/
    gate_proj` of expert `expert`: `mlp.experts.{e}.gate_proj.weight`, Mixtral's
    `block_sparse_moe.experts.{e}.w1.weight`), Mixtral's `block_sparse_moe` module, and a
    mixed model's dense MLPs (`layers/dense_mlp`: the layer's `mlp`)."""
    mixtral = cfg.architecture == "MixtralForCausalLM"
    if "experts" in path:
        leaf = path[-1]
        if leaf.endswith("_bias"):  # gpt-oss's expert biases (`models.moe.Experts`)
            proj = leaf.removesuffix("_bias") + "_proj"
            return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.bias", False
        if mixtral:
            return (f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
                    f"{MIXTRAL_EXPERTS[leaf]}.weight", True)
        return f"model.layers.{layer}.mlp.experts.{expert}.{leaf}.weight", True
    path = _dense_as_mlp(path)
    name, transpose = hf_name(path, layer)
    if mixtral and path[:2] == ("layers", "mlp"):
        name = name.replace(".mlp.", ".block_sparse_moe.", 1)
    if cfg.architecture in _SHARED_EXPERTS:
        name = name.replace(".mlp.shared_expert.", ".mlp.shared_experts.", 1)
    return name, transpose


def _dense_as_mlp(path: tuple[str, ...]) -> tuple[str, ...]:
    """A mixed model's dense-layer MLP leaf (`layers/dense_mlp/...`) and a full-attention
    layer's of a model with global heads (`layers/global_attn/...`) under the names its
    checkpoint gives them (the layer's `mlp`, `self_attn`); other paths as they are."""
    if path[:2] == ("layers", DENSE):
        return ("layers", "mlp", *path[2:])
    return ("layers", "self_attn", *path[2:]) if path[:2] == ("layers", GLOBAL) else path


# Tensors some checkpoints store fused (Phi-3), by the decoder's module: the fused module
# and the piece's index in it (rows: q, k, v; gate, up).
_FUSED = {"self_attn.q_proj": ("self_attn.qkv_proj", 0),
          "self_attn.k_proj": ("self_attn.qkv_proj", 1),
          "self_attn.v_proj": ("self_attn.qkv_proj", 2),
          "mlp.gate_proj": ("mlp.gate_up_proj", 0),
          "mlp.up_proj": ("mlp.gate_up_proj", 1)}


class SplitFused:
    """A `TensorSource` that also serves q/k/v and gate/up projections cut from a
    checkpoint's fused `qkv_proj` and `gate_up_proj` (Phi-3: rows q, then k, then v; gate,
    then up), and a Gated DeltaNet's `in_proj_qkv/z/b/a` cut from Qwen3-Next's
    `in_proj_qkvz` and `in_proj_ba` (`models.loaders.gdn_fused`), when the unfused tensor
    is absent; a Gated DeltaNet's q/k/v channels come grouped by key head
    (`gdn_fused.flat_to_grouped`). A Granite 4.0 checkpoint is read under its own module
    names (`models.loaders.granite_names`).

    Args:
        source: The checkpoint's tensors.
        cfg: Architecture config (the pieces' row counts).
    """

    def __init__(self, source: TensorSource, cfg: ArchConfig):
        # gpt-oss's stacked experts and router (`models.loaders.gpt_oss_names`).
        self.source = GptOssSource(source) if is_gpt_oss(cfg) else source
        if is_gemma4(cfg):  # tensors the layer scan needs that the checkpoint lacks
            # (and the MoE block's stacked experts: `models.loaders.gemma4_moe_names`)
            self.source = Gemma4Source(Gemma4MoESource(source, cfg) if cfg.is_moe
                                       else source, cfg)
        if is_llama4(cfg):  # its `feed_forward` names and stacked experts
            self.source = Llama4Source(source)
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self._rows = {"self_attn.qkv_proj": (q, kv, kv),
                      "mlp.gate_up_proj": (cfg.intermediate_size,) * 2}

    def _fused(self, name: str) -> tuple[str, str, int] | None:
        """(fused tensor name, fused module, piece index) for a fusable name, else None."""
        stem, _, leaf = name.rpartition(".")
        for module, (fused, index) in _FUSED.items():
            if stem.endswith("." + module):
                return f"{stem[:-len(module)]}{fused}.{leaf}", fused, index
        return None

    def get(self, name: str) -> np.ndarray:
        if is_granite(self.cfg):  # its own module names (`models.loaders.granite_names`)
            return get_granite(self.source, self.cfg, name)
        try:
            return gdn_fused.flat_to_grouped(self.cfg, name, self.source.get(name))
        except KeyError:
            linear = gdn_fused.fused_name(name)  # Qwen3-Next's fused linear projections
            if linear is not None:
                return gdn_fused.cut_piece(self.cfg, linear[0], self.source.get(linear[0]),
                                           linear[1])
            found = self._fused(name)
            if found is None:
                raise
        fused_name, fused, index = found
        arr = self.source.get(fused_name)
        sizes = self._rows[fused]
        if arr.shape[0] != sum(sizes):
            raise ValueError(
                f"tensor {fused_name!r} in {self.source.where(fused_name)} has {arr.shape[0]} "
                f"rows, expected {' + '.join(map(str, sizes))} = {sum(sizes)} for "
                f"{self.cfg.architecture}")
        start = sum(sizes[:index])
        return arr[start:start + sizes[index]]

    def where(self, name: str) -> str:
        if is_granite(self.cfg):
            return self.source.where(granite_name(name)[0])
        where = self.source.where(name)
        found = self._fused(name)
        names = getattr(self.source, "names", None)
        if found is None or names is None or name in (present := set(names())):
            return where
        if found[0] in present:  # served from the fused tensor
            return self.source.where(found[0])
        return f"{where} (nor is the fused {found[0]!r} there)"


QUANT_LEAVES = ("qweight", "scales", "zeros", "block_scales", "e8m0_scales", "e4m3_scales",
                "global_scale", "perm")


def build_params(cfg: ArchConfig, expected, source: TensorSource, dtype,
                 transform: Callable[[str, np.ndarray], np.ndarray] | None = None,
                 quant_rows: Callable[[str], dict[str, np.ndarray]] | None = None):
    """Fills the expected params tree from `source`.

    Args:
        cfg: Architecture config (for the layer count).
        expected: Tree of `jax.ShapeDtypeStruct` (the model's init under eval_shape).
        source: Where tensors come from.
        dtype: Target dtype of every float parameter.
        transform: Optional per-tensor fix-up applied before shape checks.
        quant_rows: For quantized leaves (`QUANT_LEAVES`): a tensor's row-form quantized
            leaves (see `models.quant`), kept in their own dtypes.

    Returns:
        The params tree as host NumPy arrays in `dtype` (the caller places them on devices,
        whole or shard by shard).

    Raises:
        ValueError: A tensor is missing or has the wrong shape; the message names both
            the tensor and its file.
    """

    def fetch(name: str, transpose: bool, want: tuple[int, ...]) -> np.ndarray:
        try:
            arr = source.get(name)
        except KeyError:
            raise ValueError(f"tensor {name!r} is missing from {source.where(name)}") from None
        if transform is not None:
            arr = transform(name, arr)
        arr = unfold_conv(name, arr)
        if transpose:
            arr = arr.T
        if tuple(arr.shape) != tuple(want):
            got = tuple(reversed(arr.shape)) if transpose else tuple(arr.shape)
            need = tuple(reversed(want)) if transpose else tuple(want)
            raise ValueError(
                f"tensor {name!r} in {source.where(name)} has shape {got}, expected {need} "
                f"for {cfg.architecture}"
            )
        return arr

    decoded: dict[str, dict[str, np.ndarray]] = {}

    def fetch_quant(name: str, leaf_name: str, want: tuple[int, ...]) -> np.ndarray:
        if name not in decoded:
            try:
                decoded[name] = to_leaves(quant_rows(name))
            except KeyError:
                raise ValueError(f"tensor {name!r} is missing from {source.where(name)}") from None
        # Each leaf is taken once; a tensor is decoded once and dropped after its last leaf.
        arr = decoded[name].pop(leaf_name)
        if not decoded[name]:
            del decoded[name]
        if tuple(arr.shape) != tuple(want):
            raise ValueError(f"quantized tensor {name!r} in {source.where(name)}: {leaf_name} "
                             f"has shape {arr.shape}, expected {want} for {cfg.architecture}")
        return arr

    def leaf(path, spec):
        keys = tuple(p.key for p in path)
        if keys[-1] in QUANT_LEAVES:
            if "experts" in keys:  # [L, E, ...]: one tensor per layer and expert
                return np.stack([np.stack([
                    fetch_quant(family_hf_name(cfg, keys[:-1], i, e)[0], keys[-1],
                                spec.shape[2:]) for e in range(spec.shape[1])])
                    for i in stack_layers(cfg, keys)])
            if keys[0] == "layers":
                # NOTE: the family's names (DeepSeek's `shared_experts`), as float leaves.
                return np.stack([fetch_quant(family_hf_name(cfg, keys, i)[0], keys[-1],
                                             spec.shape[1:])
                                 for i in stack_layers(cfg, keys)])
            return fetch_quant(hf_name(keys, None)[0], keys[-1], spec.shape)
        if "experts" in keys:  # [L, E, in, out]: one HF tensor per layer and expert
            per_expert = spec.shape[2:]
            arrays = [np.stack([fetch(*family_hf_name(cfg, keys, i, e), per_expert)
                                for e in range(spec.shape[1])])
                      for i in stack_layers(cfg, keys)]
            out = np.stack(arrays).astype(np.float32)
        elif keys[0] == "layers":
            per_layer = spec.shape[1:]
            arrays = [fetch(*family_hf_name(cfg, keys, i), per_layer)
                      for i in stack_layers(cfg, keys)]
            out = np.stack(arrays).astype(np.float32)
        else:
            out = fetch(*family_hf_name(cfg, keys, None), spec.shape).astype(np.float32)
        if keys[-1] in _F32_LEAVES:
            return out
        return out.astype(jnp.dtype(dtype))  # stays on the host; the caller places it

    return jax.tree_util.tree_map_with_path(leaf, expected)
