"""A decoder reranker scored from its LM head's yes/no logits (Qwen3-Reranker as vLLM converts
it: `hf_overrides` with `classifier_from_token` and `is_original_qwen3_reranker`) against
transformers' own Qwen3ForCausalLM: sigmoid(logit_yes - logit_no) at the last token of the
two texts concatenated; and the conversion's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve import LLM
from models.seq_cls_convert import overridden_config, token_ids, token_score_weight
from tests.conftest import TINY_ENGINE
from tests.e2e.hf_family import SMALL

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# vLLM's example (examples/pooling/score/qwen3_reranker_offline.py).
RERANKER = {"architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the "
          "Query and the Instruct provided. Answer only \"yes\" or \"no\".<|im_end|>\n"
          "<|im_start|>user\n<Query>: What is the capital of France?\n")
DOCS = ["<Document>: Paris.<|im_end|>\n<|im_start|>assistant\n",
        "<Document>: Bananas are yellow.<|im_end|>\n<|im_start|>assistant\n",
        "<Document>: " + "A long document about many things, none of them France. " * 6]


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, smollm2_tokenizer):
    """(transformers Qwen3ForCausalLM, its directory, the converted engine)."""
    torch.set_num_threads(1)
    config = transformers.Qwen3Config(**SMALL, tie_word_embeddings=False,
                                      attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(config).to(torch.float32).eval()
    path = str(tmp_path_factory.mktemp("reranker") / "qwen3")
    hf.save_pretrained(path, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(path)
    llm = LLM(path, runner="pooling", hf_overrides=RERANKER, warmup=False, **TINY_ENGINE)
    return hf, path, llm


def yes_no(hf, tokenizer, ids: list[int]) -> float:
    """The oracle: sigmoid(logit_yes - logit_no) at the last token."""
    no, yes = token_ids(tokenizer, ["no", "yes"])
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1]
    assert torch.softmax(logits[[no, yes]], -1)[1].item() == pytest.approx(
        torch.sigmoid(logits[yes] - logits[no]).item(), abs=1e-6)
    return torch.sigmoid(logits[yes] - logits[no]).item()


def test_reranker_scores_equal_the_yes_no_logits_of_transformers(reranker, smollm2_tokenizer):
    hf, _, llm = reranker
    outs = llm.score(PREFIX, DOCS, use_tqdm=False)
    for doc, out in zip(DOCS, outs, strict=True):
        # NOTE: the user's prompt format, concatenated (vLLM's use_pad_token=False)
        assert out.prompt_token_ids == smollm2_tokenizer(PREFIX + doc).input_ids
        assert out.outputs.score == pytest.approx(
            yes_no(hf, smollm2_tokenizer, out.prompt_token_ids), abs=1e-5)
    assert len(outs[2].prompt_token_ids) > TINY_ENGINE["max_num_batched_tokens"]  # chunked
    probs = llm.classify([PREFIX + DOCS[0]], use_tqdm=False)[0].outputs.probs
    assert probs == pytest.approx([outs[0].outputs.score], abs=1e-6)
    cut = llm.score(PREFIX, DOCS[2], truncate_prompt_tokens=40, use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 40
    assert cut.outputs.score == pytest.approx(
        yes_no(hf, smollm2_tokenizer, cut.prompt_token_ids), abs=1e-5)


def test_encode_and_reward_are_thin_over_classify(reranker, smollm2_tokenizer):
    hf, _, llm = reranker
    prompt = PREFIX + DOCS[1]
    probs = llm.classify(prompt, use_tqdm=False)[0].outputs.probs
    enc = llm.encode(prompt, pooling_task="classify", use_tqdm=False)[0]
    assert type(enc).__name__ == "PoolingRequestOutput" and enc.outputs.data == probs
    reward = llm.reward([prompt], use_tqdm=False)[0]
    no, yes = token_ids(smollm2_tokenizer, ["no", "yes"])
    with torch.no_grad():
        logits = hf(torch.tensor([reward.prompt_token_ids])).logits[0, -1]
    assert reward.outputs.data == pytest.approx([(logits[yes] - logits[no]).item()], abs=1e-4)
    for task, match in ((None, "pooling_task: LLM.encode needs"),
                        ("token_classify", "per-token"), ("embed", "task='embed'")):
        with pytest.raises(ValueError, match=match):
            llm.encode(prompt, pooling_task=task, use_tqdm=False)


def test_token_score_weights_and_convert(reranker, smollm2_tokenizer):
    hf = reranker[0]
    head = hf.lm_head.weight.detach().numpy()
    no, yes = token_ids(smollm2_tokenizer, ["no", "yes"])
    cfg = overridden_config({"architectures": ["Qwen3ForCausalLM"]},
                            {"classifier_from_token": ["no", "yes"],
                             "method": "no_post_processing"}, convert="classify")
    assert cfg["architectures"] == ["Qwen3ForSequenceClassification"]
    assert cfg["num_labels"] == 2 and cfg["use_pad_token"] is False
    np.testing.assert_array_equal(token_score_weight(cfg, head, smollm2_tokenizer),
                                  head[[no, yes]])
    two_way = overridden_config({"architectures": ["X"]}, RERANKER)
    assert two_way["method"] == "from_2_way_softmax" and two_way["num_labels"] == 1
    np.testing.assert_allclose(token_score_weight(two_way, head, smollm2_tokenizer),
                               head[[yes]] - head[[no]])
    assert overridden_config({"architectures": ["QForSequenceClassification"]}, None,
                             "embed")["architectures"] == ["QForCausalLM"]


@pytest.mark.parametrize("overrides,convert,match", [
    ({"is_original_qwen3_reranker": True}, "auto", "classifier_from_token"),
    ({"is_original_qwen3_reranker": True, "classifier_from_token": ["yes"]}, "auto",
     "classifier_from_token"),
    ({"method": "from_2_way_softmax", "classifier_from_token": ["a", "b", "c"]}, "auto",
     "from_2_way_softmax takes two"),
    ({"method": "softmax", "classifier_from_token": ["no", "yes"]}, "auto", "method"),
    ({"method": "no_post_processing"}, "auto", "classifier_from_token"),
    ([("architectures", "x")], "auto", "hf_overrides"),
    (None, "reward", "convert"),
])
def test_conversion_refusals_name_the_field(overrides, convert, match):
    with pytest.raises(ValueError, match=match):
        overridden_config({"architectures": ["Qwen3ForCausalLM"]}, overrides, convert)


def test_token_missing_from_the_vocabulary_and_engine_arguments(smollm2_tokenizer,
                                                                smollm2_path):
    from models.loaders import load_model

    with pytest.raises(ValueError, match="hf_overrides / convert: .* not a Hugging Face"):
        load_model(smollm2_path, hf_overrides=RERANKER)
    with pytest.raises(ValueError, match="classifier_from_token.*not-a-token"):
        token_ids(smollm2_tokenizer, ["no", "not-a-token"])
    with pytest.raises(ValueError, match="convert"):
        LLM("unused", runner="pooling", convert="reward")
    with pytest.raises(ValueError, match="hf_overrides"):
        LLM("unused", runner="pooling", hf_overrides='{"a": 1}')


def test_serve_flags_carry_hf_overrides_and_convert():
    import json

    from jaxserve.config import EngineConfig
    from jaxserve.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "--runner", "pooling", "--hf-overrides",
                                      json.dumps(RERANKER), "--convert", "classify"])
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    assert config.model.hf_overrides == RERANKER and config.model.convert == "classify"
    with pytest.raises(SystemExit):  # argparse's own refusal of a value not in the choices
        build_parser().parse_args(["serve", "--convert", "reward"])
