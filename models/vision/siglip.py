"""SigLIP's vision transformer (Gemma 3's vision tower) and Gemma 3's multimodal projector:
an image's pixels to the soft tokens that stand in for its placeholders in the prompt.

The tower, as transformers' `SiglipVisionModel` without its pooling head (Gemma 3 reads the
last hidden state): non-overlapping patches embedded by one matmul (the conv's kernel is
the patch), learned position embeddings, pre-LayerNorm blocks of bidirectional multi-head
attention and a tanh-GELU MLP, a final LayerNorm. The projector, as
`Gemma3MultiModalProjector`: the patch grid average-pooled to `mm_tokens_per_image`
tokens, a Gemma RMSNorm (weight + 1), one matmul into the text model's width.

Plain jnp, jitted per image batch size: each image is one fixed-length sequence, so the
attention is a dense softmax (a flash kernel would take it for the 4,096 patches of an
896-pixel image on an accelerator).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.layers import ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    """SigLIP vision tower and Gemma 3 projector sizes (`vision_config`, and the top-level
    `mm_tokens_per_image` and text `hidden_size`)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    hidden_act: str
    tokens_per_image: int
    text_hidden_size: int

    @classmethod
    def from_hf(cls, hf: dict) -> SiglipConfig:
        """From a `Gemma3ForConditionalGeneration` config.json (transformers' defaults where
        silent).

        Raises:
            ValueError: A field the tower cannot serve, named: patches that do not tile the
                image, a token count that is not a square dividing the patch grid, heads
                that do not divide the width, an unknown activation.
        """
        v = hf.get("vision_config") or {}
        cfg = cls(hidden_size=int(v.get("hidden_size", 1152)),
                  intermediate_size=int(v.get("intermediate_size", 4304)),
                  num_layers=int(v.get("num_hidden_layers", 27)),
                  num_heads=int(v.get("num_attention_heads", 16)),
                  image_size=int(v.get("image_size", 896)),
                  patch_size=int(v.get("patch_size", 14)),
                  layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
                  hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
                  tokens_per_image=int(hf.get("mm_tokens_per_image", 256)),
                  text_hidden_size=int((hf.get("text_config") or {}).get("hidden_size", 2560)))
        cfg.check()
        return cfg

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    def check(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"vision_config.image_size={self.image_size} is not a multiple "
                             f"of patch_size={self.patch_size}")
        side = math.isqrt(self.tokens_per_image)
        if side * side != self.tokens_per_image or self.patches_per_side % side:
            raise ValueError(f"mm_tokens_per_image={self.tokens_per_image} must be a square "
                             f"whose side divides the {self.patches_per_side} patches a side")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config.num_attention_heads={self.num_heads} does not "
                             f"divide hidden_size={self.hidden_size}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported vision_config.hidden_act {self.hidden_act!r}")


# Where checkpoints keep the tower and projector: published Gemma 3 files, what transformers
# 5 saves, and its in-memory names.
TOWERS = ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.")
PROJECTORS = ("multi_modal_projector.", "model.multi_modal_projector.")


def _prefix(source, prefixes: tuple[str, ...], probe: str) -> str:
    """The first of `prefixes` under which `source` has `probe` (else the first)."""
    for prefix in prefixes:
        try:
            source.get(prefix + probe)
            return prefix
        except KeyError:
            continue
    return prefixes[0]
_LAYER = ("layer_norm1", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
          "self_attn.out_proj", "layer_norm2", "mlp.fc1", "mlp.fc2")


def load_siglip(source, cfg: SiglipConfig, dtype=jnp.float32) -> dict:
    """The tower's and projector's weights from a `TensorSource` under transformers' names:
    linear weights as [in, out], each layer's stacked on a leading [L] axis.

    Raises:
        KeyError: A tensor is missing (its name).
        ValueError: A tensor's shape disagrees with `cfg` (its name).
    """
    def get(name, shape):
        arr = np.asarray(source.get(name), np.float32)
        if arr.shape != shape:
            raise ValueError(f"{name}: shape {arr.shape}, expected {shape} from the config")
        return arr

    h, i, p = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    tower = _prefix(source, TOWERS, "embeddings.patch_embedding.bias")
    projector = _prefix(source, PROJECTORS, "mm_soft_emb_norm.weight")
    shapes = {"layer_norm1": (h, h), "layer_norm2": (h, h), "self_attn.q_proj": (h, h),
              "self_attn.k_proj": (h, h), "self_attn.v_proj": (h, h),
              "self_attn.out_proj": (h, h), "mlp.fc1": (i, h), "mlp.fc2": (h, i)}
    layers = {}
    for module in _LAYER:
        out, inp = shapes[module]
        names = [f"{tower}encoder.layers.{n}.{module}" for n in range(cfg.num_layers)]
        if module.startswith("layer_norm"):
            w = np.stack([get(f"{n}.weight", (out,)) for n in names])
        else:
            w = np.stack([get(f"{n}.weight", (out, inp)).T for n in names])
        layers[module] = {"w": w, "b": np.stack([get(f"{n}.bias", (out,)) for n in names])}
    conv = get(f"{tower}embeddings.patch_embedding.weight", (h, 3, p, p))
    params = {
        "patch": {"w": conv.reshape(h, 3 * p * p).T,  # [C*P*P, H]: (channel, row, col)
                  "b": get(f"{tower}embeddings.patch_embedding.bias", (h,))},
        "position": get(f"{tower}embeddings.position_embedding.weight",
                        (cfg.patches_per_side ** 2, h)),
        "layers": layers,
        "post_norm": {"w": get(f"{tower}post_layernorm.weight", (h,)),
                      "b": get(f"{tower}post_layernorm.bias", (h,))},
        "soft_norm": get(f"{projector}mm_soft_emb_norm.weight", (h,)),
        "projection": get(f"{projector}mm_input_projection_weight", (h, cfg.text_hidden_size)),
    }
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), params)


def _layer_norm(x, p, eps):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * p["w"] + p["b"]).astype(x.dtype)


def _block(cfg: SiglipConfig, x: jax.Array, p: dict) -> jax.Array:
    """One encoder layer over x [B, N, H]."""
    b, n, h = x.shape
    heads, d = cfg.num_heads, h // cfg.num_heads
    dense = lambda name, y: y @ p[name]["w"] + p[name]["b"]
    y = _layer_norm(x, p["layer_norm1"], cfg.layer_norm_eps)
    q, k, v = (dense(f"self_attn.{t}_proj", y).reshape(b, n, heads, d) for t in "qkv")
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * d ** -0.5
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)  # [B, heads, N, N]
    attn = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, n, h)
    x = x + dense("self_attn.out_proj", attn)
    y = _layer_norm(x, p["layer_norm2"], cfg.layer_norm_eps)
    y = dense("mlp.fc2", ACTIVATIONS[cfg.hidden_act](dense("mlp.fc1", y)))
    return x + y


def encode_images(params: dict, cfg: SiglipConfig, pixels: jax.Array) -> jax.Array:
    """Soft tokens of images: pixels f32[B, 3, S, S] (`Gemma3Processor`'s) ->
    [B, tokens_per_image, text_hidden_size] in the params' dtype."""
    b, s, p = pixels.shape[0], cfg.patches_per_side, cfg.patch_size
    dtype = params["patch"]["w"].dtype
    patches = pixels.astype(dtype).reshape(b, 3, s, p, s, p)
    patches = patches.transpose(0, 2, 4, 1, 3, 5).reshape(b, s * s, 3 * p * p)  # row-major
    x = patches @ params["patch"]["w"] + params["patch"]["b"] + params["position"]

    def step(x, layer):
        return _block(cfg, x, layer), None

    x, _ = jax.lax.scan(step, x, params["layers"])  # [B, N, H]
    x = _layer_norm(x, params["post_norm"], cfg.layer_norm_eps)
    # Average-pool the patch grid to tokens_per_image (row-major, as the projector's).
    side = math.isqrt(cfg.tokens_per_image)
    k = s // side
    grid = x.reshape(b, side, k, side, k, cfg.hidden_size).astype(jnp.float32)
    pooled = grid.mean(axis=(2, 4)).reshape(b, side * side, cfg.hidden_size)
    normed = pooled * jax.lax.rsqrt(jnp.mean(pooled * pooled, -1, keepdims=True)
                                    + cfg.layer_norm_eps)
    normed = normed * (1.0 + params["soft_norm"].astype(jnp.float32))
    return (normed.astype(dtype) @ params["projection"]).astype(dtype)
