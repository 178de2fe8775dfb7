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
