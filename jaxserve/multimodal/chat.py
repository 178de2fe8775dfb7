"""Images in chat messages: the image content parts taken out of a conversation (loaded in
order, counted against `limit_mm_per_prompt`) and left as what the chat template renders, so
the rendered text holds one image marker per image, as the engine's prompt dict expects.

A template that iterates over a message's content parts (Gemma 3's, Qwen2.5-VL's: vLLM's
"openai" content format) gets `{"type": "image"}` parts and renders the family's marker
itself; a template that renders string content only gets the marker text written in place of
each image (`image_marker`).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jinja2
import jinja2.nodes
from PIL import Image

from jaxserve.multimodal.media import MediaLimits, load_image

# Part types that carry an image: over HTTP only `image_url`; `LLM.chat` also takes vLLM's
# offline forms `{"type": "image_pil", "image_pil": img}` and `{"type": "image", "image": x}`.
HTTP_IMAGE_PARTS = ("image_url",)
OFFLINE_IMAGE_PARTS = ("image_url", "image_pil", "image")
# The marker of a family whose config.json does not name its tokens, by what the tokenizer
# holds: Gemma 3's, then Qwen2-VL's and Qwen2.5-VL's.
KNOWN_MARKERS = ("<start_of_image>", "<|vision_start|><|image_pad|><|vision_end|>")


@dataclasses.dataclass
class ChatImages:
    """A conversation with its images taken out.

    Attributes:
        messages: The messages for the chat template (JSON values only).
        images: The RGB images, in the order their markers will appear.
    """

    messages: list[dict]
    images: list[Image.Image]


def has_image_parts(messages: list[dict], part_types=OFFLINE_IMAGE_PARTS) -> bool:
    """Whether any message's content is a list holding a part of `part_types`."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") in part_types
                       for p in m["content"]) for m in messages)


def _source(part: dict, where: str):
    """The image a part names (a URL or a PIL image), or a ValueError naming `where`."""
    kind = part.get("type")
    value = part.get(kind)
    if kind == "image_url" and isinstance(value, dict):
        value = value.get("url")  # OpenAI's {"url": ..., "detail": ...}; vLLM also takes a str
    if value is None or (isinstance(value, str) and not value):
        field = "image_url.url" if kind == "image_url" else kind
        raise ValueError(f"{where}: an {kind} part needs {field}")
    return value


def extract_images(messages: list[dict], limits: MediaLimits, max_images: int, *,
                   string_content: bool = False, marker=None,
                   part_types=HTTP_IMAGE_PARTS) -> ChatImages:
    """The conversation with each image part replaced by what the template renders.

    Args:
        messages: Chat messages; a content list may hold `text` parts and image parts.
        limits: What an image may be (`MultiModalConfig.media_limits()`).
        max_images: Most images in the conversation (`limit_mm_per_prompt["image"]`).
        string_content: The template renders string content only: a message with images
            becomes text with `marker` in place of each image; else its parts become
            `{"type": "text", "text": ...}` and `{"type": "image"}`.
        marker: The image marker text, or a callable giving it (called only when needed).
        part_types: The part types that carry an image (`HTTP_IMAGE_PARTS` for requests,
            `OFFLINE_IMAGE_PARTS` for `LLM.chat`).

    Raises:
        ValueError: Naming the content part (`messages[i].content[j]`): an unknown part
            type, an image part without its image, more images than `max_images`, or an
            image `load_image` refuses.
    """
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not has_image_parts([message], part_types):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": part.get("text") or ""})
                continue
            if kind not in part_types:
                raise ValueError(f"{where}: content part type {kind!r} is not supported "
                                 f"(text, {', '.join(part_types)})")
            if len(images) >= max_images:
                raise ValueError(f"{where}: more than {max_images} image(s) in one prompt "
                                 "(limit_mm_per_prompt)")
            images.append(load_image(_source(part, where), limits, where))
            parts.append({"type": "image"})
            if string_content and callable(marker):
                try:
                    marker = marker()  # once, at the first image
                except ValueError as e:
                    raise ValueError(f"{where}: {e}") from None
        if string_content:
            parts = "".join(marker if p["type"] == "image" else p["text"] for p in parts)
        out.append({**message, "content": parts})
    return ChatImages(out, images)


def _reads_content(node, content_names: set[str]) -> bool:
    """Whether `node` is `x['content']`, `x.content` or a name bound to one of them."""
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name in content_names


def iterates_content(template: str) -> bool:
    """Whether a chat template loops over a message's content parts (vLLM's "openai"
    content format), read from its syntax tree; False for a template that does not parse
    (it then renders strings, or fails on its own)."""
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    names = {a.target.name for a in tree.find_all(jinja2.nodes.Assign)
             if isinstance(a.target, jinja2.nodes.Name) and _reads_content(a.node, set())}
    return any(_reads_content(f.iter, names) for f in tree.find_all(jinja2.nodes.For))


def template_source(tokenizer, chat_template: str | None = None) -> str | None:
    """The template text `apply_chat_template` would use: `chat_template` (its text, or
    the name of one of the tokenizer's), else the tokenizer's own (its "default")."""
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):
        if chat_template in own:
            return own[chat_template]
        return chat_template if chat_template is not None else own.get("default")
    return chat_template if chat_template is not None else own


def image_marker(hf_config, tokenizer) -> str:
    """The text one image is written as in a prompt of this model.

    Args:
        hf_config: The model's config.json (a dict, or the directory holding it, or None).
        tokenizer: Its tokenizer (for the marker tokens' text).

    Returns:
        Gemma 3 (`boi_token_index`): the token's text, `<start_of_image>`; Qwen2-VL and
        Qwen2.5-VL (`vision_start_token_id`, `image_token_id`, `vision_end_token_id`):
        `<|vision_start|><|image_pad|><|vision_end|>`; without a config naming them, the
        first of `KNOWN_MARKERS` whose tokens the tokenizer holds.

    Raises:
        ValueError: Neither the config nor the tokenizer names an image marker (a text
            model).
    """
    if isinstance(hf_config, str):
        path = os.path.join(hf_config, "config.json")
        hf_config = None
        if os.path.isfile(path):
            with open(path) as f:
                hf_config = json.load(f)
    cfg = hf_config or {}
    text = tokenizer.convert_ids_to_tokens
    if "boi_token_index" in cfg:
        return text(int(cfg["boi_token_index"]))
    ids = [cfg.get(k) for k in ("vision_start_token_id", "image_token_id", "vision_end_token_id")]
    if all(isinstance(t, int) for t in ids):
        return "".join(text(t) for t in ids)
    vocab = tokenizer.get_vocab()
    for marker in KNOWN_MARKERS:
        pieces = marker.replace("><", ">\0<").split("\0")
        if all(p in vocab for p in pieces):
            return marker
    raise ValueError("this model has no image marker (its config names no image tokens): it "
                     "takes no images")


def engine_text(tokenizer, text: str) -> str:
    """A rendered chat prompt as a text prompt for the engine, which tokenizes text with the
    tokenizer's special tokens: a leading BOS the template wrote is dropped when the
    tokenizer adds one itself, so the ids are those of the rendered text alone (as
    `apply_chat_template(tokenize=True)` gives them, and vLLM's chat path)."""
    bos = getattr(tokenizer, "bos_token", None)
    added = tokenizer("").input_ids
    if bos and added and added[0] == tokenizer.bos_token_id and text.startswith(bos):
        return text[len(bos):]
    return text


def chat_prompt(tokenizer, conversation: list[dict], limits: MediaLimits, max_images: int, *,
                chat_template: str | None = None, add_generation_prompt: bool = True,
                model_dir: str | None = None) -> dict:
    """`LLM.chat`'s prompt for a conversation with image parts: the engine's prompt dict.

    Args:
        tokenizer: The model's tokenizer (its chat template renders the conversation).
        conversation: Messages whose content lists may hold `text`, `image_url`,
            `image_pil` and `image` parts (`OFFLINE_IMAGE_PARTS`).
        limits: What an image may be.
        max_images: Most images in the conversation (`limit_mm_per_prompt["image"]`).
        chat_template: A template (or the name of one of the tokenizer's) instead of its own.
        add_generation_prompt: End with the assistant's header.
        model_dir: The model's directory, whose config.json names its image marker (for a
            template that renders string content only; default: the tokenizer's path).

    Returns:
        `{"prompt": text, "multi_modal_data": {"image": [PIL images]}}`, one marker per image
        in the text, in order.

    Raises:
        ValueError: Naming the content part (see `extract_images`).
    """
    source = template_source(tokenizer, chat_template)
    where = model_dir or getattr(tokenizer, "name_or_path", None)
    chat = extract_images(conversation, limits, max_images,
                          string_content=not iterates_content(source or ""),
                          marker=lambda: image_marker(where, tokenizer),
                          part_types=OFFLINE_IMAGE_PARTS)
    text = tokenizer.apply_chat_template(chat.messages, chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt,
                                         tokenize=False)
    return {"prompt": engine_text(tokenizer, text), "multi_modal_data": {"image": chat.images}}
