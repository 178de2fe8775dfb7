"""`/score`, `/rerank` and `/classify` over raw HTTP on a pooling server of a tiny BERT
cross-encoder, against transformers' sigmoid of the pair's logit (token types included): every
spelling of the sides, every path, `top_n` and `return_documents`, and the 400s naming the
field (bad pairs, empty documents, over-long inputs, the wrong runner)."""

from __future__ import annotations

import os

import httpx
import pytest

from jaxserve.bench.pair_tokenizer import pair_tokenizer
from tests.entrypoints.conftest import MODEL_NAME, ServerThread, fake_server
from tests.pooling.encoders import ENCODER_ENGINE, save_encoder

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

QUERY = "What is the capital of France?"
DOCS = ["Bananas are yellow.", "Paris is the capital and largest city of France.",
        "The Eiffel Tower is in Paris."]


@pytest.fixture(scope="module")
def cross(smollm2_tokenizer, tmp_path_factory):
    """(transformers model, pair tokenizer, directory) of a one-class BERT cross-encoder."""
    torch.set_num_threads(1)
    root = str(tmp_path_factory.mktemp("score_server"))
    tok = pair_tokenizer(smollm2_tokenizer, os.path.join(root, "tokenizer"))
    hf, path = save_encoder(root, "cross", "BertForSequenceClassification",
                            os.path.join(root, "tokenizer"), num_labels=1, seed=1)
    return hf, tok, path


@pytest.fixture(scope="module")
def server(cross):
    from models.loaders import load_model

    srv = ServerThread(load_model(cross[2], "float32"), cross[1], runner="pooling",
                       **ENCODER_ENGINE)
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME, **body}, timeout=60)


def oracle(cross, a: str, b: str) -> float:
    hf, tok, _ = cross
    enc = tok(a, b, return_tensors="pt", return_token_type_ids=True)
    with torch.no_grad():
        return torch.sigmoid(hf(**enc).logits[0, 0]).item()


def test_score_every_spelling_equals_transformers(server, cross):
    want = [oracle(cross, QUERY, d) for d in DOCS]
    tok = cross[1]
    tokens = sum(len(tok(QUERY, d).input_ids) for d in DOCS)
    for path, (a, b) in [("/score", ("queries", "documents")), ("/v1/score", ("text_1", "text_2")),
                         ("/v1/score", ("data_1", "data_2")), ("/score", ("queries", "items"))]:
        r = post(server, path, {a: QUERY, b: DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list" and body["model"] == MODEL_NAME
        assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert all(d["object"] == "score" for d in body["data"])
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
    pairwise = post(server, "/score", {"queries": [QUERY, DOCS[0]], "documents": DOCS[1:]})
    assert [d["score"] for d in pairwise.json()["data"]] == pytest.approx(
        [oracle(cross, QUERY, DOCS[1]), oracle(cross, DOCS[0], DOCS[2])], abs=1e-5)


def test_rerank_orders_documents_with_top_n(server, cross):
    want = [oracle(cross, QUERY, d) for d in DOCS]
    order = sorted(range(3), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = post(server, path, {"query": QUERY, "documents": DOCS}).json()
        assert [r["index"] for r in body["results"]] == order
        assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
            [want[i] for i in order], abs=1e-5)
        assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
        assert body["model"] == MODEL_NAME and body["usage"]["prompt_tokens"] > 0
    top = post(server, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 1,
                                   "return_documents": False}).json()["results"]
    assert [r["index"] for r in top] == order[:1] and "document" not in top[0]


def test_classify_gives_sigmoid_probs_and_labels(server, cross):
    body = post(server, "/classify", {"input": [QUERY, DOCS[0]]}).json()
    hf, tok, _ = cross
    for d, text in zip(body["data"], [QUERY, DOCS[0]], strict=True):
        with torch.no_grad():
            logit = hf(torch.tensor([tok(text).input_ids])).logits[0, 0]
        assert d["probs"] == pytest.approx([torch.sigmoid(logit).item()], abs=1e-5)
        assert d["label"] == "LABEL_0" and d["num_classes"] == 1
    raw = post(server, "/classify", {"input": DOCS[0], "use_activation": False}).json()
    assert raw["data"][0]["probs"] == pytest.approx([logit.item()], abs=1e-4)  # not squashed


def test_pooling_of_a_classifier_gives_its_class_values(server):
    texts = [QUERY, DOCS[0]]
    want = [d["probs"] for d in post(server, "/classify", {"input": texts}).json()["data"]]
    body = post(server, "/pooling", {"input": texts}).json()
    assert [d["data"][0] for d in body["data"]] == pytest.approx([w[0] for w in want], abs=1e-6)
    assert all(len(d["data"]) == 1 for d in body["data"])
    assert [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    raw = post(server, "/pooling", {"input": DOCS[0], "use_activation": False}).json()
    logit = post(server, "/classify", {"input": DOCS[0], "use_activation": False}).json()
    assert raw["data"][0]["data"] == pytest.approx(logit["data"][0]["probs"], abs=1e-6)


@pytest.mark.parametrize("path,body,param,message", [
    ("/score", {"queries": [QUERY, QUERY], "documents": DOCS}, "documents", "data_1 has 2"),
    ("/score", {"documents": DOCS}, "queries", "queries and documents"),
    ("/score", {"text_1": QUERY, "text_2": []}, "text_2", "at least one"),
    ("/rerank", {"query": QUERY, "documents": []}, "documents", "must not be empty"),
    ("/rerank", {"query": QUERY, "documents": ["word " * 80]}, "documents",
     "maximum context length"),
    ("/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n", "top_n"),
    ("/score", {"queries": "a <|im_end|> b", "documents": DOCS}, "queries", "separator"),
    ("/score", {"queries": QUERY, "documents": DOCS, "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens", "truncate_prompt_tokens"),
    ("/classify", {"input": ["word " * 80]}, "input", "maximum context length"),
    ("/classify", {"input": []}, "input", "must not be empty"),
    ("/pooling", {"input": "Hi", "task": "token_classify"}, "task", "per-token"),
    ("/pooling", {"input": "Hi", "task": "embed"}, "task", "serves 'classify'"),
    ("/pooling", {"input": "Hi", "dimensions": 4}, "dimensions", "apply to embeddings"),
])
def test_bad_requests_are_400s_naming_the_field(server, path, body, param, message):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert message in err["message"] and err["param"] == param


def test_truncation_is_asked_for_never_silent(server):
    long = {"query": QUERY, "documents": ["word " * 80], "truncate_prompt_tokens": 40}
    assert post(server, "/rerank", long).status_code == 200
    assert server.wait_idle()["jaxserve:kv_cache_usage_perc"] == 0


def test_embeddings_of_a_classifier_and_a_generate_server_are_400s(server):
    r = post(server, "/v1/embeddings", {"input": "Hi"})
    assert r.status_code == 400 and "sequence classifier" in r.json()["error"]["message"]
    with fake_server() as url:
        for path, api in (("/score", "Score"), ("/v1/rerank", "Rerank"),
                          ("/classify", "Classification"), ("/pooling", "Pooling")):
            r = httpx.post(f"{url}{path}", json={"model": "fake", "query": "a", "documents": ["b"],
                                                 "queries": "a", "input": "a"})
            assert r.status_code == 400
            assert f"does not support the {api} API" in r.json()["error"]["message"]
