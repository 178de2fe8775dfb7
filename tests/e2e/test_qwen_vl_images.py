"""Qwen2.5-VL with images through the engine against transformers'
`Qwen2_5_VLForConditionalGeneration` (a tiny random model; the test tokenizer with Qwen's
vision tokens added): greedy tokens of prompts with images of two sizes, alone, batched with
text, with chunked prefill splitting an image (its tokens are causal), so the multimodal
rotary's rows and the later tokens' shifted positions are the model's."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from PIL import Image

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
MAX_TOKENS = 8
ENGINE = {**TINY_ENGINE, "warmup": False, "block_size": 8, "max_num_batched_tokens": 16}
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
IMG = "<|vision_start|><|image_pad|><|vision_end|>"


def picture(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def built(smollm2_tokenizer, tmp_path_factory):
    """(directory, transformers model, tokenizer)."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": VISION})
    start, end, pad, video = (tok.convert_tokens_to_ids(t) for t in VISION)
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.1,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=64, window_size=56, fullatt_block_indexes=[1],
                           initializer_range=0.2),
        image_token_id=pad, video_token_id=video, vision_start_token_id=start,
        vision_end_token_id=end, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(config).float().eval()
    path = str(tmp_path_factory.mktemp("qwen_vl"))
    hf.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 16}).save_pretrained(path)
    return path, hf, tok


def hf_greedy(built, ids: list[int], inputs) -> list[int]:
    _, hf, tok = built
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    kw = {}
    if inputs:
        kw = dict(pixel_values=torch.from_numpy(np.concatenate([i.pixel_values for i in inputs])),
                  image_grid_thw=torch.tensor([i.grid_thw for i in inputs]),
                  mm_token_type_ids=(torch.tensor([ids]) == pad).int())
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS,
                          min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def llm(built):
    return LLM(built[0], **ENGINE)


def test_images_of_two_sizes_equal_transformers_alone_and_batched(llm, built):
    a, b = picture(60, 90, 1), picture(70, 50, 2)
    two = f"Look at {IMG} and then {IMG}: which is brighter?"
    one = f"{IMG}What is this?"
    support = llm.engine.inputs.images
    tokenize = lambda t: built[2](t).input_ids  # noqa: E731
    ids_two, items_two = support.prompt_items(two, [a, b], tokenize)
    ids_one, items_one = support.prompt_items(one, [b], tokenize)
    assert [i.length for i in items_two] == [i.inputs.num_tokens for i in items_two]
    assert items_two[0].length != items_two[1].length  # two sizes
    want = [hf_greedy(built, ids_two, [i.inputs for i in items_two]),
            hf_greedy(built, ids_one, [i.inputs for i in items_one]),
            hf_greedy(built, tokenize("Plain words about rivers"), [])]
    outs = llm.generate([{"prompt": two, "multi_modal_data": {"image": [a, b]}},
                         {"prompt": one, "multi_modal_data": {"image": b}},
                         "Plain words about rivers"], PARAMS, use_tqdm=False)
    assert outs[0].prompt_token_ids == ids_two
    assert [o.outputs[0].token_ids for o in outs] == want
    # the rows matter: the same text with the images swapped answers otherwise
    swapped = llm.generate([{"prompt": two, "multi_modal_data": {"image": [b, a]}}], PARAMS,
                           use_tqdm=False)[0]
    assert swapped.outputs[0].token_ids != want[0]


def test_an_image_seen_before_is_found_encoded_in_each_chunk(llm, built):
    """The image of an earlier prompt after other text (no page shared) is not encoded again:
    its placeholders, split over 16-token chunks (Qwen's are causal), read the cached rows,
    one lookup per chunk that touches them (`mm_cache_hits`), and the tokens are transformers'."""
    img = picture(200, 300, 3)  # the largest image: 16 placeholders
    llm.generate([{"prompt": f"{IMG}Describe it.", "multi_modal_data": {"image": img}}],
                 PARAMS, use_tqdm=False)
    before = llm.get_metrics()
    prompt = f"Some other words first, then {IMG}Describe it."
    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": img}}], PARAMS,
                       use_tqdm=False)[0]
    after = llm.get_metrics()
    ids, items = llm.engine.inputs.images.prompt_items(prompt, [img],
                                                       lambda t: built[2](t).input_ids)
    assert out.outputs[0].token_ids == hf_greedy(built, ids, [i.inputs for i in items])
    item = items[0]
    chunks = len(range(item.offset // 16, (item.end - 1) // 16 + 1))  # 16-token steps
    assert chunks > 1  # the image is split
    assert after["jaxserve:encoder_cache_misses"] == before["jaxserve:encoder_cache_misses"]
    assert after["jaxserve:mm_cache_hits"] - before["jaxserve:mm_cache_hits"] == chunks
    assert after["jaxserve:mm_cache_queries"] - before["jaxserve:mm_cache_queries"] == chunks


@pytest.mark.slow(reason="two more engines (~10 s each); the default tier serves images above")
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_both_ways_keeps_the_tokens(built, mode):
    """Five image prompts in a pool of 12 pages of 8 tokens: requests are preempted and
    resumed (their images found in the encoder cache or encoded again, their rotary rows
    kept on the request) and still give transformers' tokens."""
    tokenize = lambda t: built[2](t).input_ids  # noqa: E731
    llm = LLM(built[0], **{**ENGINE, "num_kv_blocks": 12, "preemption_mode": mode,
                           "swap_space": 0.05})
    support = llm.engine.inputs.images
    prompts = [(f"{IMG}Picture {i}, described:", [picture(40 + 10 * i, 60, i)])
               for i in range(5)]
    want = []
    for text, imgs in prompts:
        ids, items = support.prompt_items(text, imgs, tokenize)
        want.append(hf_greedy(built, ids, [i.inputs for i in items]))
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": imgs}}
                         for text, imgs in prompts], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.usage == 0.0
