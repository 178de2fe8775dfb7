"""Images in chat messages (`jaxserve.multimodal.chat`), `LLM.chat`'s image prompts and the
`MultiModalConfig` engine arguments: parts taken out in order and left as the template's
markers, every refusal naming its content part, transformers' templates and tokenizer as the
renderers."""

from __future__ import annotations

import copy
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.llm import LLM
from jaxserve.entrypoints.cli import build_parser, engine_kwargs
from jaxserve.multimodal.chat import (
    chat_prompt,
    engine_text,
    extract_images,
    image_marker,
    iterates_content,
    template_source,
)
from jaxserve.multimodal.config import DEFAULT_LIMIT, MultiModalConfig
from jaxserve.multimodal.media import MediaLimits
from tests.multimodal.test_media import data_url, encoded, picture

# Gemma 3's way with content parts (its template renders an image part as the marker).
GEMMA_LIKE = ("{{ bos_token }}{% for message in messages %}<start_of_turn>{{ message['role'] }}\n"
              "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
              "{% for part in message['content'] %}{% if part.type == 'image' %}"
              "<start_of_image>{% else %}{{ part.text }}{% endif %}{% endfor %}{% endif %}"
              "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
              "{% endif %}")
QWEN_LIKE = ("{% for m in messages %}{% set content = m.content %}{% if content is string %}"
             "{{ content }}{% else %}{% for c in content %}{% if c['type'] == 'image' %}"
             "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
             "{% endfor %}{% endif %}{% endfor %}")
STRING_ONLY = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n" \
              "{% endfor %}"
LIMITS = MediaLimits(max_pixels=10_000)


def user(*parts) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def url_part(img, fmt="PNG") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(encoded(img, fmt))}}


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer adding BOS (`<|im_start|>`) and holding Gemma 3's marker."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_image>"]})
    tok.add_bos_token = True
    return tok


@pytest.mark.parametrize("template, expected", [
    (GEMMA_LIKE, True), (QWEN_LIKE, True), (STRING_ONLY, False), ("{% for x in %}", False),
    ("{% for p in message.parts %}{{ p }}{% endfor %}", False)])
def test_the_content_format_is_read_from_the_template(template, expected):
    assert iterates_content(template) is expected


def test_parts_become_the_templates_image_parts_in_order():
    a, b = picture(12, 8), picture(5, 7)
    messages = [{"role": "system", "content": "be brief"},
                *user(text("first "), url_part(a), text(" then "), url_part(b))]
    got = extract_images(messages, LIMITS, 2)
    assert got.messages[0] == messages[0]
    assert got.messages[1]["content"] == [text("first "), {"type": "image"}, text(" then "),
                                          {"type": "image"}]
    assert [im.size for im in got.images] == [(12, 8), (5, 7)]
    assert np.array_equal(np.asarray(got.images[1]), np.asarray(b))
    as_text = extract_images(messages, LIMITS, 2, string_content=True, marker=lambda: "<M>")
    assert as_text.messages[1]["content"] == "first <M> then <M>"


@pytest.mark.parametrize("part, message", [
    (url_part(picture(200, 100)), "200x100 = 20000 pixels, more than the 10000 allowed"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
     "could not be decoded"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "file:// URLs are refused"),
    ({"type": "image_url", "image_url": {}}, "an image_url part needs image_url.url"),
    ({"type": "image_pil", "image_pil": picture()}, "content part type 'image_pil' is not "
                                                    "supported"),
    ({"type": "input_audio"}, "content part type 'input_audio' is not supported"),
])
def test_each_refusal_names_the_part(part, message):
    with pytest.raises(ValueError, match=re.escape("messages[1].content[2]: ") + ".*"
                       + re.escape(message)):
        extract_images([{"role": "system", "content": "x"},
                        *user(text("a"), url_part(picture()), part)], LIMITS, 5)


def test_more_images_than_the_limit_names_the_first_part_over_it():
    parts = [url_part(picture()) for _ in range(3)]
    with pytest.raises(ValueError, match=re.escape("messages[0].content[2]: more than 2 "
                                                   "image(s) in one prompt (limit_mm_per_prompt)")):
        extract_images(user(*parts), LIMITS, 2)
    with pytest.raises(ValueError, match=re.escape("messages[0].content[0]: more than 0")):
        extract_images(user(*parts), LIMITS, 0)


def test_the_marker_comes_from_the_config_or_the_tokenizer(tokenizer, tmp_path):
    boi = tokenizer.convert_tokens_to_ids("<start_of_image>")
    assert image_marker({"boi_token_index": boi}, tokenizer) == "<start_of_image>"
    assert image_marker(None, tokenizer) == "<start_of_image>"  # from its vocabulary
    (tmp_path / "config.json").write_text(json.dumps({"boi_token_index": boi}))
    assert image_marker(str(tmp_path), tokenizer) == "<start_of_image>"
    qwen = copy.deepcopy(tokenizer)
    names = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    qwen.add_special_tokens({"additional_special_tokens": names})
    ids = dict(zip(["vision_start_token_id", "image_token_id", "vision_end_token_id"],
                   qwen.convert_tokens_to_ids(names), strict=True))
    assert image_marker(ids, qwen) == "".join(names)


def test_a_text_models_tokenizer_has_no_marker(smollm2_tokenizer):
    with pytest.raises(ValueError, match="takes no images"):
        image_marker({"architectures": ["LlamaForCausalLM"]}, smollm2_tokenizer)


def test_the_engines_ids_of_the_text_are_the_templates_ids(tokenizer):
    """The engine tokenizes text with special tokens: the BOS the template wrote is dropped
    so that the tokenizer's own makes one, as `apply_chat_template(tokenize=True)`."""
    messages = [{"role": "user", "content": "hi there"}]
    rendered = tokenizer.apply_chat_template(messages, chat_template=GEMMA_LIKE, tokenize=False)
    assert rendered.startswith(tokenizer.bos_token)
    expected = tokenizer.apply_chat_template(messages, chat_template=GEMMA_LIKE, tokenize=True,
                                             return_dict=False)
    assert tokenizer(engine_text(tokenizer, rendered)).input_ids == list(expected)


def test_chat_prompt_takes_vllms_offline_parts(tokenizer):
    a, b, c = picture(12, 8), picture(6, 6, "L"), picture(4, 9)
    prompt = chat_prompt(tokenizer, user(text("look: "), {"type": "image_pil", "image_pil": a},
                                         {"type": "image", "image": b},
                                         {"type": "image", "image": data_url(encoded(c, "PNG"))},
                                         text("?")), LIMITS, 3, chat_template=GEMMA_LIKE)
    images = prompt["multi_modal_data"]["image"]
    assert [(im.size, im.mode) for im in images] == [((12, 8), "RGB"), ((6, 6), "RGB"),
                                                     ((4, 9), "RGB")]
    assert prompt["prompt"] == "<start_of_turn>user\nlook: " + "<start_of_image>" * 3 + \
        "?<end_of_turn>\n<start_of_turn>model\n"
    with pytest.raises(ValueError, match=re.escape("messages[0].content[2]: the image has")):
        chat_prompt(tokenizer, user(text("x"), url_part(a), url_part(picture(101, 100))),
                    LIMITS, 3, chat_template=GEMMA_LIKE)


def test_a_string_template_gets_the_marker_text(tokenizer):
    prompt = chat_prompt(tokenizer, user(text("a "), url_part(picture())), LIMITS, 1,
                         chat_template=STRING_ONLY)
    # The leading <|im_start|> is this tokenizer's BOS: the engine's tokenizing adds it back.
    assert prompt["prompt"] == "user\na <start_of_image><|im_end|>\n"
    assert tokenizer(prompt["prompt"]).input_ids == list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "a <start_of_image>"}], chat_template=STRING_ONLY,
        tokenize=True, return_dict=False))


def test_template_source_follows_apply_chat_template():
    tok = SimpleNamespace(chat_template={"default": "D", "tool_use": "T"})
    assert template_source(tok) == "D" and template_source(tok, "tool_use") == "T"
    assert template_source(tok, "{{ x }}") == "{{ x }}"
    assert template_source(SimpleNamespace(chat_template="S")) == "S"


def test_llm_chat_sends_image_conversations_as_text_with_their_images(tokenizer,
                                                                      monkeypatch):
    llm = LLM.__new__(LLM)  # no engine: the prompts `chat` hands to `generate` are the test
    llm.engine = SimpleNamespace(tokenizer=tokenizer)
    llm.multimodal, llm.model_dir = MultiModalConfig(limit_mm_per_prompt={"image": 1}), None
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, *a, **k: prompts)
    image = picture(7, 5)
    prompts = llm.chat([user(text("what is "), {"type": "image_pil", "image_pil": image}),
                        [{"role": "user", "content": "plain"}]], chat_template=GEMMA_LIKE)
    assert prompts[0]["prompt"] == "<start_of_turn>user\nwhat is <start_of_image>" \
        "<end_of_turn>\n<start_of_turn>model\n"
    assert prompts[0]["multi_modal_data"]["image"][0].size == (7, 5)
    assert prompts[1] == {"prompt_token_ids": list(tokenizer.apply_chat_template(
        [{"role": "user", "content": "plain"}], chat_template=GEMMA_LIKE,
        add_generation_prompt=True, tokenize=True, return_dict=False))}
    with pytest.raises(ValueError, match=re.escape("messages[0].content[1]: more than 1")):
        llm.chat(user({"type": "image", "image": image}, {"type": "image", "image": image}),
                 chat_template=GEMMA_LIKE)


def test_config_parses_vllms_limit_and_names_bad_fields(tmp_path):
    assert MultiModalConfig().max_images == DEFAULT_LIMIT
    config = EngineConfig.from_kwargs(limit_mm_per_prompt='{"image": 2}',
                                      allowed_local_media_path=str(tmp_path),
                                      max_image_pixels=100, allow_http_images=False)
    assert config.multimodal.max_images == 2
    assert config.multimodal.media_limits() == MediaLimits(str(tmp_path), 20 << 20, 100, 10.0,
                                                           False)
    for kwargs, field in [({"limit_mm_per_prompt": {"video": 1}}, "limit_mm_per_prompt"),
                          ({"limit_mm_per_prompt": {"image": -1}}, "limit_mm_per_prompt"),
                          ({"limit_mm_per_prompt": "image=2"}, "limit_mm_per_prompt"),
                          ({"limit_mm_per_prompt": [2]}, "limit_mm_per_prompt"),
                          ({"allowed_local_media_path": str(tmp_path / "no")},
                           "allowed_local_media_path"),
                          ({"max_image_pixels": 0}, "max_image_pixels"),
                          ({"max_image_bytes": 1.5}, "max_image_bytes"),
                          ({"image_fetch_timeout": 0}, "image_fetch_timeout"),
                          ({"allow_http_images": "no"}, "allow_http_images")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            MultiModalConfig(**kwargs)


def test_cli_flags_become_the_config(tmp_path):
    args = build_parser().parse_args([
        "serve", "m.gguf", "--limit-mm-per-prompt", '{"image": 3}', "--allowed-local-media-path",
        str(tmp_path), "--max-image-pixels", "500", "--max-image-bytes", "900",
        "--image-fetch-timeout", "2.5", "--no-allow-http-images"])
    kwargs = engine_kwargs(args)
    assert kwargs["limit_mm_per_prompt"] == {"image": 3}
    mm = EngineConfig.from_kwargs(**{k: v for k, v in kwargs.items() if k != "model"}).multimodal
    assert mm == MultiModalConfig({"image": 3}, str(tmp_path), 500, 900, 2.5, False)
    unset = engine_kwargs(build_parser().parse_args(["serve", "m.gguf"]))
    assert not {"limit_mm_per_prompt", "allowed_local_media_path", "allow_http_images"} & \
        unset.keys()
