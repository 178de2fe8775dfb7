"""The OpenAI server over a real image engine (the tiny Gemma 3 of tests/e2e/test_gemma3_images.py,
SmolLM2's string chat template, so the front end writes the image marker in place): the official
`openai` client's `image_url` data URLs give transformers' greedy tokens, a bad image is a 400
naming its part while a concurrent good request completes, the KV pool is empty after, and
`/metrics` counts the encoder cache under vLLM's `mm_cache_*` names."""

from __future__ import annotations

import openai
import pytest

from jaxserve.entrypoints.openai.api_server import ServingLimits
from jaxserve.multimodal.config import MultiModalConfig
from tests.e2e import test_gemma3_images as gemma3
from tests.e2e.test_gemma3_images import ENGINE, MAX_TOKENS, hf_greedy, picture
from tests.entrypoints.conftest import MODEL_NAME, ServerThread
from tests.multimodal.test_chat_images import url_part

MM = MultiModalConfig(limit_mm_per_prompt={"image": 2}, allow_http_images=False)
# The e2e tests' builder, (directory, transformers model, processor) of a tiny random Gemma 3.
gemma3_built = gemma3.built
# The reply's token ids (vLLM's `return_token_ids`) and every token generated.
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def server(gemma3_built):
    """The tiny Gemma 3 engine behind uvicorn (2 images a prompt, no http(s) images)."""
    srv = ServerThread(gemma3_built[0], None, limits=ServingLimits(multimodal=MM), **ENGINE)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


def ask(client, *parts, max_tokens=MAX_TOKENS):
    """A greedy chat completion of one user message of `parts`."""
    return client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": list(parts)}],
        max_tokens=max_tokens, temperature=0.0, extra_body=EXTRA)


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def rendered(built, content: str) -> str:
    """The chat template's text of one user message (the marker where each image was)."""
    return built[2].tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


def test_image_url_data_urls_give_transformers_tokens(client, server, gemma3_built):
    built = gemma3_built
    a, b = picture(1), picture(2)
    got = ask(client, text("Describe"), url_part(a), text(" and compare it with"),
              url_part(b), text(" please."))
    prompt = rendered(built, "Describe<start_of_image> and compare it with<start_of_image> "
                             "please.")
    # the prompt as transformers' processor expands it (each marker to its image's tokens)
    assert got.prompt_token_ids == list(built[2](text=[prompt], images=[[a, b]])["input_ids"][0])
    assert got.choices[0].token_ids == hf_greedy(built, prompt, [a, b])
    assert got.usage.completion_tokens == MAX_TOKENS


def test_the_same_image_again_is_counted_in_metrics(client, server, gemma3_built):
    """The same image twice: after the same text its pages come from the prefix cache (no
    encoder lookup at all); after other text (no shared page) it is found encoded, vLLM's
    `mm_cache_hits`, and not encoded again. `/metrics` shows the engine's figures."""
    built = gemma3_built
    img = picture(7)
    tail = (url_part(img), text("? Say it in many words."))
    ask(client, text("What is in"), *tail)
    before = server.wait_idle()
    again = ask(client, text("What is in"), *tail)
    same_text = server.wait_idle()
    other = ask(client, text("Tell me what you see in"), *tail)
    after = server.wait_idle()
    assert again.choices[0].token_ids == hf_greedy(
        built, rendered(built, "What is in<start_of_image>? Say it in many words."), [img])
    assert other.choices[0].token_ids == hf_greedy(
        built, rendered(built, "Tell me what you see in<start_of_image>? Say it in many "
                               "words."), [img])
    assert same_text["jaxserve:prefix_cache_hits_total"] >= \
        before["jaxserve:prefix_cache_hits_total"] + 16  # the image's pages
    assert same_text["jaxserve:mm_cache_queries_total"] == \
        before["jaxserve:mm_cache_queries_total"]
    assert after["jaxserve:mm_cache_hits_total"] == same_text["jaxserve:mm_cache_hits_total"] + 1
    assert after["jaxserve:mm_cache_queries_total"] == \
        same_text["jaxserve:mm_cache_queries_total"] + 1
    assert after["jaxserve:encoder_cache_misses_total"] == \
        before["jaxserve:encoder_cache_misses_total"]  # not encoded again
    assert after["jaxserve:encoder_cache_capacity_rows"] >= 16
    assert 0 < after["jaxserve:encoder_cache_usage_perc"] <= 1
    engine = server.llm.engine.get_metrics()
    for name in ("mm_cache_hits", "mm_cache_queries", "encoder_cache_misses",
                 "encoder_cache_evictions"):
        assert after[f"jaxserve:{name}_total"] == engine[f"jaxserve:{name}"], name


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},  # undecodable
    {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},  # not allowed
])
def test_a_bad_image_is_a_400_naming_its_part_while_a_good_request_completes(
        client, server, part):
    """A streamed image request is running (its first chunk came) when the bad one comes."""
    stream = client.chat.completions.create(
        model=MODEL_NAME, stream=True, max_tokens=24, temperature=0.0,
        messages=[{"role": "user", "content": [text("What is in"), url_part(picture(3)),
                                               text("?")]}],
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [next(stream)]
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, text("What is in"), part, text("?"))
    assert e.value.status_code == 400 and e.value.body["param"] == "messages[0].content[1]"
    chunks += list(stream)
    assert chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    idle = server.wait_idle()
    assert idle["jaxserve:kv_cache_usage_perc"] == 0
    assert idle["jaxserve:num_requests_running"] == 0


def test_more_images_than_the_limit_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, *(url_part(picture(i)) for i in (1, 2, 3)), text("?"))
    assert e.value.body["param"] == "messages[0].content[2]", e.value.body
    assert "limit_mm_per_prompt" in e.value.body["message"], e.value.body
    assert server.wait_idle()["jaxserve:kv_cache_usage_perc"] == 0
