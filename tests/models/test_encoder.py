"""The encoder forward (`models.encoder.encode`) against transformers' BERT and XLM-RoBERTa
(bare and with their classification heads) on a packed ragged step, and the encoder
config's and loader's errors."""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from models.encoder_config import encoder_config_from_hf
from models.loaders import load_model, read_arch_config
from pallas_kernels import AttentionMetadata

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SHAPES = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              intermediate_size=64, initializer_range=0.1)
CASES = {  # name: (class, config overrides)
    "bert": ("BertModel", {}),
    "bert_cls": ("BertForSequenceClassification", dict(num_labels=3)),
    "xlmr": ("XLMRobertaModel", dict(pad_token_id=1)),
    "xlmr_cls": ("XLMRobertaForSequenceClassification", dict(pad_token_id=1, num_labels=1)),
}
# Three sequences packed in one step, then 4 padding tokens (a padded row too).
SEQS = [list(range(5, 17)), list(range(40, 47)), [3, 9, 11]]


def save(tmp_path, cls: str, overrides: dict) -> tuple:
    config_cls = transformers.XLMRobertaConfig if cls.startswith("XLM") else transformers.BertConfig
    mpe = 66 if cls.startswith("XLM") else 64  # RoBERTa's positions start past pad + 1
    config = config_cls(**SHAPES, max_position_embeddings=mpe, **overrides,
                        attn_implementation="eager")
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(config).eval()
    path = str(tmp_path / cls)
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def packed_step(model):
    ids = sum(SEQS, []) + [0] * 4
    positions = sum((list(range(len(s))) for s in SEQS), []) + [0] * 4
    cu = np.cumsum([0] + [len(s) for s in SEQS] + [0])
    md = AttentionMetadata(jnp.zeros(len(ids), jnp.int32), jnp.zeros((4, 1), jnp.int32),
                           jnp.asarray([len(s) for s in SEQS] + [0], jnp.int32),
                           jnp.asarray(cu, jnp.int32))
    _, out = model.forward(model.params, jnp.asarray(ids, jnp.int32),
                           jnp.asarray(positions, jnp.int32), None, md)
    return np.asarray(out), cu


# NOTE: the default tier runs XLM-R's classifier (RoBERTa's offset and head); the other three
# also run through the engine against transformers (tests/pooling/test_encoder_engine.py).
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "xlmr_cls" else [
    pytest.mark.slow(reason="the engine tests check the same model against transformers")])
    for n in CASES])
def test_packed_forward_equals_transformers(tmp_path, torch_one_thread, name):
    cls, overrides = CASES[name]
    hf, path = save(tmp_path, cls, overrides)
    model = load_model(path, "float32")
    assert read_arch_config(path) == model.cfg and model.cfg.architecture == cls
    out, cu = packed_step(model)
    for seq, start in zip(SEQS, cu, strict=False):
        with torch.no_grad():
            res = hf(torch.tensor([seq]))
        if model.encoder.head is None:  # every token's final state
            np.testing.assert_allclose(out[start:start + len(seq)],
                                       res.last_hidden_state[0].numpy(), atol=1e-4)
        else:  # the class logits at the sequence's first token
            np.testing.assert_allclose(out[start], res.logits[0].numpy(), atol=1e-4)
    assert model.cfg.hidden_size == model.encoder.output_size


def test_roberta_context_leaves_out_its_position_offset(tmp_path):
    _, path = save(tmp_path, "XLMRobertaModel", dict(pad_token_id=1))
    assert read_arch_config(path).max_position_embeddings == 66 - 2


BASE = {"architectures": ["BertModel"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}


@pytest.mark.parametrize("change,field", [
    ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"problem_type": "ranking"}, "problem_type"),
    ({"num_attention_heads": 3}, "num_attention_heads"),
    ({"architectures": ["XLMRobertaModel"], "pad_token_id": None}, "pad_token_id"),
    ({"architectures": ["BertForSequenceClassification"], "num_labels": 1,
      "sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}},
     "activation_fn"),
    ({"architectures": ["BertForMaskedLM"]}, "architectures"),
])
def test_config_errors_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        encoder_config_from_hf({**BASE, **change})


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    _, path = save(tmp_path, "BertModel", {})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "intermediate_size": 48}, f)
    with pytest.raises(ValueError, match="intermediate.dense.weight"):
        load_model(path, "float32")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "architectures": ["BertForSequenceClassification"]}, f)
    with pytest.raises(ValueError, match="'classifier.weight'"):  # a bare model's pooler read
        load_model(path, "float32")


def test_quantized_encoders_are_refused(tmp_path):
    _, path = save(tmp_path, "BertModel", {})
    with pytest.raises(ValueError, match="quantization"):
        load_model(path, "float32", quantization="int8")


MODERN = dict(vocab_size=100, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
              intermediate_size=48, max_position_embeddings=64, local_attention=4,
              global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              cls_token_id=1, sep_token_id=2, initializer_range=0.1)


@pytest.mark.parametrize("cls,extra", [
    ("ModernBertModel", {}),
    pytest.param("ModernBertForSequenceClassification", dict(num_labels=1,
                 classifier_pooling="mean"), marks=pytest.mark.slow(
                     reason="the bare body runs in the default tier")),
    pytest.param("ModernBertForSequenceClassification", dict(num_labels=3), marks=pytest.mark.slow(
        reason="the body runs bare in the default tier; the engine's ModernBERT test is slow too")),
])
def test_modernbert_packed_forward_equals_transformers(tmp_path, torch_one_thread, cls, extra):
    import dataclasses

    config = transformers.ModernBertConfig(**MODERN, **extra, attn_implementation="eager")
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(config).eval()
    hf.save_pretrained(str(tmp_path / "mb"), safe_serialization=True)
    model = load_model(str(tmp_path / "mb"), "float32")
    assert model.encoder.modern.layer_sliding == (False, True, False)
    assert model.encoder.modern.window == 2
    out, cu = packed_step(model)
    # The local layers matter: a window covering every sequence gives other states.
    wide = dataclasses.replace(model.encoder, modern=dataclasses.replace(
        model.encoder.modern, window=10**6))
    out_wide, _ = packed_step(dataclasses.replace(model, encoder=wide))
    for seq, start in zip(SEQS, cu, strict=False):
        with torch.no_grad():
            res = hf(torch.tensor([seq]))
        got, other = (out[start], out_wide[start]) if model.encoder.head else (
            out[start:start + len(seq)], out_wide[start:start + len(seq)])
        want = res.logits[0].numpy() if model.encoder.head else res.last_hidden_state[0].numpy()
        np.testing.assert_allclose(got, want, atol=1e-4)
        if len(seq) > 5:
            assert np.abs(other - want).max() > 1e-3


@pytest.mark.parametrize("change,field", [
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0}}},
     "rope_parameters.full_attention.rope_type"),
    ({"classifier_pooling": "max"}, "classifier_pooling"),
    ({"norm_bias": True}, "norm_bias"),
    ({"classifier_activation": "relu", "architectures": ["ModernBertForSequenceClassification"]},
     "classifier_activation"),
])
def test_modernbert_config_errors_name_the_field(change, field):
    hf = {**BASE, "architectures": ["ModernBertModel"], "num_hidden_layers": 2, **change}
    with pytest.raises(ValueError, match=field):
        encoder_config_from_hf(hf)
