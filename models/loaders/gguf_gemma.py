"""Gemma 2 and Gemma 3 GGUF metadata and tensors, read as llama.cpp's converter writes them.

What the converter (`convert_hf_to_gguf.py`, `Gemma2Model`/`Gemma3Model`) writes and what
llama.cpp (`llama_load_hparams_gemma2/3`) derives, turned into the Hugging Face config
keys `models.registry.Gemma2`/`Gemma3` read:

- Norm weights are stored with Gemma's `+1` folded in (every tensor whose HF name ends in
  `norm.weight`, q/k norms included); `unfold_norm` takes it out again, as transformers'
  GGUF loader does, so the weights equal the Hugging Face checkpoint's.
- There is no `query_pre_attn_scalar` key: llama.cpp scales queries by
  `1 / sqrt(hidden / heads)` for the 27B models (recognised by their layer count) and by
  `1 / sqrt(head_dim)` otherwise, which is what every published Gemma 2/3 config sets.
- The layer pattern is fixed by the architecture (no key): Gemma 2 alternates sliding and
  global layers starting with a sliding one, Gemma 3 makes every 6th layer global.
- Gemma 3's sliding layers use `rope.freq_base_swa` (newer converters) or llama.cpp's fixed
  10000, unscaled; `rope.freq_base` and the linear `rope.scaling.*` are the global layers'.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

GEMMA_ARCHS = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

# Per-layer GGUF tensor names where Gemma's differ from Llama's (`ffn_norm` is Gemma's
# pre-MLP norm, Llama's post-attention one).
GEMMA_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# llama.cpp's fixed sliding-window pattern: every `n`-th layer is global.
_PATTERN = {"gemma2": 2, "gemma3": 6}
# Layer counts llama.cpp takes for the 27B models, whose attention scale is hidden / heads.
_LAYERS_27B = {"gemma2": 46, "gemma3": 62}
# llama.cpp's defaults when a file lacks the soft caps (Gemma 2's published values, and
# transformers' `Gemma2Config` defaults too).
_GEMMA2_CAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
_LOCAL_ROPE_THETA = 10000.0


def unfold_norm(name: str, arr: np.ndarray) -> np.ndarray:
    """A Gemma tensor as the Hugging Face checkpoint holds it (norms without the `+1`)."""
    return arr - np.float32(1.0) if name.endswith("norm.weight") else arr


def gemma_fields(arch: str, key: Callable, where: str, hidden: int, heads: int,
                 head_dim: int, layers: int) -> dict:
    """The Hugging Face config keys of a `gemma2`/`gemma3` GGUF beyond the common ones.

    Args:
        arch: "gemma2" or "gemma3".
        key: `key(name, default=None)` reads the metadata field `{arch}.{name}`.
        where: The file, for error messages.
        hidden, heads, head_dim, layers: The shape already read from the file.

    Raises:
        ValueError: A field this loader cannot honour (named), or a required one missing.
    """
    def fail(field: str, why: str):
        raise ValueError(f"{where}: {arch}.{field} {why}")

    if key("attention.sliding_window_pattern") is not None:
        # NOTE: llama.cpp ignores it for Gemma (the pattern is fixed); a file that sets it
        # means something else than llama.cpp would run.
        fail("attention.sliding_window_pattern", "is not supported: Gemma's layer pattern is "
             f"fixed (every {_PATTERN[arch]}th layer global)")
    value_length = key("attention.value_length")
    if value_length is not None and int(value_length) != head_dim:
        fail("attention.value_length", f"({value_length}) is not supported: it must equal "
             f"the key length ({head_dim})")
    scalar = hidden // heads if layers == _LAYERS_27B[arch] else head_dim
    out = {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": scalar}
    window = key("attention.sliding_window")
    if arch == "gemma2":
        if not window:
            fail("attention.sliding_window", "is missing or 0 (Gemma 2 alternates sliding "
                 "and global layers)")
        out.update({k: float(key(k, default)) for k, default in _GEMMA2_CAPS.items()})
        return {**out, "sliding_window": int(window), "sliding_window_pattern": 2}
    if key("attn_logit_softcapping") is not None:
        fail("attn_logit_softcapping", f"({key('attn_logit_softcapping')}) is not "
             "supported: Gemma 3 defines no attention soft cap")
    if key("rope.freq_base") is None:
        # NOTE: llama.cpp would default to 10000, transformers to 1e6; the converter always
        # writes it.
        fail("rope.freq_base", "is missing (the global layers' rotary base)")
    cap = key("final_logit_softcapping")
    out.update(final_logit_softcapping=float(cap) if cap else None,
               rope_local_base_freq=float(key("rope.freq_base_swa", _LOCAL_ROPE_THETA)))
    if not window:  # the converter leaves it out for an all-global model (pattern 1)
        return {**out, "layer_types": ["full_attention"] * layers}
    return {**out, "sliding_window": int(window), "sliding_window_pattern": _PATTERN[arch]}
