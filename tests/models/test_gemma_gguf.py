"""Gemma 2 and Gemma 3 from GGUF files against transformers: tiny random models written as
llama.cpp's converter writes them (`tests/models/gemma_gguf.py`), loaded by jaxserve and
compared with transformers on the original model and on the same GGUF file; and the
metadata rules (attention scale, layer patterns, rotary bases, errors) on header-only
files."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from models.loaders import gguf_file, load_model, read_arch_config
from models.loaders.gguf_file import GGUFFile, open_gguf
from models.model import Model
from models.registry import arch_config_from_hf
from models.rope import RopeScaling
from tests.models.gemma_gguf import write_gemma_gguf
from tests.models.helpers import forward_logits, hf_logits, write_gguf_header

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# SmolLM2's vocabulary (its tokenizer is copied into the files); windows shorter than the
# prompt, soft caps below the uncapped logits, distinct rotary bases. The attention scale
# is head_dim's (llama.cpp's rule below 27B), Gemma 3 has a global 6th layer (llama.cpp's
# fixed pattern) and the LM head is tied (the converter drops `lm_head`).
BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
            max_position_embeddings=256, initializer_range=0.15, sliding_window=6,
            bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=3, attn_logit_softcapping=2.0,
                    final_logit_softcapping=4.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=7, final_logit_softcapping=4.0,
                    rope_parameters=GEMMA3_ROPE)),
}
# What transformers' GGUF loader does not read from these files (it keeps its config
# classes' defaults: query_pre_attn_scalar 256, Gemma 2's caps 50/30, Gemma 3's rotary
# 1e6 / 10000 unscaled and no final cap), passed to it as overrides.
TF_OVERRIDES = {
    "gemma2": dict(query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                   final_logit_softcapping=4.0),
    "gemma3": dict(query_pre_attn_scalar=16, final_logit_softcapping=4.0,
                   rope_parameters=GEMMA3_ROPE),
}
WINDOWS = {"gemma2": (6, 0, 6), "gemma3": (6, 6, 6, 6, 6, 0, 6)}
SEQ_LEN = 24
F32_ATOL = 1e-4


@pytest.fixture(scope="module", params=list(FAMILIES))
def gemma_gguf(request, smollm2_path, tmp_path_factory):
    """(family, transformers model, GGUF path, our float32 model from the GGUF)."""
    family = request.param
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**BASE, **extra, attn_implementation="eager")
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms away from their zero init: the +1 fold must matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    path = str(tmp_path_factory.mktemp(family) / f"{family}.gguf")
    write_gemma_gguf(hf, path, tokenizer_source=open_gguf(smollm2_path))
    return family, hf, path, load_model(path, "float32")


def _prompt(seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, BASE["vocab_size"], SEQ_LEN).tolist()


def test_gguf_config_equals_hf_config(gemma_gguf):
    """The GGUF's architecture config is the original transformers config's."""
    family, hf, path, model = gemma_gguf
    want = arch_config_from_hf(json.loads(hf.config.to_json_string()) |
                               {"architectures": [type(hf).__name__]})
    assert read_arch_config(path) == want == model.cfg
    assert model.cfg.layer_windows == WINDOWS[family]
    assert model.cfg.norm_offset == 1.0 and model.cfg.query_pre_attn_scalar == 16.0


@pytest.mark.parametrize("chunks", [None, (9, 7, 1, 1, 1, 1, 1, 1, 1, 1)],
                         ids=["whole", "prefill_decode"])
def test_gguf_logits_match_transformers(gemma_gguf, chunks):
    """Teacher-forced logits (and so greedy tokens) from the GGUF equal transformers' on the
    original model, whole and as a prefill plus decode steps through the paged cache."""
    _, hf, _, model = gemma_gguf
    ids = _prompt()
    ref = hf_logits(hf, ids)
    assert ref.std() > 0.5 and len(set(ref.argmax(-1).tolist())) > 3
    ours = forward_logits(model, ids, page_size=4, chunks=chunks)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=F32_ATOL)
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


ABLATE = {"gemma2": dict(layer_windows=(0, 0, 0), attn_logit_softcap=None,
                        final_logit_softcap=None),
          "gemma3": dict(layer_windows=(0,) * 7, local_rope_theta=None,
                         rope_scaling=RopeScaling(), final_logit_softcap=None)}


# Slow tier: each ablation compiles a step; the default tier's test_numerics ablates the same
# fields, and test_gguf_config_equals_hf_config shows the GGUF sets them as the HF config.
@pytest.mark.slow
def test_gguf_features_are_exercised(gemma_gguf):
    """Resetting any one of the fields read from the GGUF metadata breaks agreement, so the
    comparison above checks each of them."""
    family, hf, _, model = gemma_gguf
    ids = _prompt()
    ref = hf_logits(hf, ids)
    for field, value in ABLATE[family].items():
        ablated = Model(dataclasses.replace(model.cfg, **{field: value}), model.params,
                        model.dtype, serving=model.serving)
        assert np.abs(forward_logits(ablated, ids, page_size=4) - ref).max() > 100 * F32_ATOL, \
            field


# One family in the default tier (transformers' GGUF load takes seconds); the weights it
# reads are the original ones for both, so Gemma 2's run repeats the comparison above.
# NOTE: slow: transformers' loader reads back the original weights, which
# test_gguf_logits_match_transformers already compares against.
@pytest.mark.slow
@pytest.mark.parametrize("gemma_gguf", ["gemma3", "gemma2"], indirect=True)
def test_gguf_matches_transformers_gguf_loader(gemma_gguf):
    """transformers reading the same file (its own dequantizer, names and `-1` unfold) gets
    the original weights, and its logits equal ours once given the fields it does not
    read (`TF_OVERRIDES`)."""
    family, hf, path, model = gemma_gguf
    directory, name = path.rsplit("/", 1)
    tf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, attn_implementation="eager",
        **TF_OVERRIDES[family]).eval()
    want = hf.state_dict()
    got = tf.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=k)
    ids = _prompt(seed=1)
    np.testing.assert_allclose(forward_logits(model, ids, page_size=4), hf_logits(tf, ids),
                               rtol=0, atol=F32_ATOL)


def test_gguf_tokenizer_loads(gemma_gguf, smollm2_tokenizer):
    from models.loaders import load_tokenizer

    tok = load_tokenizer(gemma_gguf[2])
    text = "Paged attention stores the KV cache in blocks"
    assert tok(text).input_ids == smollm2_tokenizer(text).input_ids


# Gemma 2's tied random LM head repeats one token greedily (still compared, in the slow
# tier); Gemma 3's varies.
@pytest.mark.parametrize("gemma_gguf", ["gemma3", pytest.param("gemma2", marks=pytest.mark.slow)],
                         indirect=True)
def test_gguf_engine_greedy_matches_transformers(gemma_gguf):
    """The engine serves the GGUF (its tokenizer, paged cache, windows) and its greedy tokens
    equal transformers' `generate` on the original model."""
    from jaxserve import LLM, SamplingParams
    from tests.conftest import TINY_ENGINE

    family, hf, path, _ = gemma_gguf
    llm = LLM(path, **{**TINY_ENGINE, "warmup": False})
    assert os.path.abspath(path) not in gguf_file._OPEN  # loaded: its reader let go
    text = ("Paged attention stores the key and value cache in fixed-size blocks, and the "
            "scheduler decides")
    ids = llm.get_tokenizer()(text).input_ids
    assert len(ids) > 2 * BASE["sliding_window"]  # the window binds
    out = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    assert list(out.outputs[0].token_ids) == ref
    if family == "gemma3":
        assert len(set(ref)) > 1


# ------------------------------------------------------------------ header-only files


def _header(tmp_path, arch: str, layers: int = 4, hidden: int = 64, heads: int = 4,
            head_dim: int = 16, skip: tuple[str, ...] = (), **extra) -> str:
    """A GGUF file with metadata only (what `hf_config` reads): the converter's keys for
    `arch`, minus `skip`, plus `extra` ({key suffix: value})."""
    fields = {"block_count": layers, "embedding_length": hidden, "feed_forward_length": 96,
              "attention.head_count": heads, "attention.head_count_kv": 2,
              "attention.key_length": head_dim, "attention.value_length": head_dim,
              "vocab_size": 160, "attention.layer_norm_rms_epsilon": 1e-6,
              "attention.sliding_window": 8, "context_length": 256}
    if arch == "gemma2":
        fields |= {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    else:
        fields |= {"rope.freq_base": 1e6}
    fields = {k: v for k, v in (fields | extra).items() if k not in skip}
    return write_gguf_header(str(tmp_path / f"{arch}.gguf"), arch, fields)


def _cfg(path: str):
    return arch_config_from_hf(GGUFFile(path).hf_config())


def test_gemma2_header_defaults(tmp_path):
    """Gemma 2: sliding first and alternating, head_dim's scale, rotary 10000, GELU; caps
    absent default to 50/30 as llama.cpp's and transformers' do."""
    cfg = _cfg(_header(tmp_path, "gemma2", skip=("attn_logit_softcapping",
                                                  "final_logit_softcapping")))
    assert cfg.architecture == "Gemma2ForCausalLM"
    assert cfg.layer_windows == (8, 0, 8, 0)
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
    assert cfg.query_pre_attn_scalar == 16.0 and cfg.rope_theta == 10000.0
    assert cfg.rms_norm_eps == 1e-6 and cfg.hidden_act == "gelu_pytorch_tanh"


def test_gemma3_header_two_ropes(tmp_path):
    """Gemma 3: every 6th layer global, linear scaling on the global base only, the
    sliding base from rope.freq_base_swa (10000 without it), no final cap by default."""
    path = _header(tmp_path, "gemma3", layers=7, **{"rope.scaling.type": "linear",
                                                    "rope.scaling.factor": 8.0})
    cfg = _cfg(path)
    assert cfg.layer_windows == (8, 8, 8, 8, 8, 0, 8)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == RopeScaling("linear", factor=8.0)
    assert cfg.local_rope_theta == 10000.0 and cfg.local_rope_scaling == RopeScaling()
    assert cfg.final_logit_softcap is None and cfg.attn_logit_softcap is None
    assert cfg.qk_norm and cfg.norm_offset == 1.0
    swa = _cfg(_header(tmp_path, "gemma3", **{"rope.freq_base_swa": 500.0}))
    assert swa.local_rope_theta == 500.0


def test_gemma3_without_window_is_all_global(tmp_path):
    """The converter leaves the window out of an all-global (pattern 1) model."""
    cfg = _cfg(_header(tmp_path, "gemma3", layers=3, skip=("attention.sliding_window",)))
    assert cfg.layer_windows == (0, 0, 0)


@pytest.mark.parametrize("arch,layers", [("gemma2", 46), ("gemma3", 62)])
def test_27b_attention_scale_is_hidden_over_heads(tmp_path, arch, layers):
    """llama.cpp's rule for the 27B models (their published query_pre_attn_scalar)."""
    cfg = _cfg(_header(tmp_path, arch, layers=layers, hidden=4608, heads=32, head_dim=128))
    assert cfg.query_pre_attn_scalar == 144.0
    other = _cfg(_header(tmp_path, arch, layers=layers - 2, hidden=4608, heads=32,
                         head_dim=128))
    assert other.query_pre_attn_scalar == 128.0


@pytest.mark.parametrize("arch,skip,extra,match", [
    ("gemma2", ("attention.sliding_window",), {}, r"gemma2\.attention\.sliding_window is "
     "missing"),
    ("gemma2", (), {"attention.sliding_window": 0}, r"gemma2\.attention\.sliding_window is "
     "missing or 0"),
    ("gemma3", (), {"attention.value_length": 32}, r"gemma3\.attention\.value_length \(32\) "
     "is not supported"),
    ("gemma3", ("rope.freq_base",), {}, r"gemma3\.rope\.freq_base is missing"),
    ("gemma3", (), {"attn_logit_softcapping": 50.0},
     r"gemma3\.attn_logit_softcapping \(50\.0\) is not"),
    ("gemma3", (), {"attention.sliding_window_pattern": 6},
     r"gemma3\.attention\.sliding_window_pattern is not supported"),
    ("gemma2", (), {"rope.scaling.type": "yarn"}, r"gemma2\.rope\.scaling\.type 'yarn'"),
    ("gemma3", (), {"rope.scaling.type": "linear"}, r"gemma3\.rope\.scaling\.factor is "
     "missing"),
    ("gemma2", ("block_count",), {}, r"gemma2\.block_count is missing"),
    ("gemma3", ("attention.head_count",), {}, r"gemma3\.attention\.head_count is missing"),
])
def test_gemma_header_errors_name_the_field(tmp_path, arch, skip, extra, match):
    path = _header(tmp_path, arch, skip=skip, **extra)
    with pytest.raises(ValueError, match=match):
        GGUFFile(path).hf_config()
