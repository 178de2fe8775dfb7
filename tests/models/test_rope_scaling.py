"""YaRN and LongRoPE rotary tables against transformers' rotary embeddings, and the rope
fields' parsing and errors.

Our cos/sin tables (`models.layers.rope_cos_sin`, attention factor included) must equal
those of transformers' own rotary classes, fed the same `config.json`, within float32
rounding, at positions up to four times the original context.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ArchConfig
from models.layers import rope_cos_sin
from models.registry import arch_config_from_hf
from models.rope import rope_inv_freq

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EPS32 = float(np.finfo(np.float32).eps)
BASE = dict(vocab_size=100, hidden_size=256, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2)  # heads of 128
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "phi3": "Phi3ForCausalLM"}


def _ours(config) -> ArchConfig:
    return arch_config_from_hf({**config.to_dict(), "architectures": [ARCH[config.model_type]]})


def _theirs(config, positions):
    """transformers' (cos, sin) f32[T, rotary_dim] and inv_freq after the forward (LongRoPE
    picks its factors there, by the positions' length)."""
    models = transformers.models
    rotary_cls = {"llama": models.llama.modeling_llama.LlamaRotaryEmbedding,
                  "qwen2": models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding,
                  "phi3": models.phi3.modeling_phi3.Phi3RotaryEmbedding}[config.model_type]
    rotary = rotary_cls(config=config)
    with torch.no_grad():
        cos, sin = rotary(torch.zeros(1), torch.tensor([positions]))
    return cos[0].numpy(), sin[0].numpy(), rotary.inv_freq.numpy()


def _positions(original: int) -> list[int]:
    """Inside and past the original context, up to 4x it (about 130 positions)."""
    step = max(1, original // 32)
    return [*range(0, 4 * original, step), 4 * original - 1]


def _assert_tables_match(cfg: ArchConfig, config, positions):
    cos_ref, sin_ref, inv_ref = _theirs(config, positions)
    inv = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    # The frequencies: float32 rounding (pow may differ by an ulp).
    np.testing.assert_allclose(inv, inv_ref, rtol=2 * EPS32, atol=0)
    cos, sin = (np.asarray(t) for t in rope_cos_sin(jnp.asarray(positions, jnp.int32), cfg))
    assert cos.shape == cos_ref.shape == (len(positions), cfg.rotary_dim)
    # The tables: float32 rounding of the result and of the angle it is taken of.
    angle = np.asarray(positions, np.float64)[:, None] * np.concatenate([inv_ref, inv_ref])
    bound = 2 * EPS32 * (1 + np.abs(angle)) * cfg.rope_scaling.attention_scaling()
    assert (np.abs(cos - cos_ref) <= bound).all(), np.abs(cos - cos_ref).max()
    assert (np.abs(sin - sin_ref) <= bound).all(), np.abs(sin - sin_ref).max()
    return cos, cos_ref


YARN_CASES = {  # (config class, original length, max_position_embeddings, yarn fields)
    "plain": ("Qwen2Config", 32, 128, {"factor": 4.0}),
    "mscale_all_dim": ("Qwen2Config", 32, 128,
                       {"factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.5}),
    "mscale_alone": ("LlamaConfig", 32, 128, {"factor": 4.0, "mscale": 0.5}),
    "betas_untruncated": ("LlamaConfig", 64, 512,
                          {"factor": 8.0, "beta_fast": 16, "beta_slow": 2, "truncate": False}),
    "attention_factor": ("Qwen2Config", 32, 128, {"factor": 4.0, "attention_factor": 1.3}),
    "factor_from_lengths": ("Qwen2Config", 32, 256, {"factor": None}),  # DeepSeek-V3 style
    "qwen_long_context": ("Qwen2Config", 4096, 16384, {"factor": 4.0}),
}


@pytest.mark.parametrize("name", list(YARN_CASES))
def test_yarn_tables_match_transformers(name):
    config_cls, original, max_len, fields = YARN_CASES[name]
    config = getattr(transformers, config_cls)(
        **BASE, max_position_embeddings=max_len,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6,
                         "original_max_position_embeddings": original, **fields})
    cfg = _ours(config)
    scaling = cfg.rope_scaling
    assert (scaling.rope_type, scaling.original_max_position_embeddings) == ("yarn", original)
    assert scaling.factor == (fields["factor"] or max_len / original)
    cos, cos_ref = _assert_tables_match(cfg, config, _positions(original))
    # The attention factor is in the tables (cos(0) = factor), and it is not 1 here.
    assert abs(scaling.attention_scaling() - 1) > 0.02
    np.testing.assert_allclose(cos[0], scaling.attention_scaling(), rtol=EPS32)
    unscaled = dataclasses.replace(cfg, rope_scaling=dataclasses.replace(
        scaling, attention_factor=1.0))
    assert np.abs(np.asarray(rope_cos_sin(jnp.asarray([0]), unscaled)[0]) - cos_ref[0]).max() > 0.01


def _phi3(original: int, max_len: int, partial: float, seed: int = 0):
    rotary = int(128 * partial)
    rng = np.random.default_rng(seed)
    short = (1.0 + rng.random(rotary // 2)).round(4).tolist()
    long = (1.0 + 20 * rng.random(rotary // 2)).round(4).tolist()
    return transformers.Phi3Config(
        **BASE, max_position_embeddings=max_len, original_max_position_embeddings=original,
        partial_rotary_factor=partial, pad_token_id=0, eos_token_id=2,
        rope_parameters={"rope_type": "longrope", "short_factor": short, "long_factor": long,
                         "rope_theta": 10000.0, "partial_rotary_factor": partial})


@pytest.mark.parametrize("original,max_len,partial", [(32, 128, 1.0), (32, 256, 0.75),
                                                      (4096, 131072, 0.75)])
def test_longrope_tables_match_transformers(original, max_len, partial):
    """Past the original context transformers takes the long factors, as our tables do by
    default (`max_position_embeddings` exceeds it); an engine whose `max_model_len` fits
    the original context takes the short ones, as transformers within it."""
    config = _phi3(original, max_len, partial)
    cfg = _ours(config)
    scaling = cfg.rope_scaling
    assert cfg.rotary_dim == int(128 * partial) and cfg.partial_rotary_factor == partial
    assert scaling.use_long_factors and scaling.factor == max_len / original
    np.testing.assert_allclose(scaling.attention_scaling(),
                               np.sqrt(1 + np.log(max_len / original) / np.log(original)))
    positions = _positions(original)
    assert max(positions) + 1 > original  # transformers' switch to the long factors
    _assert_tables_match(cfg, config, positions)

    short_cfg = cfg.for_max_model_len(original)
    assert not short_cfg.rope_scaling.use_long_factors
    assert cfg.for_max_model_len(original + 1).rope_scaling.use_long_factors
    within = [p for p in positions if p < original]
    _assert_tables_match(short_cfg, config, within)
    # The two sets differ where it matters: the long tables are not transformers' short ones.
    long_within = np.asarray(rope_cos_sin(jnp.asarray(within), cfg)[0])
    assert np.abs(long_within - _theirs(config, within)[0]).max() > 0.1


def test_phi3_old_rope_type_names_mean_longrope():
    """transformers' Phi3Config reads `su` and `yarn` as longrope (Phi-3 128k configs)."""
    config = _phi3(32, 128, 1.0)
    d = {**config.to_dict(), "architectures": ["Phi3ForCausalLM"]}
    rope = {k: v for k, v in d.pop("rope_parameters").items() if k != "rope_type"}
    for old in ("su", "yarn"):
        cfg = arch_config_from_hf({**d, "rope_scaling": {**rope, "type": old}})
        assert cfg.rope_scaling == _ours(config).rope_scaling


def test_rope_config_json_round_trip():
    cfg = _ours(_phi3(32, 128, 0.75)).for_max_model_len(32)
    again = ArchConfig.from_json(cfg.to_json())
    assert again == cfg and hash(again) == hash(cfg)


def _hf(config) -> dict:
    return {**config.to_dict(), "architectures": [ARCH[config.model_type]]}


def _phi3_dict(**edit) -> dict:
    return {**_hf(_phi3(32, 128, 0.75)), **edit}


BAD = {
    "dynamic rope": ({**_hf(transformers.LlamaConfig(**BASE)),
                      "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
                     "unsupported rope type 'dynamic'"),
    "longrope without long_factor": (
        _phi3_dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 48}),
        "rope_scaling of type 'longrope' lacks long_factor"),
    "short_factor length": (
        _phi3_dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 3,
                                    "long_factor": [1.0] * 48}),
        "rope_scaling.short_factor has 3 entries; the rotary dimension 96 needs 48"),
    "long_factor not positive": (
        _phi3_dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 48,
                                    "long_factor": [0.0] * 48}),
        "rope_scaling.long_factor must be positive"),
    "yarn factor": ({**_hf(transformers.LlamaConfig(**BASE)),
                     "rope_parameters": {"rope_type": "yarn", "factor": -2.0}},
                    "rope_scaling.factor must be positive, got -2.0"),
    "partial rotary on llama": ({**_hf(transformers.LlamaConfig(**BASE)),
                                 "partial_rotary_factor": 0.5},
                                "unsupported partial_rotary_factor=0.5 for LlamaForCausalLM"),
    "odd rotary dimension": (_phi3_dict(rope_parameters={"rope_type": "default",
                                                         "partial_rotary_factor": 37 / 128}),
                             "partial_rotary_factor=0.2890625 gives a rotary dimension of 37"),
    "phi3 linear rope": (_phi3_dict(rope_parameters={"rope_type": "linear", "factor": 2.0}),
                         "unsupported rope type 'linear' for Phi3ForCausalLM"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_rope_config_is_an_error(name):
    hf, message = BAD[name]
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        arch_config_from_hf(hf)
