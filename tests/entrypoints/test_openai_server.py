"""The OpenAI-compatible server driven by the official `openai` client (SmolLM2, small limits)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL_NAME

AUTH = {"Authorization": f"Bearer {API_KEY}"}

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Name a colour."}]


def test_models_lists_the_served_name(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].max_model_len == 256
    # The weight format served (jaxserve's key): the fixture serves float32 weights.
    assert not server.llm.engine.model.quant and models[0].quantization == "none"


def test_greedy_completion_with_usage(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL_NAME
    assert r.choices[0].text.startswith(", the city of")
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 6, 10)


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=8,
                                       temperature=0)
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.usage.completion_tokens == 8 or r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 10  # the chat template wraps the message


def test_streamed_text_equals_non_streamed_text(client):
    kw = dict(model=MODEL_NAME, max_tokens=10, temperature=0.9, seed=1234)
    full = client.completions.create(prompt=PROMPT, **kw)
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason

    full = client.chat.completions.create(messages=MESSAGES, **kw)
    chunks = list(client.chat.completions.create(
        messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_n_equals_two(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=2,
                                  temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 16
    assert r.choices[0].text != r.choices[1].text
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                          n=2, temperature=1.0, seed=7)
    assert len(chat.choices) == 2


def test_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and 3 <= len(top) <= 4  # top-3 plus the sampled token
        assert top[token] == pytest.approx(max(top.values()))  # greedy takes the best
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
               for c in content)


def test_stop_and_vllm_sampling_extras(client):
    base = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                     temperature=0)
    word = base.choices[0].text.split()[2]  # ", the city of ..." -> "city"
    cut = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                    temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].stop_reason == word
    assert base.choices[0].text.startswith(cut.choices[0].text) and word not in cut.choices[0].text
    extra = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0.8, seed=3,
        extra_body={"top_k": 1, "min_p": 0.05, "repetition_penalty": 1.0, "ignore_eos": True})
    assert extra.choices[0].text == base.choices[0].text  # top_k=1 is greedy
    assert extra.usage.completion_tokens == 12


def test_token_id_prompts_and_echo(client, server):
    import httpx

    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT},
                     headers=AUTH).json()["tokens"]
    r = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:2]], max_tokens=3,
                                  temperature=0, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text.startswith(PROMPT + ", the")
    assert r.usage.prompt_tokens == len(ids) + 2


def test_tokenize_and_detokenize(server):
    import httpx

    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()
    assert tok["count"] == len(tok["tokens"]) == 4 and tok["max_model_len"] == 256
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]},
                      headers=AUTH).json()
    assert text == {"prompt": PROMPT}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES},
                      headers=AUTH).json()
    assert chat["count"] > tok["count"]


def test_async_clients_share_the_engine(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY,
                                    max_retries=0, timeout=120)
        return await asyncio.gather(*(client.completions.create(
            model=MODEL_NAME, prompt=f"{i} + {i} =", max_tokens=4, temperature=0)
            for i in range(6)))

    results = asyncio.run(main())
    assert all(r.usage.completion_tokens == 4 for r in results)
