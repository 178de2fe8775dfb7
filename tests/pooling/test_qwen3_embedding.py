"""A Qwen3-Embedding-style checkpoint (a bare `Qwen3Model`: tensors without the `model.`
prefix, no LM head) loads as it is and embeds as transformers' last hidden state of its last
token, normalized (its pooling)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxserve import LLM
from models.loaders.safetensors_dir import SafetensorsDir
from tests.conftest import TINY_ENGINE
from tests.pooling.test_embed_oracle import PROMPTS, SMALL

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_bare_qwen3_model_checkpoint_embeds_like_transformers(smollm2_tokenizer, tmp_path):
    torch.set_num_threads(1)
    config = transformers.Qwen3Config(**SMALL, tie_word_embeddings=False,
                                      attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.Qwen3Model(config).to(torch.float32).eval()
    path = str(tmp_path / "qwen3-embedding")
    hf.save_pretrained(path, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Qwen3Model"]
    names = SafetensorsDir(path).names()
    assert "embed_tokens.weight" in names and not any(n.startswith("lm_head") for n in names)

    llm = LLM(path, runner="pooling", warmup=False, **TINY_ENGINE)
    for out in llm.embed(PROMPTS, use_tqdm=False):
        with torch.no_grad():
            h = hf(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1].numpy()
        got = np.asarray(out.outputs.embedding)
        assert float(got @ (h / np.linalg.norm(h))) > 1 - 1e-5


def _st_dir(root, mode: str | None, normalize: bool) -> str:
    """A sentence-transformers layout in `root`: `modules.json` and `1_Pooling/config.json`."""
    os.makedirs(root, exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"}]
    if mode is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling",
                        "type": "sentence_transformers.models.Pooling"})
        os.makedirs(root / "1_Pooling", exist_ok=True)
        flags = {k: k == mode for k in ("pooling_mode_cls_token", "pooling_mode_mean_tokens",
                                        "pooling_mode_max_tokens", "pooling_mode_lasttoken")}
        (root / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (root / "modules.json").write_text(json.dumps(modules))
    return str(root)


def test_a_sentence_transformers_directory_sets_the_default_pooler(tiny_model_dir, tmp_path):
    from jaxserve import PoolerConfig
    from jaxserve.pooling_params import sentence_transformers_pooler

    assert sentence_transformers_pooler(tiny_model_dir) is None  # no modules.json
    assert sentence_transformers_pooler(_st_dir(tmp_path / "a", None, True)) is None
    mean = _st_dir(tmp_path / "b", "pooling_mode_mean_tokens", False)
    assert sentence_transformers_pooler(mean) == PoolerConfig("MEAN", normalize=False)
    last = _st_dir(tmp_path / "c", "pooling_mode_lasttoken", True)
    assert sentence_transformers_pooler(last) == PoolerConfig("LAST", normalize=True)
    with pytest.raises(ValueError, match="declares pooling .'pooling_mode_max_tokens'.; "
                                         "served: one of"):
        sentence_transformers_pooler(_st_dir(tmp_path / "d", "pooling_mode_max_tokens", True))
    # the engine reads it when no pooler_config is given, and a given one wins
    for name in os.listdir(tiny_model_dir):
        os.symlink(os.path.join(tiny_model_dir, name), os.path.join(mean, name))
    llm = LLM(mean, runner="pooling", warmup=False, **TINY_ENGINE)
    assert llm.engine.pooler.config == PoolerConfig("MEAN", normalize=False)
    llm = LLM(mean, runner="pooling", pooler_config={"pooling_type": "CLS"}, warmup=False,
              **TINY_ENGINE)
    assert llm.engine.pooler.config == PoolerConfig("CLS")
