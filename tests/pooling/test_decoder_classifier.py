"""Decoder sequence classifiers (`Qwen3ForSequenceClassification`, `LlamaForSequenceClassification`)
through the pooling runner against transformers: class probabilities and cross-encoder scores
read at each prompt's last token, prompts chunked over steps and packed with others."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM, PoolingParams
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import SMALL

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["The capital of France is", "Hi",
           "Once upon a time, in a village by the sea, there lived an old fisherman who "
           "went out every morning before the sun rose. " * 3]


def build(tmp_path_factory, tokenizer, arch: str, num_labels: int):
    config_cls = getattr(transformers, arch.replace("ForSequenceClassification", "Config"))
    config = config_cls(**SMALL, num_labels=num_labels, attn_implementation="eager")
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(config).to(torch.float32).eval()
    path = str(tmp_path_factory.mktemp("seq_cls") / arch)
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return hf, path


def hf_logits(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, smollm2_tokenizer):
    torch.set_num_threads(1)
    hf, path = build(tmp_path_factory, smollm2_tokenizer, "Qwen3ForSequenceClassification", 3)
    return hf, LLM(path, runner="pooling", warmup=False, **TINY_ENGINE)


def test_qwen3_classifier_probs_equal_transformers(qwen3):
    hf, llm = qwen3
    outs = llm.classify(PROMPTS, use_tqdm=False)
    assert len(outs[2].prompt_token_ids) > TINY_ENGINE["max_num_batched_tokens"]  # chunked
    raw = llm.classify(PROMPTS[2], PoolingParams(task="classify", use_activation=False),
                       use_tqdm=False)[0]
    for out in outs:
        logits = hf_logits(hf, out.prompt_token_ids)
        np.testing.assert_allclose(out.outputs.probs,
                                   torch.softmax(torch.tensor(logits), -1).numpy(), atol=1e-5)
    np.testing.assert_allclose(raw.outputs.probs, hf_logits(hf, raw.prompt_token_ids),
                               atol=1e-4)
    with pytest.raises(ValueError, match="task='embed'"):
        llm.embed("hi", use_tqdm=False)


def test_classifier_refuses_the_generate_runner_and_other_pooling(qwen3, tmp_path_factory,
                                                                  smollm2_tokenizer):
    path = qwen3[1].engine.model.source
    with pytest.raises(ValueError, match="runner='generate'.*sequence classifier"):
        LLM(path, warmup=False, **TINY_ENGINE)
    with pytest.raises(ValueError, match="pooling_type='CLS'"):
        LLM(path, runner="pooling", pooler_config={"pooling_type": "CLS"}, warmup=False,
            **TINY_ENGINE)


@pytest.mark.slow(reason="the Qwen3 classifier covers the score head; this adds Llama and "
                  "the one-class score's sigmoid (an engine of its own)")
def test_llama_cross_encoder_scores_equal_transformers(tmp_path_factory, smollm2_tokenizer):
    hf, path = build(tmp_path_factory, smollm2_tokenizer, "LlamaForSequenceClassification", 1)
    llm = LLM(path, runner="pooling", warmup=False, **TINY_ENGINE)
    outs = llm.score("What is the capital of France?", ["Paris.", "Bananas are yellow."],
                     use_tqdm=False)
    for out in outs:
        want = torch.sigmoid(torch.tensor(hf_logits(hf, out.prompt_token_ids)[0])).item()
        assert out.outputs.score == pytest.approx(want, abs=1e-5)
