"""Images in a prompt: each image's marker expanded into the placeholder tokens its embeddings
will fill, as the family's transformers processor expands it, and the images as items (their
hash, preprocessed pixels and where their placeholders sit).

A family says how in an `ImageLayout`: the marker a user writes for one image (Gemma 3's
`<start_of_image>`, Qwen2-VL's `<|image_pad|>` inside `<|vision_start|>...<|vision_end|>`),
the text one image becomes (Gemma 3: `\\n\\n<start_of_image>` + 256 `<image_soft_token>` +
`<end_of_image>\\n\\n`), and the placeholder token whose embeddings the vision encoder
supplies. Text prompts are expanded as text before tokenizing (as the processors do, so
merges across the expansion's edges are theirs); token prompts have each marker id replaced
by the tokenized expansion.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from jaxserve.multimodal.processors import ImageInputs


@dataclasses.dataclass(frozen=True)
class ImageLayout:
    """How a family writes images into prompts.

    Attributes:
        marker: The text standing for one image in a prompt.
        marker_id: Its token id.
        placeholder: The text of one placeholder token.
        placeholder_id: Its id: the positions whose embeddings come from the encoder.
        before: Text around each image's placeholders (Gemma 3: "\\n\\n<start_of_image>").
        after: (Gemma 3: "<end_of_image>\\n\\n").
        bidirectional: An image's placeholder tokens attend to each other both ways
            (Gemma 3), so a prefill chunk never splits one.
    """

    marker: str
    marker_id: int
    placeholder: str
    placeholder_id: int
    before: str = ""
    after: str = ""
    bidirectional: bool = False

    def expansion(self, num_tokens: int) -> str:
        """The text one image of `num_tokens` placeholders becomes."""
        return self.before + self.placeholder * num_tokens + self.after


@dataclasses.dataclass(frozen=True)
class ImageItem:
    """One image of a request.

    Attributes:
        hash: Hex digest of its preprocessed pixels (the encoder cache's and the prefix
            cache's key: the same image shares, a different one never does).
        inputs: The preprocessed image.
        offset: Its first placeholder's index in the prompt.
        length: Its placeholder tokens (`inputs.num_tokens`).
        whole: Its placeholders attend to each other both ways (`ImageLayout.bidirectional`):
            one step computes all of them that are not cached.
    """

    hash: str
    inputs: ImageInputs
    offset: int
    length: int
    whole: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length


def image_hash(inputs: ImageInputs) -> str:
    """A digest of the pixels the encoder sees (and their grid), so equal images after
    preprocessing share one entry whatever file they came from."""
    h = hashlib.sha256()
    h.update(str((inputs.pixel_values.shape, inputs.grid_thw)).encode())
    h.update(np.ascontiguousarray(inputs.pixel_values).tobytes())
    return h.hexdigest()


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of `token` in `ids`."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def expand_prompt(prompt: str | list[int], images: list[ImageInputs], layout: ImageLayout,
                  tokenize) -> tuple[list[int], list[ImageItem]]:
    """The prompt's token ids with every marker expanded, and its images as items.

    Args:
        prompt: Text, or token ids.
        images: The preprocessed images, in the order of their markers.
        layout: The family's `ImageLayout`.
        tokenize: Text -> token ids (the model's tokenizer, special tokens parsed).

    Raises:
        ValueError: The markers and the images differ in number, or the prompt already
            holds placeholder tokens of its own.
    """
    if isinstance(prompt, str):
        count = prompt.count(layout.marker)
        if count == len(images):
            # One marker at a time, so each image gets its own count of placeholders.
            parts = prompt.split(layout.marker)
            text = parts[0] + "".join(layout.expansion(img.num_tokens) + rest
                                      for img, rest in zip(images, parts[1:], strict=True))
            ids = list(tokenize(text))
    else:
        count = sum(1 for t in prompt if t == layout.marker_id)
        own = layout.placeholder_id != layout.marker_id and layout.placeholder_id in prompt
        if count == len(images) and not own:
            it = iter(images)
            ids = []
            for t in prompt:
                ids.extend(tokenize(layout.expansion(next(it).num_tokens))
                           if t == layout.marker_id else [t])
    if count != len(images):
        raise ValueError(f"the prompt has {count} image marker(s) ({layout.marker!r}) for "
                         f"{len(images)} image(s) in multi_modal_data")
    runs = _runs(ids, layout.placeholder_id)
    if [n for _, n in runs] != [img.num_tokens for img in images]:
        raise ValueError(f"the prompt's {layout.placeholder!r} tokens do not match its "
                         f"images: write one {layout.marker!r} per image and no "
                         f"{layout.placeholder!r} of your own")
    items = [ImageItem(image_hash(img), img, start, n, layout.bidirectional)
             for img, (start, n) in zip(images, runs, strict=True)]
    return ids, items


def whole_images(request, start: int, num_new: int) -> int:
    """A prefill chunk of `num_new` tokens from `start` cut so it splits no image whose
    placeholders must be computed in one step (`ImageItem.whole`): it ends before such an
    image, or 0 when the chunk starts at (or inside) one it cannot hold to its end.

    Args:
        request: A `Request` with `mm_items`.
        start: The chunk's first token (computed and prefix-hit tokens before it).
        num_new: The tokens the budget allows.
    """
    end = start + num_new
    for item in request.mm_items:
        if item.whole and item.offset < end < item.end:
            return item.offset - start if item.offset > start else 0
    return num_new


def chunk_rope_positions(request, start: int, num: int) -> np.ndarray | None:
    """i32[3, num] the multimodal rotary positions of a request's tokens start .. start +
    num - 1: its prompt's rows (`Request.rope_positions`), then each later token's index
    plus `Request.rope_delta` on all three; None for a request without them."""
    rows = request.rope_positions
    if rows is None:
        return None
    pos = np.arange(start, start + num)
    out = np.broadcast_to(pos + request.rope_delta, (3, num)).astype(np.int32)
    inside = pos < rows.shape[1]
    if inside.any():
        out = out.copy()
        out[:, inside] = rows[:, pos[inside]]
    return out
