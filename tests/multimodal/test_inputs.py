"""Image markers in prompts expanded as the families' transformers processors expand them
(`jaxserve.multimodal.inputs`): Gemma 3's against `Gemma3Processor` itself (on the test
tokenizer with Gemma 3's image tokens added), token prompts the same as text ones, items at
their placeholders with hashes that follow the pixels; and the mismatches as ValueErrors."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from jaxserve.multimodal.inputs import ImageLayout, expand_prompt, image_hash
from jaxserve.multimodal.processors import Gemma3Processor, ImageInputs

transformers = pytest.importorskip("transformers")

TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
          "image_token": "<image_soft_token>"}


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    """The test tokenizer with Gemma 3's three image tokens (a copy: the session's is shared)."""
    import copy

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": list(TOKENS.values())})
    for name, text in TOKENS.items():
        setattr(tok, name, text)
        setattr(tok, name + "_id", tok.convert_tokens_to_ids(text))
    return tok


def gemma3_layout(tok) -> ImageLayout:
    return ImageLayout("<start_of_image>", tok.boi_token_id, "<image_soft_token>",
                       tok.image_token_id, before="\n\n<start_of_image>",
                       after="<end_of_image>\n\n", bidirectional=True)


def pictures(n):
    rng = np.random.default_rng(n)
    return [Image.fromarray(rng.integers(0, 255, (10 + i, 12, 3), dtype=np.uint8))
            for i in range(n)]


TEXT = "Look<start_of_image> here\n\nand <start_of_image>!"


def test_gemma3_expansion_equals_transformers(tok):
    proc = Gemma3Processor(size=32, tokens=4)
    imgs = pictures(2)
    theirs = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=tok, image_seq_length=4)
    want = theirs(text=[TEXT], images=[imgs], return_tensors="np")
    ids, items = expand_prompt(TEXT, [proc(i) for i in imgs], gemma3_layout(tok),
                               lambda t: tok(t).input_ids)
    assert ids == want["input_ids"][0].tolist()
    assert [ids[i.offset:i.end] for i in items] == [[tok.image_token_id] * 4] * 2
    for item, pixels in zip(items, want["pixel_values"], strict=True):
        np.testing.assert_allclose(item.inputs.pixel_values, pixels, atol=1e-6)
    # a token prompt has each marker id replaced by the expansion's ids (no merges across
    # its edges, as vLLM's token prompts)
    prompt = tok(TEXT).input_ids
    token_ids, token_items = expand_prompt(prompt, [proc(i) for i in imgs],
                                           gemma3_layout(tok), lambda t: tok(t).input_ids)
    one = tok("\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n").input_ids
    want_ids = [x for t in prompt for x in (one if t == tok.boi_token_id else [t])]
    assert token_ids == want_ids
    assert [token_ids[i.offset:i.end] for i in token_items] == [[tok.image_token_id] * 4] * 2


def test_hashes_follow_the_pixels(tok):
    proc = Gemma3Processor(size=32, tokens=4)
    a, b = pictures(2)
    assert image_hash(proc(a)) == image_hash(proc(a.copy())) != image_hash(proc(b))
    # a grid is part of what the encoder sees
    pixels = np.zeros((4, 8), np.float32)
    assert (image_hash(ImageInputs(pixels, 1, (1, 2, 2)))
            != image_hash(ImageInputs(pixels, 1, (1, 1, 4))))


@pytest.mark.parametrize("prompt, n, message", [
    ("one <start_of_image> marker", 2, "1 image marker"),
    ("no marker", 1, "0 image marker"),
    ("<start_of_image> and my own <image_soft_token>", 1, "no '<image_soft_token>' of your own"),
])
def test_mismatches_are_value_errors(tok, prompt, n, message):
    proc = Gemma3Processor(size=32, tokens=4)
    with pytest.raises(ValueError, match=message):
        expand_prompt(prompt, [proc(i) for i in pictures(n)], gemma3_layout(tok),
                      lambda t: tok(t).input_ids)
