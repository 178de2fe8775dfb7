"""Qwen2.5-VL's vision tower in plain JAX, as transformers'
`Qwen2_5_VisionTransformerPretrainedModel`: the config, the weights read from a checkpoint, and
`encode_images`, patches to the embeddings the decoder's `<|image_pad|>` tokens take."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import apply_rope
from models.loaders.hf_names import TensorSource
from models.vision.qwen2_5_vl_layout import Segments, vision_layout

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu": functools.partial(jax.nn.gelu, approximate=False),
                "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}
_MODEL_TYPES = ("qwen2_5_vl_vision", "qwen2_5_vl")  # the second: old checkpoints' spelling
PREFIXES = ("visual.", "model.visual.")  # transformers 5 saves `visual.`, as the Hub's files
NORM_EPS = 1e-6  # transformers hard-codes the vision RMSNorms' epsilon


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    """Qwen2.5-VL's vision tower (`vision_config` of config.json). Hashable: `encode_images`
    takes it as a static argument.

    Attributes:
        depth: Vision blocks.
        hidden_size: Width of the blocks.
        intermediate_size: Width of the blocks' gated MLP.
        num_heads: Attention heads (head_dim = hidden_size / num_heads).
        in_channels: Image channels.
        patch_size: Patch side in pixels.
        temporal_patch_size: Frames in one patch (an image is repeated that many times).
        spatial_merge_size: Patches merged into one output token, a side.
        window_size: Side of an attention window, in pixels.
        out_hidden_size: Width of the output tokens (the decoder's hidden size).
        fullatt_block_indexes: Blocks that attend over the whole image (the others by window).
        hidden_act: The blocks' MLP activation.
        rope_theta: Base of the 2-D rotary's frequencies.
    """

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def window_units(self) -> int:
        """Merged units along a window's side (transformers' `vit_merger_window_size`)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_hf(cls, vision_config: dict) -> QwenVisionConfig:
        """Reads config.json's `vision_config`, transformers' `Qwen2_5_VLVisionConfig`
        defaults where it is silent.

        Raises:
            ValueError: A field this tower cannot serve, named: another `model_type` (Qwen2-VL's
                tower differs), a non-axial `rope_parameters.rope_type`, an unknown
                `hidden_act`, `hidden_size` not a multiple of `num_heads` or a head_dim not a
                multiple of 4 (the 2-D rotary's halves), a list `patch_size`, a `window_size`
                under one merged patch, a `fullatt_block_indexes` entry outside the blocks.
        """
        hf = vision_config
        model_type = hf.get("model_type", _MODEL_TYPES[0])
        if model_type not in _MODEL_TYPES:
            raise ValueError(f"vision_config.model_type {model_type!r} is not Qwen2.5-VL's "
                             f"vision tower ({_MODEL_TYPES[0]!r})")
        d = cls()
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r}: "
                             "only 'axial' (the 2-D rotary) is served")
        for name in ("patch_size", "temporal_patch_size"):
            if not isinstance(hf.get(name, 1), int):
                raise ValueError(f"vision_config.{name} {hf[name]!r}: only an integer is served")
        cfg = cls(depth=int(hf.get("depth", d.depth)),
                  hidden_size=int(hf.get("hidden_size", d.hidden_size)),
                  intermediate_size=int(hf.get("intermediate_size", d.intermediate_size)),
                  num_heads=int(hf.get("num_heads", hf.get("num_attention_heads", d.num_heads))),
                  in_channels=int(hf.get("in_channels", hf.get("in_chans", d.in_channels))),
                  patch_size=hf.get("patch_size", d.patch_size),
                  temporal_patch_size=hf.get("temporal_patch_size", d.temporal_patch_size),
                  spatial_merge_size=int(hf.get("spatial_merge_size", d.spatial_merge_size)),
                  window_size=int(hf.get("window_size", d.window_size)),
                  out_hidden_size=int(hf.get("out_hidden_size", d.out_hidden_size)),
                  fullatt_block_indexes=tuple(int(i) for i in hf.get(
                      "fullatt_block_indexes", d.fullatt_block_indexes)),
                  hidden_act=str(hf.get("hidden_act", d.hidden_act)),
                  rope_theta=float(rope.get("rope_theta", d.rope_theta)))
        cfg.check()
        return cfg

    def check(self) -> None:
        """Raises a ValueError naming the first field this tower cannot serve."""
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {self.hidden_act!r} is not one of "
                             f"{sorted(_ACTIVATIONS)}")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(f"vision_config.hidden_size {self.hidden_size} over num_heads "
                             f"{self.num_heads} must be a head_dim that is a multiple of 4")
        if self.window_units < 1:
            raise ValueError(f"vision_config.window_size {self.window_size} is under one merged "
                             f"patch ({self.patch_size * self.spatial_merge_size} pixels)")
        outside = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if outside:
            raise ValueError(f"vision_config.fullatt_block_indexes {outside} are outside the "
                             f"{self.depth} blocks")


def _read(source: TensorSource, name: str, shape: tuple[int, ...], dtype) -> np.ndarray:
    try:
        arr = source.get(name)
    except KeyError:
        raise ValueError(f"the checkpoint has no tensor {name!r}") from None
    if tuple(arr.shape) != shape:
        raise ValueError(f"tensor {name!r} in {source.where(name)} has shape {tuple(arr.shape)}, "
                         f"the vision config needs {shape}")
    return np.asarray(arr, dtype=dtype)


def find_prefix(source: TensorSource) -> str:
    """The prefix of the vision tower's tensors in `source`: the first of `PREFIXES` that holds
    `patch_embed.proj.weight`.

    Raises:
        ValueError: None does.
    """
    for prefix in PREFIXES:
        try:
            source.get(prefix + "patch_embed.proj.weight")
        except KeyError:
            continue
        return prefix
    raise ValueError(f"the checkpoint has no vision tower under any of {list(PREFIXES)}")


def load_qwen_vision(source: TensorSource, cfg: QwenVisionConfig, prefix: str | None = None,
                     dtype=jnp.float32) -> dict:
    """Reads the vision tower's weights, as `encode_images` takes them.

    Args:
        source: The checkpoint (e.g. `models.loaders.safetensors_dir.SafetensorsDir`).
        cfg: The tower's config.
        prefix: The tensors' prefix (`visual.` or `model.visual.`); None finds it.
        dtype: The arrays' dtype.

    Returns:
        {"patch_embed": [C*T*P*P, D], "blocks": {leaf: [depth, ...]}, "merger": {...}}: matmul
        weights as [in, out]; each block leaf stacked over the blocks (the tower scans them).

    Raises:
        ValueError: A tensor is missing or has another shape than `cfg` gives (named).
    """
    prefix = find_prefix(source) if prefix is None else prefix
    d, i, m2 = cfg.hidden_size, cfg.intermediate_size, cfg.spatial_merge_size ** 2
    p, t = cfg.patch_size, cfg.temporal_patch_size

    def get(name, shape):
        return _read(source, prefix + name, shape, np.float32)

    patch = get("patch_embed.proj.weight", (d, cfg.in_channels, t, p, p)).reshape(d, -1).T
    block_leaves = {  # leaf: (tensor name, shape as stored, transposed)
        "norm1": ("norm1.weight", (d,), False), "norm2": ("norm2.weight", (d,), False),
        "qkv_w": ("attn.qkv.weight", (3 * d, d), True), "qkv_b": ("attn.qkv.bias", (3 * d,), False),
        "proj_w": ("attn.proj.weight", (d, d), True), "proj_b": ("attn.proj.bias", (d,), False),
        "gate_w": ("mlp.gate_proj.weight", (i, d), True),
        "gate_b": ("mlp.gate_proj.bias", (i,), False),
        "up_w": ("mlp.up_proj.weight", (i, d), True), "up_b": ("mlp.up_proj.bias", (i,), False),
        "down_w": ("mlp.down_proj.weight", (d, i), True),
        "down_b": ("mlp.down_proj.bias", (d,), False)}
    blocks = {}
    for leaf, (name, shape, transposed) in block_leaves.items():
        stack = [get(f"blocks.{b}.{name}", shape) for b in range(cfg.depth)]
        blocks[leaf] = jnp.asarray(np.stack([a.T if transposed else a for a in stack]), dtype)
    merger = {"ln_q": get("merger.ln_q.weight", (d,)),
              "fc1_w": get("merger.mlp.0.weight", (m2 * d, m2 * d)).T,
              "fc1_b": get("merger.mlp.0.bias", (m2 * d,)),
              "fc2_w": get("merger.mlp.2.weight", (cfg.out_hidden_size, m2 * d)).T,
              "fc2_b": get("merger.mlp.2.bias", (cfg.out_hidden_size,))}
    return {"patch_embed": jnp.asarray(patch, dtype), "blocks": blocks,
            "merger": {k: jnp.asarray(v, dtype) for k, v in merger.items()}}


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + NORM_EPS)
    return scale * x32.astype(x.dtype)


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, seg: Segments) -> jax.Array:
    """Bidirectional attention within each segment (transformers' loop over `cu_seqlens`).

    The segments are gathered into a padded batch and attended with a key mask, so the work is
    sum(max_len^2) per head, not num_tokens^2. A ragged (varlen) flash kernel over the same
    segments (vLLM's `flash_attn_varlen_func` on cu_seqlens, a Pallas segment-ids kernel on TPU)
    would replace this body.

    Args:
        q, k, v: f32[num_tokens, num_heads, head_dim], the segments consecutive in them.
        seg: The static segment tables.

    Returns:
        f32[num_tokens, num_heads, head_dim].
    """
    gather = jnp.asarray(seg.gather)  # i32[S, L]
    qs, ks, vs = q[gather], k[gather], v[gather]  # [S, L, H, hd]
    scores = jnp.einsum("sqhd,skhd->shqk", qs, ks,
                        preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
    mask = jnp.asarray(seg.valid)[:, None, None, :]  # bool[S, 1, 1, L]: real keys only
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1).astype(v.dtype)
    out = jnp.einsum("shqk,skhd->sqhd", probs, vs)  # [S, L, H, hd]
    return out.reshape(-1, *out.shape[2:])[jnp.asarray(seg.scatter)]


@functools.partial(jax.jit, static_argnames=("cfg", "grid_thw"))
def encode_images(params: dict, cfg: QwenVisionConfig, patches: jax.Array,
                  grid_thw: tuple[tuple[int, int, int], ...]) -> jax.Array:
    """Qwen2.5-VL's vision tower over one or more images in one call.

    A grid with t > 1 (a video's frames) is laid out as transformers does (windows and full
    attention per frame), but only images (t = 1, the processor's) are tested.

    Args:
        params: `load_qwen_vision`'s tree.
        cfg: The tower's config (static).
        patches: f32[sum(t*h*w), C*T*P*P]: the images' patches one after another, each as
            `jaxserve.multimodal.processors.QwenVLProcessor` gives them.
        grid_thw: Each image's (t, h, w) patch grid, static: one program per tuple of sizes
            (the engine buckets images by size).

    Returns:
        f32[sum(t*h*w) / merge^2, out_hidden_size]: one embedding per placeholder token, the
        images' in order.
    """
    layout = vision_layout(tuple(tuple(int(x) for x in g) for g in grid_thw),
                           cfg.spatial_merge_size, cfg.window_units)
    unit, d, heads = cfg.spatial_merge_size ** 2, cfg.hidden_size, cfg.num_heads
    x = patches.astype(params["patch_embed"].dtype) @ params["patch_embed"]  # [N, D]
    n = x.shape[0]
    # The blocks run in window order: each window's tokens consecutive.
    x = x.reshape(n // unit, unit, d)[jnp.asarray(layout.window_index)].reshape(n, d)
    inv_freq = 1.0 / cfg.rope_theta ** (jnp.arange(0, d // heads // 2, 2, dtype=jnp.float32)
                                        / (d // heads // 2))  # f32[head_dim / 4]
    freqs = jnp.asarray(layout.positions, jnp.float32)[:, :, None] * inv_freq  # [N, 2, hd/4]
    freqs = freqs.reshape(n, -1)  # f32[N, head_dim / 2]: rows' bands, then columns'
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # f32[N, head_dim]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    act = _ACTIVATIONS[cfg.hidden_act]
    full = np.zeros(cfg.depth, bool)
    full[list(cfg.fullatt_block_indexes)] = True

    def attend(is_full, q, k, v):
        if full.all() or not full.any():  # one kind only: no branch
            return segment_attention(q, k, v, layout.frames if full.all() else layout.windows)
        return jax.lax.cond(is_full, lambda *a: segment_attention(*a, layout.frames),
                            lambda *a: segment_attention(*a, layout.windows), q, k, v)

    def block(x, xs):
        w, is_full = xs
        h = _rms_norm(x, w["norm1"])
        qkv = (h @ w["qkv_w"] + w["qkv_b"]).reshape(n, 3, heads, -1)  # [N, 3, H, hd]
        # The rotary in float32 whatever the weights' dtype, as transformers turns them.
        q, k = (apply_rope(qkv[:, j].astype(jnp.float32), cos, sin).astype(x.dtype)
                for j in (0, 1))
        x = x + attend(is_full, q, k, qkv[:, 2]).reshape(n, d) @ w["proj_w"] + w["proj_b"]
        h = _rms_norm(x, w["norm2"])
        mlp = act(h @ w["gate_w"] + w["gate_b"]) * (h @ w["up_w"] + w["up_b"])
        return x + mlp @ w["down_w"] + w["down_b"], None

    x, _ = jax.lax.scan(block, x, (params["blocks"], jnp.asarray(full)))
    m = params["merger"]
    h = _rms_norm(x, m["ln_q"]).reshape(n // unit, unit * d)  # [N / merge^2, merge^2 * D]
    h = jax.nn.gelu(h @ m["fc1_w"] + m["fc1_b"], approximate=False)
    out = h @ m["fc2_w"] + m["fc2_b"]  # [N / merge^2, out_hidden_size], window order
    return out[jnp.asarray(layout.reverse_index)]
