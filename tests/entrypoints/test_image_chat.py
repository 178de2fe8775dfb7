"""Images in chat completions end to end: the official `openai` client sends `image_url` parts,
the engine gets `{"prompt", "multi_modal_data"}` (the images as PIL images, in order, one
marker each in the rendered prompt), and every bad image is a 400 naming its content part
with nothing queued."""

from __future__ import annotations

import contextlib
import copy

import httpx
import numpy as np
import openai
import pytest

from jaxserve.engine.async_llm import AsyncLLM
from jaxserve.entrypoints.openai.api_server import ServingLimits, build_app
from jaxserve.multimodal.config import MultiModalConfig
from tests.entrypoints.conftest import running_server
from tests.entrypoints.fake_engine import ScriptedEngine
from tests.multimodal.test_chat_images import GEMMA_LIKE, url_part
from tests.multimodal.test_media import data_url, encoded, picture

MM = dict(limit_mm_per_prompt={"image": 2}, max_image_pixels=10_000, allow_http_images=False)


@contextlib.contextmanager
def image_server(tokenizer, **mm):
    """(client, engine): a server over a `ScriptedEngine` with `MultiModalConfig(**mm)`."""
    engine = ScriptedEngine(tokenizer, {"img": "A picture."})
    llm = AsyncLLM(engine, log_interval=0)
    with contextlib.ExitStack() as stack:
        stack.callback(llm.shutdown)
        app = build_app(llm, ["fake"], limits=ServingLimits(multimodal=MultiModalConfig(**mm)))
        url = stack.enter_context(running_server(app))[1]
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), engine


@pytest.fixture(scope="module")
def served(smollm2_tokenizer, tmp_path_factory):
    """(client, engine, media directory): a server allowing 2 images of at most 10,000
    pixels, files under the media directory, no http(s)."""
    media = tmp_path_factory.mktemp("media")
    (media / "a.png").write_bytes(encoded(picture(9, 4), "PNG"))
    (tmp_path_factory.getbasetemp() / "secret.png").write_bytes(encoded(picture(), "PNG"))
    with image_server(smollm2_tokenizer, allowed_local_media_path=str(media), **MM) as (c, e):
        yield c, e, media


def ask(client, *parts, template=GEMMA_LIKE, stream=False, **extra):
    """A chat completion of one user message of `parts`, rendered with `template`."""
    return client.chat.completions.create(
        model="fake", max_tokens=2, messages=[{"role": "user", "content": list(parts)}],
        stream=stream, extra_body={**({"chat_template": template} if template else {}), **extra})


def text(t: str) -> dict:
    return {"type": "text", "text": t}


@pytest.mark.parametrize("stream", [False, True])
def test_data_url_images_reach_the_engine_in_order(served, stream):
    client, engine, _ = served
    a, b = picture(12, 8), picture(5, 7)
    reply = ask(client, text("[img] first "), url_part(a), text(" then "), url_part(b, "WEBP"),
                stream=stream)
    if stream:
        reply = list(reply)
    else:
        assert reply.choices[0].finish_reason == "length"
    prompt, data = engine.prompts[-1], engine.multi_modal_data[-1]
    # SmolLM2's bos_token (the template's first) stays: its tokenizer adds none itself.
    assert prompt == "<|im_start|><start_of_turn>user\n[img] first <start_of_image> then " \
                     "<start_of_image><end_of_turn>\n<start_of_turn>model\n"
    images = data["image"]
    assert [(im.size, im.mode) for im in images] == [((12, 8), "RGB"), ((5, 7), "RGB")]
    assert np.array_equal(np.asarray(images[0]), np.asarray(a))  # PNG: the same pixels


def test_a_file_under_the_allowed_directory_is_read(served):
    client, engine, media = served
    ask(client, text("[img]"), {"type": "image_url", "image_url": {"url": f"file://{media}/a.png"}})
    assert engine.multi_modal_data[-1]["image"][0].size == (9, 4)


def test_text_only_chats_still_send_token_ids(served):
    client, engine, _ = served
    ask(client, text("[img] no picture"))
    assert engine.multi_modal_data[-1] is None and "no picture" in engine.prompts[-1]


BAD = {
    "undecodable": ({"url": "data:image/png;base64," + "iVBORw0KGgo" * 4}, "could not be decoded"),
    "bad base64": ({"url": "data:image/png;base64,@@@"}, "base64 is invalid"),
    "not an image URL": ({"url": "data:text/plain;base64,aGk="}, "a data URL must be"),
    "too many pixels": ({"url": data_url(encoded(picture(101, 100), "PNG"))},
                        "101x100 = 10100 pixels, more than the 10000 allowed"),
    "outside the directory": ({"url": "file://{media}/../secret.png"},
                              "outside --allowed-local-media-path"),
    "missing file": ({"url": "file://{media}/none.png"}, "cannot read"),
    "http off": ({"url": "http://127.0.0.1:9/a.png"}, "http(s) image URLs are off"),
    "unknown scheme": ({"url": "ftp://host/a.png"}, "unsupported image URL"),
    "no url": ({}, "an image_url part needs image_url.url"),
}


@pytest.mark.parametrize("case", BAD)
def test_each_bad_image_is_a_400_naming_its_part(served, case):
    client, engine, media = served
    image_url, message = BAD[case]
    image_url = {k: v.format(media=media) for k, v in image_url.items()}
    before = len(engine.prompts)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, text("[img]"), url_part(picture()), {"type": "image_url",
                                                           "image_url": image_url})
    error = e.value.body
    assert e.value.status_code == 400 and error["param"] == "messages[0].content[2]"
    assert error["message"].startswith("messages[0].content[2]: ") and message in error["message"]
    assert len(engine.prompts) == before  # nothing reached the engine
    ask(client, text("[img]"), url_part(picture()))  # and the server serves on
    assert len(engine.prompts) == before + 1


def test_more_images_than_the_limit_is_a_400(served):
    client, engine, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, text("[img]"), *[url_part(picture()) for _ in range(3)])
    assert e.value.body["param"] == "messages[0].content[3]"
    assert "more than 2 image(s) in one prompt (limit_mm_per_prompt)" in e.value.body["message"]


@pytest.mark.parametrize("parts, param, message", [
    ([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "messages",
     "only text and image_url content parts are supported, got ['input_audio']"),
    # SmolLM2's own template renders strings only, and the model has no image marker.
    ([url_part(picture())], "messages[0].content[1]", "takes no images"),
])
def test_parts_a_model_cannot_take_are_400s(served, parts, param, message):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, text("[img]"), *parts, template=None)
    assert e.value.body["param"] == param and message in e.value.body["message"]


def test_beam_search_and_tokenize_refuse_images(served):
    client, _, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, text("[img]"), url_part(picture()), use_beam_search=True)
    assert e.value.body["param"] == "use_beam_search"
    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    response = httpx.post(f"{base}/tokenize", json={
        "messages": [{"role": "user", "content": [url_part(picture())]}]})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == \
        "messages: image_url parts are not supported by this endpoint"


def test_responses_input_image_parts(smollm2_tokenizer):
    """`/v1/responses` `input_image` parts take the chat path; errors name the input item."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = GEMMA_LIKE  # Responses requests name no template of their own
    with image_server(tokenizer, **MM) as (client, engine):
        check_responses(client, engine)


def check_responses(client, engine):
    a = picture(8, 6)
    parts = [{"type": "input_text", "text": "[img] see "},
             {"type": "input_image", "image_url": data_url(encoded(a, "PNG"))}]
    client.responses.create(model="fake", instructions="be brief", max_output_tokens=2,
                            input=[{"role": "user", "content": parts}])
    assert "[img] see <start_of_image>" in engine.prompts[-1]
    assert engine.multi_modal_data[-1]["image"][0].size == (8, 6)
    for image, param, message in [
            ({"image_url": "data:image/png;base64,@@@"}, "input[1].content[0]",
             "input[1].content[0]: the data URL's base64 is invalid"),
            ({"file_id": "file-1"}, "input[1].content[0]", "file_id is not supported")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="fake", max_output_tokens=2, input=[
                {"role": "user", "content": "[img] first"},
                {"role": "user", "content": [{"type": "input_image", **image}]}])
        assert e.value.body["param"] == param and message in e.value.body["message"]
