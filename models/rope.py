"""Rotary-embedding scaling: `RopeScaling` parsed from an HF config, and its frequencies.

`parse_rope` reads `rope_scaling` (transformers 4) or `rope_parameters` (5) into a
`RopeScaling`; `check_rope_scaling` validates one against a rotary width; `rope_inv_freq`
gives the scaled inverse frequencies the cos/sin tables (`models.layers.rope_cos_sin`)
are built from, in transformers' order of operations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(factor) + 1` (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling (HF `rope_scaling` / `rope_parameters`).

    Attributes:
        rope_type: One of `SUPPORTED_ROPE_TYPES`: "default" (none), "linear", "llama3",
            "yarn" or "longrope".
        factor: Context extension factor (linear, llama3, yarn; longrope's only sets its
            default attention factor).
        low_freq_factor: Llama 3 low-frequency factor.
        high_freq_factor: Llama 3 high-frequency factor.
        original_max_position_embeddings: The pre-training context length (llama3, yarn,
            longrope).
        attention_factor: What cos and sin are multiplied by (so q.k by its square); None
            derives it: yarn from `factor`, `mscale`, `mscale_all_dim`, longrope
            `sqrt(1 + ln(factor) / ln(original))`; the other types 1.
        beta_fast: YaRN: rotations above which a frequency is extrapolated (kept).
        beta_slow: YaRN: rotations below which a frequency is interpolated (divided).
        mscale: YaRN: the attention factor's numerator coefficient (with `mscale_all_dim`).
        mscale_all_dim: YaRN: its denominator coefficient; used only with `mscale`.
        truncate: YaRN: whether the ramp's bounds are rounded out to whole dimensions.
        short_factor: LongRoPE: per-frequency divisors f32[rotary_dim // 2] within the
            original context.
        long_factor: LongRoPE: the divisors past it.
        partial_rotary_factor: Proportional (Gemma 4): the share of the head's frequencies
            that turn (exponents over the whole head); the others are 0 (cos 1, sin 0).
        use_long_factors: LongRoPE: which set the tables use, for every position. transformers
            picks by the sequence's length and recomputes the KV cache when a sequence
            crosses `original_max_position_embeddings`; a paged server cannot rewrite a
            request's KV, so (as vLLM) the set is fixed for the engine: the long factors when
            the longest context served exceeds the original length (`ArchConfig.
            for_max_model_len`; parsing assumes `max_position_embeddings`).
    """

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    partial_rotary_factor: float = 1.0
    use_long_factors: bool = True

    def __post_init__(self):
        # Lists (JSON) become tuples: the config is hashed as a static Flax attribute.
        for name in ("short_factor", "long_factor"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))

    @property
    def ext_factors(self) -> tuple[float, ...]:
        """LongRoPE's divisors in use (`use_long_factors`), else ()."""
        if self.rope_type != "longrope":
            return ()
        return self.long_factor if self.use_long_factors else self.short_factor

    def attention_scaling(self) -> float:
        """The factor cos and sin are multiplied by (transformers' `attention_scaling`)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.rope_type == "yarn":
            if self.mscale and self.mscale_all_dim:
                return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                    self.factor, self.mscale_all_dim)
            return yarn_mscale(self.factor)
        if self.rope_type == "longrope" and self.factor > 1.0:
            return math.sqrt(1 + math.log(self.factor)
                             / math.log(self.original_max_position_embeddings))
        return 1.0


def check_rope_scaling(name: str, scaling: RopeScaling, rotary_dim: int) -> None:
    """Checks a scaling for a rotary of `rotary_dim` channels.

    Raises:
        ValueError: An unsupported type, a non-positive factor, or LongRoPE factor lists
            of the wrong length or with non-positive entries; `name` names the field.
    """
    if scaling.rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {scaling.rope_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if scaling.rope_type in ("linear", "llama3", "yarn", "proportional") and not scaling.factor > 0:
        raise ValueError(f"{name}.factor must be positive, got {scaling.factor}")
    if scaling.rope_type == "longrope":
        for f in ("short_factor", "long_factor"):
            n = len(getattr(scaling, f))
            if n != rotary_dim // 2:
                raise ValueError(f"{name}.{f} has {n} entries; the rotary dimension "
                                 f"{rotary_dim} needs {rotary_dim // 2}")
            if not all(x > 0 for x in getattr(scaling, f)):
                raise ValueError(f"{name}.{f} must be positive")


# The `rope_scaling` / `rope_parameters` keys each type reads (transformers' own; others
# are ignored, as transformers ignores them), and those it cannot do without.
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("factor", "original_max_position_embeddings", "attention_factor",
                 "short_factor", "long_factor"),
    "proportional": ("factor", "partial_rotary_factor"),
}
_ROPE_REQUIRED = {"linear": ("factor",), "llama3": ("factor",),
                  "longrope": ("short_factor", "long_factor")}


def parse_rope(hf: dict[str, Any]) -> tuple[float, RopeScaling]:
    """Reads rotary settings from either transformers 5 (`rope_parameters`) or 4 style.

    As transformers: a top-level `original_max_position_embeddings` (Phi-3) comes before
    the scaling's own, and `max_position_embeddings` stands in for both it and a missing
    yarn or longrope `factor` (their ratio); longrope's factor set follows
    `max_position_embeddings` (`RopeScaling.use_long_factors`).

    Raises:
        ValueError: A key the rope type cannot do without is missing (named).
    """
    params = dict(hf.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = dict(hf.get("rope_scaling") or {})
    scaling.update(params)
    scaling = {k: v for k, v in scaling.items() if v is not None}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type not in _ROPE_KEYS:  # ArchConfig names it
        return theta, RopeScaling(rope_type=rope_type)
    for key in _ROPE_REQUIRED.get(rope_type, ()):
        if key not in scaling:
            raise ValueError(f"rope_scaling of type {rope_type!r} lacks {key}")
    kwargs = {k: scaling[k] for k in _ROPE_KEYS[rope_type] if k in scaling}
    if rope_type not in ("linear", "proportional"):  # the types that know a pre-training length
        max_len = int(hf.get("max_position_embeddings") or 2048)
        original = int(hf.get("original_max_position_embeddings")
                       or kwargs.get("original_max_position_embeddings") or max_len)
        kwargs["original_max_position_embeddings"] = original
        if rope_type != "llama3":
            kwargs.setdefault("factor", max_len / original)
        if rope_type == "longrope":
            kwargs["use_long_factors"] = max_len > original
    for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor",
                "partial_rotary_factor",
                "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if key in kwargs:
            kwargs[key] = float(kwargs[key])
    if "truncate" in kwargs:
        kwargs["truncate"] = bool(kwargs["truncate"])
    return theta, RopeScaling(rope_type=rope_type, **kwargs)


def _yarn_inv_freq(pos_freqs: np.ndarray, dim: int, theta: float,
                   scaling: RopeScaling) -> np.ndarray:
    """YaRN: each frequency blends its interpolated (divided by `factor`) and extrapolated
    (kept) values by a linear ramp over the dimensions whose rotation count within the
    original context falls from `beta_fast` to `beta_slow`."""
    def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times
        return (dim * math.log(scaling.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    keep = (1 - ramp).astype(np.float32)  # f32[dim // 2]: 1 = extrapolate
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (scaling.factor * pos_freqs)
    return interpolated * (1 - keep) + extrapolated * keep


def _proportional_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Proportional rotary: the first `partial_rotary_factor` of the frequencies as the
    default's over the whole head (exponents over `dim`), the rest 0, all divided by
    `factor` (transformers' `_compute_proportional_rope_parameters`)."""
    angles = int(scaling.partial_rotary_factor * dim // 2)
    exponents = np.arange(0, 2 * angles, 2, dtype=np.int64).astype(np.float32) / dim
    turned = (1.0 / (theta ** exponents).astype(np.float32)).astype(np.float32)
    inv_freq = np.concatenate([turned, np.zeros(dim // 2 - angles, np.float32)])
    return (inv_freq / np.float32(scaling.factor)).astype(np.float32)


def rope_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
    """Inverse rotary frequencies f32[dim // 2] of a `dim`-channel rotary (the head, or its
    rotated part), scaled as `scaling.rope_type` says; computed in float32 in
    transformers' order of operations, so the tables match it to the last bit or two."""
    if scaling.rope_type == "proportional":  # Gemma 4's full-attention layers
        return _proportional_inv_freq(dim, theta, scaling)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    pos_freqs = (theta ** exponents).astype(np.float32)  # f32[dim // 2]
    if scaling.rope_type == "longrope":  # divisors per frequency (`ext_factors`)
        factors = np.asarray(scaling.ext_factors, np.float32)
        return (1.0 / (factors * pos_freqs)).astype(np.float32)
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(pos_freqs, dim, theta, scaling).astype(np.float32)
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)
