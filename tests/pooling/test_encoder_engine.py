"""Encoders through the pooling runner against transformers: BERT's CLS embeddings, an
XLM-RoBERTa sentence-transformers directory's MEAN embeddings, a BERT classifier's class
probabilities and a BERT cross-encoder's pair scores (`LLM.embed`, `LLM.classify`,
`LLM.score`), each packed in mixed batches and alone, and their errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxserve import LLM, PoolingParams
from jaxserve.bench.pair_tokenizer import SEP_ID, pair_tokenizer
from tests.pooling.encoders import ENCODER_ENGINE, save_encoder

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

PROMPTS = ["The capital of France is", "Hi",
           "def add(a, b):\n    return a + b",
           "A long walk through the old town, past the market and the church."]
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and largest city of France.", "Bananas are yellow.",
        "The Eiffel Tower is in Paris."]


@pytest.fixture(scope="module")
def built(smollm2_tokenizer, tmp_path_factory):
    """{name: (transformers model, directory)} and the pair tokenizer."""
    torch.set_num_threads(1)
    root = str(tmp_path_factory.mktemp("encoders"))
    tok = pair_tokenizer(smollm2_tokenizer, os.path.join(root, "tokenizer"))
    tok_dir = os.path.join(root, "tokenizer")
    models = {
        "bert": save_encoder(root, "bert", "BertModel", tok_dir),
        "xlmr": save_encoder(root, "xlmr", "XLMRobertaModel", tok_dir),
        "bert_cls": save_encoder(root, "bert_cls", "BertForSequenceClassification", tok_dir,
                                 num_labels=3),
        "cross": save_encoder(root, "cross", "BertForSequenceClassification", tok_dir,
                              num_labels=1, seed=1),
    }
    # A sentence-transformers directory: mean pooling, then a Normalize module.
    xlmr_dir = models["xlmr"][1]
    os.makedirs(os.path.join(xlmr_dir, "1_Pooling"))
    with open(os.path.join(xlmr_dir, "modules.json"), "w") as f:
        json.dump([{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models."
                    "Transformer"}, {"idx": 1, "name": "1", "path": "1_Pooling",
                                     "type": "sentence_transformers.models.Pooling"},
                   {"idx": 2, "name": "2", "path": "2_Normalize",
                    "type": "sentence_transformers.models.Normalize"}], f)
    with open(os.path.join(xlmr_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}, f)
    return models, tok


class _Engines(dict):
    """Each model's engine, built when a test first asks for it (the slow tier's alone)."""

    def __init__(self, models):
        super().__init__()
        self.models = models

    def __missing__(self, name):
        self[name] = LLM(self.models[name][1], runner="pooling", **ENCODER_ENGINE)
        return self[name]


@pytest.fixture(scope="module")
def engines(built):
    return _Engines(built[0])


def hf_out(hf, ids, types=None):
    with torch.no_grad():
        kw = {} if types is None else {"token_type_ids": torch.tensor([types])}
        return hf(torch.tensor([ids]), **kw)


def unit(v) -> np.ndarray:
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


def test_bert_cls_embeddings_packed_and_alone_equal_transformers(built, engines):
    hf = built[0]["bert"][0]
    llm = engines["bert"]
    outs = llm.embed(PROMPTS, use_tqdm=False)  # one step: every prompt packed together
    for out in outs:
        assert out.prompt_token_ids[0] == 1 and out.prompt_token_ids[-1] == SEP_ID
        want = unit(hf_out(hf, out.prompt_token_ids).last_hidden_state[0, 0].numpy())
        assert float(np.asarray(out.outputs.embedding) @ want) > 1 - 1e-5
    alone = llm.embed(PROMPTS[2], use_tqdm=False)[0]
    np.testing.assert_allclose(alone.outputs.embedding, outs[2].outputs.embedding, atol=1e-5)
    stats = llm.engine.kv.stats()
    assert stats.num_used_pages == 0 and stats.num_free_pages == stats.num_total_pages
    sc, cache = llm.engine.worker.config.scheduler, llm.engine.worker.config.cache
    assert not sc.chunked and not cache.enable_prefix_caching


def test_sentence_transformers_xlmr_mean_normalized(built, engines):
    hf = built[0]["xlmr"][0]
    llm = engines["xlmr"]
    assert llm.engine.pooler.config.pooling_type == "MEAN" and llm.engine.pooler.config.normalize
    for out in llm.embed(PROMPTS, use_tqdm=False):
        want = unit(hf_out(hf, out.prompt_token_ids).last_hidden_state[0].numpy().mean(0))
        got = np.asarray(out.outputs.embedding)
        assert abs(np.linalg.norm(got) - 1) < 1e-6 and float(got @ want) > 1 - 1e-5


@pytest.mark.slow(reason="an engine of its own; the cross-encoder's classify and the Qwen3 "
                  "classifier's softmax (test_decoder_classifier.py) run in the default tier")
def test_classify_probs_and_logits_equal_transformers(built, engines):
    hf = built[0]["bert_cls"][0]
    llm = engines["bert_cls"]
    outs = llm.classify(PROMPTS, use_tqdm=False)
    raw = llm.classify(PROMPTS[:2], PoolingParams(task="classify", use_activation=False),
                       use_tqdm=False)
    for i, out in enumerate(outs):
        logits = hf_out(hf, out.prompt_token_ids).logits[0].numpy()
        assert out.request_id.startswith("classify-") and out.outputs.num_classes == 3
        np.testing.assert_allclose(out.outputs.probs, torch.softmax(
            torch.tensor(logits), -1).numpy(), atol=1e-5)
        if i < 2:
            np.testing.assert_allclose(raw[i].outputs.probs, logits, atol=1e-4)


def test_cross_encoder_scores_equal_transformers_with_token_types(built, engines):
    hf, tok = built[0]["cross"][0], built[1]
    llm = engines["cross"]
    one_to_n = llm.score(QUERY, DOCS, use_tqdm=False)
    n_to_n = llm.score([QUERY, DOCS[0]], [DOCS[0], QUERY], use_tqdm=False)
    pairs = [(QUERY, d) for d in DOCS] + [(QUERY, DOCS[0]), (DOCS[0], QUERY)]
    for (a, b), out in zip(pairs, one_to_n + n_to_n, strict=True):
        enc = tok(a, b, return_token_type_ids=True)
        assert out.prompt_token_ids == enc["input_ids"]
        logit = hf_out(hf, enc["input_ids"], enc["token_type_ids"]).logits[0, 0]
        assert out.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)
        # the second segment's type matters: all-zero types score otherwise
        flat = hf_out(hf, enc["input_ids"], [0] * len(enc["input_ids"])).logits[0, 0]
        assert abs(torch.sigmoid(flat).item() - out.outputs.score) > 1e-4
    alone = llm.score(QUERY, DOCS[1], use_tqdm=False)[0]
    assert alone.outputs.score == pytest.approx(one_to_n[1].outputs.score, abs=1e-6)


@pytest.mark.slow(reason="an engine of its own; ModernBERT's forward is checked against "
                  "transformers in tests/models/test_encoder.py, the engine's mechanics by BERT")
def test_modernbert_cross_encoder_scores_equal_transformers(built, tmp_path_factory):
    tok = built[1]
    root = str(tmp_path_factory.mktemp("modernbert"))
    tok_dir = os.path.join(root, "tokenizer")
    tok.save_pretrained(tok_dir)
    hf, path = save_encoder(root, "mb", "ModernBertForSequenceClassification", tok_dir,
                            num_labels=1)
    llm = LLM(path, runner="pooling", **ENCODER_ENGINE)
    long_doc = "The city of Paris, on the Seine, has been the capital of France for ages."
    outs = llm.score(QUERY, [*DOCS, long_doc], use_tqdm=False)
    for doc, out in zip([*DOCS, long_doc], outs, strict=True):
        enc = tok(QUERY, doc)  # ModernBERT reads no token types: the tokenizer's are not used
        logit = hf_out(hf, enc["input_ids"]).logits[0, 0]
        assert out.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)
    (emb,) = llm.classify(PROMPTS[3], use_tqdm=False)
    assert emb.outputs.num_classes == 1


def test_embedding_model_scores_are_cosines(engines):
    llm = engines["bert"]
    scores = llm.score(QUERY, DOCS[:2], use_tqdm=False)
    q, *docs = llm.embed([QUERY, *DOCS[:2]], use_tqdm=False)
    for out, d in zip(scores, docs, strict=True):
        want = float(unit(q.outputs.embedding) @ unit(d.outputs.embedding))
        assert out.outputs.score == pytest.approx(want, abs=1e-6)
        assert out.prompt_token_ids == q.prompt_token_ids + d.prompt_token_ids


def test_truncate_prompt_tokens_cuts_never_silently(built, engines):
    llm, tok = engines["bert"], built[1]
    long = " ".join(["word"] * 80)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed(long, use_tqdm=False)
    (cut,) = llm.embed(long, truncate_prompt_tokens=10, use_tqdm=False)
    assert cut.prompt_token_ids == tok(long, truncation=True, max_length=10).input_ids
    assert cut.prompt_token_ids[-1] == SEP_ID and len(cut.prompt_token_ids) == 10
    (ids,) = llm.embed([list(range(100, 200))], truncate_prompt_tokens=-1, use_tqdm=False)
    assert ids.prompt_token_ids == list(range(100, 200))[-63:]
    for bad in (0, -2, 64, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.embed("hi", truncate_prompt_tokens=bad, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_task_and_pair_errors(engines):
    with pytest.raises(ValueError, match="task='classify'"):
        engines["bert"].classify("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="task='embed'"):
        engines["cross"].embed("hi", use_tqdm=False)
    with pytest.raises(ValueError, match="one class"):  # a bare Pooler: no engine to build
        from jaxserve.engine.pooling import Pooler
        from jaxserve.pooling_params import ClassifierHead, PoolerConfig

        Pooler(PoolerConfig("CLS"), 3, ClassifierHead(3)).check(PoolingParams(task="score"))
    with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3"):
        engines["cross"].score(["a", "b"], DOCS, use_tqdm=False)
    with pytest.raises(ValueError, match="at least one"):
        engines["cross"].score("a", [], use_tqdm=False)
    with pytest.raises(ValueError, match="text_1 holds the separator"):
        engines["cross"].score("a <|im_end|> b", "c", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_params"):
        engines["bert"].embed("hi", PoolingParams(task="score"), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions and normalize"):
        PoolingParams(task="classify", normalize=True)
    with pytest.raises(ValueError, match="update_weights: encoder"):
        engines["bert"].update_weights({})
    for llm in list(engines.values()):
        assert not llm.engine.has_unfinished_requests()


def test_engine_config_errors(built):
    models = built[0]
    with pytest.raises(ValueError, match="runner='generate'.*encoder"):
        LLM(models["bert"][1], **ENCODER_ENGINE)
    with pytest.raises(ValueError, match="pooler_config.pooling_type='MEAN'"):
        LLM(models["cross"][1], runner="pooling", pooler_config={"pooling_type": "MEAN"},
            **ENCODER_ENGINE)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(models["bert"][1], runner="pooling", **{**ENCODER_ENGINE,
                                                    "max_num_batched_tokens": 32})


def test_embeddings_and_scores_equal_sentence_transformers(built, engines):
    """The oracles users compare with: sentence-transformers' own `SentenceTransformer` on the
    XLM-R directory (its modules.json: mean pooling, then Normalize) and `CrossEncoder` on
    the BERT cross-encoder (a sigmoid over its one logit), against `LLM.embed` and
    `LLM.score`, packed."""
    st = pytest.importorskip("sentence_transformers")
    models = built[0]
    want = st.SentenceTransformer(models["xlmr"][1], device="cpu").encode(PROMPTS)
    got = [o.outputs.embedding for o in engines["xlmr"].embed(PROMPTS, use_tqdm=False)]
    for g, w in zip(got, want, strict=True):
        assert float(unit(g) @ unit(w)) > 1 - 1e-5
        np.testing.assert_allclose(g, w, atol=1e-4)
    pairs = [(QUERY, d) for d in DOCS]
    # NOTE: the test tokenizer (SmolLM2's, BERT's special tokens) gives pairs' token types only
    # when asked and carries SmolLM2's chat template, which sentence-transformers 6 formats
    # pairs with; a BERT cross-encoder's tokenizer always gives types and has no template.
    template = os.path.join(models["cross"][1], "chat_template.jinja")
    if os.path.exists(template):
        os.remove(template)
    config = os.path.join(models["cross"][1], "tokenizer_config.json")
    with open(config) as f:
        tok_config = json.load(f)
    tok_config["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    with open(config, "w") as f:
        json.dump(tok_config, f)
    want = st.CrossEncoder(models["cross"][1], device="cpu").predict(pairs)
    got = [o.outputs.score for o in engines["cross"].score(QUERY, DOCS, use_tqdm=False)]
    np.testing.assert_allclose(got, want, atol=1e-5)
