"""`POST /v1/embeddings` driven by the official `openai` client on a pooling server over the
tiny Llama: vectors against transformers' pooled hidden states, float and base64, batched and
token-id input, usage, and the 400s of each runner's refusals."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import TINY_ENGINE
from tests.entrypoints.conftest import MODEL_NAME, ServerThread, fake_server

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TEXTS = ["The capital of France is", "def add(a, b):\n    return a + b", "Hi"]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from models.loaders import load_model, load_tokenizer

    srv = ServerThread(load_model(tiny_model_dir, "float32"), load_tokenizer(tiny_model_dir),
                       runner="pooling", warmup=False, **TINY_ENGINE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    """`ids -> ` transformers' last-token hidden state, normalized (the default pooler)."""
    torch.set_num_threads(1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager").eval()

    def embed(ids):
        with torch.no_grad():
            h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        return (h / h.norm()).numpy()

    return embed


def test_batched_text_float_matches_transformers_with_usage(client, server, oracle):
    r = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == MODEL_NAME
    assert [d.index for d in r.data] == [0, 1, 2]
    tok = server.llm.tokenizer
    ids = [tok(t).input_ids for t in TEXTS]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    for d, i in zip(r.data, ids, strict=True):
        assert float(np.dot(d.embedding, oracle(i))) > 1 - 1e-5


def test_base64_decodes_to_the_float_vectors(client, server):
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0],
                                      encoding_format="float").data[0].embedding
    raw = httpx.post(f"{server.url}/v1/embeddings", timeout=60,
                     json={"model": MODEL_NAME, "input": TEXTS[0],
                           "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_array_equal(decoded, np.asarray(floats, np.float32))
    # the client's default asks for base64 and decodes it itself
    default = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0]).data[0].embedding
    np.testing.assert_allclose(default, floats, rtol=1e-6)


def test_token_id_input_and_dimensions(client, server):
    tok = server.llm.tokenizer
    ids = [tok(t).input_ids for t in TEXTS[:2]]
    by_text = client.embeddings.create(model=MODEL_NAME, input=TEXTS[:2],
                                       encoding_format="float")
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids, encoding_format="float")
    one = client.embeddings.create(model=MODEL_NAME, input=ids[0], encoding_format="float")
    for a, b in zip(by_text.data, by_ids.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(one.data[0].embedding, by_ids.data[0].embedding, rtol=1e-5,
                               atol=1e-6)
    cut = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=8,
                                   encoding_format="float").data[0].embedding
    want = np.asarray(by_text.data[0].embedding[:8])
    np.testing.assert_allclose(cut, want / np.linalg.norm(want), rtol=1e-5, atol=1e-6)


def test_errors_are_openai_400s(client, server):
    with pytest.raises(openai.BadRequestError, match="dimensions=1000 exceeds") as e:
        client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], dimensions=1000)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError, match="does not support the Completions API"):
        client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Chat Completions API.*pooling runner"):
        client.chat.completions.create(model=MODEL_NAME, max_tokens=2,
                                       messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="Responses API.*pooling runner"):
        client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="input must not be empty"):
        client.embeddings.create(model=MODEL_NAME, input=[])
    with pytest.raises(openai.BadRequestError, match="input holds token ids outside"):
        client.embeddings.create(model=MODEL_NAME, input=[[1, 10**7]])
    assert server.wait_idle()["jaxserve:kv_cache_usage_perc"] == 0


def test_a_generate_server_answers_embeddings_with_a_400():
    with fake_server() as url:
        r = httpx.post(f"{url}/v1/embeddings", json={"model": "fake", "input": "Hi"})
    assert r.status_code == 400
    assert "does not support the Embeddings API" in r.json()["error"]["message"]


def test_async_llm_encode(server, oracle):
    import asyncio

    from jaxserve import PoolingParams

    out = asyncio.run(server.llm.encode("Hi there", PoolingParams(), "encode-1"))
    assert out.finished and out.request_id == "encode-1"
    assert float(np.dot(out.outputs.embedding, oracle(out.prompt_token_ids))) > 1 - 1e-5


def test_score_and_rerank_of_an_embedding_model_are_cosines(client, server):
    vecs = [np.asarray(d.embedding) for d in client.embeddings.create(
        model=MODEL_NAME, input=TEXTS, encoding_format="float").data]
    want = [float(vecs[0] @ v / np.linalg.norm(vecs[0]) / np.linalg.norm(v)) for v in vecs[1:]]
    body = {"model": MODEL_NAME, "queries": TEXTS[0], "documents": TEXTS[1:]}
    scores = httpx.post(f"{server.url}/v1/score", json=body, timeout=60).json()["data"]
    assert [d["score"] for d in scores] == pytest.approx(want, abs=1e-5)
    ranked = httpx.post(f"{server.url}/rerank", timeout=60, json={
        "model": MODEL_NAME, "query": TEXTS[0], "documents": TEXTS[1:]}).json()["results"]
    assert [r["index"] for r in ranked] == sorted(range(2), key=lambda i: -want[i])
    r = httpx.post(f"{server.url}/classify", json={"model": MODEL_NAME, "input": "Hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "Classification API" in r.json()["error"]["message"]


def test_pooling_endpoint_gives_the_embeddings(client, server):
    want = [d.embedding for d in client.embeddings.create(
        model=MODEL_NAME, input=TEXTS, encoding_format="float").data]
    body = httpx.post(f"{server.url}/pooling", timeout=60,
                      json={"model": MODEL_NAME, "input": TEXTS}).json()
    assert body["object"] == "list" and body["id"].startswith("pool")
    assert [d["object"] for d in body["data"]] == ["pooling"] * 3
    for d, w in zip(body["data"], want, strict=True):
        np.testing.assert_allclose(d["data"], w, atol=1e-6)
    b64 = httpx.post(f"{server.url}/pooling", timeout=60, json={
        "model": MODEL_NAME, "input": TEXTS[2], "encoding_format": "base64"}).json()
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(b64["data"][0]["data"]), "<f4"),
                               want[2], atol=1e-6)
    for extra, param in (({"task": "token_embed"}, "task"), ({"task": "classify"}, "task"),
                         ({"use_activation": True}, "use_activation")):
        r = httpx.post(f"{server.url}/pooling", json={"model": MODEL_NAME, "input": "Hi", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def assert_close(got, want) -> None:
    """`got` equals `want` (JSON), floats within 1e-6 (a step's batch may differ)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_close(got[k], want[k])
    elif isinstance(want, list):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_close(g, w)
    elif isinstance(want, float):
        assert got == pytest.approx(want, abs=1e-6)
    else:
        assert got == want


def test_run_batch_embeddings_score_and_rerank_lines_equal_the_server(server, tmp_path):
    """One file of each pooling URL through `run_batch_file` on the server's engine: the
    bodies the server answers (ids and times aside); a generate URL is `invalid_url`."""
    import json

    from jaxserve.entrypoints.run_batch import run_batch_file

    calls = [("e", "/v1/embeddings", {"input": TEXTS}),
             ("s", "/v1/score", {"queries": TEXTS[0], "documents": TEXTS[1:]}),
             ("r", "/v1/rerank", {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}),
             ("bad", "/v1/score", {"queries": TEXTS, "documents": TEXTS[:2]})]
    lines = [json.dumps({"custom_id": c, "method": "POST", "url": u,
                         "body": {"model": MODEL_NAME, **b}}) for c, u, b in calls]
    lines.append(json.dumps({"custom_id": "gen", "method": "POST", "url": "/v1/completions",
                             "body": {"model": MODEL_NAME, "prompt": "x"}}))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    counts = run_batch_file(server.llm, [MODEL_NAME], str(src), str(dst), use_tqdm=False)
    assert counts == {"total": 5, "succeeded": 3, "failed": 2, "skipped": 0}
    records = {r["custom_id"]: r for r in map(json.loads, dst.read_text().splitlines())}
    drop = ("id", "created")
    for cid, url, body in calls:
        http = httpx.post(f"{server.url}{url}", timeout=60, json={"model": MODEL_NAME, **body})
        got = records[cid]["response"]
        assert got["status_code"] == http.status_code
        want = {k: v for k, v in http.json().items() if k not in drop}
        got = {k: v for k, v in got["body"].items() if k not in drop}
        assert_close(got, want)
    assert records["bad"]["response"]["body"]["error"]["param"] == "documents"
    assert records["gen"]["error"]["code"] == "invalid_url"
