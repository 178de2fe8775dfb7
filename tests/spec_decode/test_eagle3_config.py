"""EAGLE-3 heads that do not fit their target, and bad configs: ValueErrors naming the field
(a stand-in target: only its vocabulary, hidden size and layer count are read)."""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import pytest

from jaxserve import LLM
from jaxserve.config import SpeculativeConfig
from jaxserve.spec_decode.eagle import Eagle3Speculator
from models.loaders.eagle3 import load_eagle3
from tests.spec_decode.eagle_head import random_head, write_head_dir

VOCAB, HIDDEN, AUX = 1000, 72, (0, 1, 1)
TARGET = SimpleNamespace(cfg=SimpleNamespace(vocab_size=VOCAB, hidden_size=HIDDEN,
                                             num_layers=2))
IDS = "speculative_config.eagle_aux_hidden_state_layer_ids"


def eagle(head, **extra) -> dict:
    return {"method": "eagle3", "model": head, "num_speculative_tokens": 2, **extra}


def make(spec_config: dict) -> Eagle3Speculator:
    return Eagle3Speculator(SpeculativeConfig.from_dict(spec_config), target=TARGET,
                            num_pages=8, page_size=16, max_model_len=64, max_num_seqs=2)


def head_dir(directory, vocab: int = VOCAB, target_hidden: int = HIDDEN, aux=AUX) -> str:
    return write_head_dir(str(directory), random_head(vocab, target_hidden, draft_vocab=64),
                          vocab, target_hidden, aux_ids=aux)


@pytest.mark.parametrize("change, field", [
    (dict(vocab=1200), "speculative_config.model"),
    (dict(target_hidden=64), "speculative_config.model"),
    (dict(aux=(0, 1, 2)), IDS),
    (dict(aux=None), IDS),  # vLLM's default for 2 layers: (2, 1, -1)
    (dict(aux=(0, 1)), IDS),  # fc reads 3 layers' states
])
def test_heads_that_do_not_fit_are_refused(tmp_path, change, field):
    with pytest.raises(ValueError, match=field):
        make(eagle(head_dir(tmp_path / "head", **change)))


@pytest.mark.parametrize("spec_config, field", [
    (dict(model="/nonexistent/head"), "speculative_config.model"),
    (dict(num_speculative_tokens=0), "speculative_config.num_speculative_tokens"),
    (dict(model=None), "speculative_config.model"),
    (dict(eagle_aux_hidden_state_layer_ids=[0, 1, 5]), IDS),
    (dict(eagle_aux_hidden_state_layer_ids="0,1"), IDS),
])
def test_bad_configs_are_refused(tmp_path, spec_config, field):
    with pytest.raises(ValueError, match=field):
        make({**eagle(head_dir(tmp_path / "head")), **spec_config})


def test_a_directory_without_a_head_is_refused(tmp_path, tiny_model_dir):
    """A model directory that is no head (the tiny Llama), one without weights."""
    with pytest.raises(ValueError, match="speculative_config.model: config.json is not an "
                                         "EAGLE-3 head's"):
        make(eagle(tiny_model_dir))
    path = head_dir(tmp_path / "head")
    (tmp_path / "head" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"speculative_config.model: no \*.safetensors"):
        make(eagle(path))


def test_the_engine_checks_the_head_before_compiling(tiny_model_dir):
    with pytest.raises(ValueError, match="speculative_config.model: no EAGLE-3 head"):
        LLM(tiny_model_dir, speculative_config=eagle("/nonexistent/head"), warmup=False,
            max_model_len=128, num_kv_blocks=16)


def test_a_runner_over_a_mesh_is_refused(tmp_path):
    with pytest.raises(ValueError, match="speculative_config.method: eagle3 runs on one"):
        make(eagle(head_dir(tmp_path / "head"))).attach(SimpleNamespace(layout=object()))


def test_a_head_given_by_object_and_its_aux_ids_override(tmp_path):
    """The Python API takes a loaded head; `eagle_aux_hidden_state_layer_ids` in the
    speculative config overrides the checkpoint's (ascending, repeats kept)."""
    head = load_eagle3(head_dir(tmp_path / "head"), jnp.float32)
    sp = make(eagle(head, eagle_aux_hidden_state_layer_ids=[1, 0, 1]))
    assert sp.head is head and sp.aux_layers == (0, 1, 1)
    assert sp.kv_pages.shape[0] == 1  # one layer's K/V


def _drop(key):
    return lambda t: {k: v for k, v in t.items() if k != key}


def _set(key, fn):
    return lambda t: {**t, key: fn(t[key])}


@pytest.mark.parametrize("edit, message", [
    (_drop("norm"), "has no 'norm.weight'"),
    (_drop("d2t"), "has no 'd2t'"),  # a reduced vocabulary needs its map
    (_set("lm_head", lambda w: w[:, :40]), "lm_head.weight of .* is \\(64, 40\\)"),
    (_set("q_proj", lambda w: w[:, :72]), "q_proj.weight of .* is"),
    (_set("d2t", lambda d: d + VOCAB), "d2t of .* maps draft ids outside"),
    (_set("fc", lambda w: w[:40]), "fc.weight of .* it must be"),
])
def test_broken_checkpoints_are_refused(tmp_path, edit, message):
    tensors = edit(random_head(VOCAB, HIDDEN, draft_vocab=64))
    path = write_head_dir(str(tmp_path / "head"), tensors, VOCAB, HIDDEN, aux_ids=AUX)
    with pytest.raises(ValueError, match="speculative_config.model: .*" + message):
        load_eagle3(path, jnp.float32)


def test_the_head_attends_where_the_target_does(tiny_model_dir):
    """A target on the CPU kernels gives its head their attention; any other the XLA path."""
    from jaxserve.spec_decode.eagle_setup import head_attention
    from models.linear import ServingChoice
    from models.loaders import load_model

    for backend, want in (("cpu", "cpu"), ("xla", "xla"), ("pallas", "xla")):
        target = load_model(tiny_model_dir, "float32", serving=ServingChoice(backend))
        assert head_attention(target) == want, backend
