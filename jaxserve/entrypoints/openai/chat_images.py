"""A chat request with image parts as the engine's prompt: the conversation rendered to text
with one image marker per image, and the images, loaded and checked, in order."""

from __future__ import annotations

from jaxserve.entrypoints.chat_template import ChatTemplateError, render_chat
from jaxserve.entrypoints.openai.errors import OpenAIError
from jaxserve.multimodal.chat import (
    engine_text,
    extract_images,
    image_marker,
    iterates_content,
    template_source,
)
from jaxserve.multimodal.config import MultiModalConfig


def _part_of(message: str) -> str:
    """The content part an image error names (`messages[0].content[1]`), else `messages`."""
    head = message.split(":", 1)[0]
    return head if head.startswith("messages[") else "messages"


def image_prompt(tokenizer, plain: list[dict], config: MultiModalConfig, *,
                 chat_template: str | None = None, add_generation_prompt: bool = True,
                 continue_final_message: bool = False, tools: list[dict] | None = None,
                 template_kwargs: dict | None = None) -> dict:
    """The engine's prompt dict for a conversation holding image parts.

    Args:
        tokenizer: The model's tokenizer (its chat template; its config for the marker).
        plain: The messages as `ChatMessage.as_template_message` gives them.
        config: The images allowed (`ServingLimits.multimodal`).
        chat_template, add_generation_prompt, continue_final_message, tools,
            template_kwargs: As `render_chat` takes them.

    Returns:
        `{"prompt": text, "multi_modal_data": {"image": [PIL images]}}`, the text holding
        one marker per image, in order.

    Raises:
        OpenAIError: 400 naming the content part (an unknown part type, a missing, refused,
            undecodable or too large image, more than `limit_mm_per_prompt`), or the field
            the template refused.
    """
    source = template_source(tokenizer, chat_template)
    try:
        chat = extract_images(plain, config.media_limits(), config.max_images,
                              string_content=not iterates_content(source or ""),
                              marker=lambda: image_marker(
                                  getattr(tokenizer, "name_or_path", None), tokenizer))
    except ValueError as e:
        raise OpenAIError(400, str(e), _part_of(str(e))) from None
    try:
        text = render_chat(tokenizer, chat.messages, chat_template=chat_template,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message, tools=tools,
                           template_kwargs=template_kwargs, tokenize=False)
    except ChatTemplateError as e:
        raise OpenAIError(400, str(e), e.param) from None
    return {"prompt": engine_text(tokenizer, text), "multi_modal_data": {"image": chat.images}}
