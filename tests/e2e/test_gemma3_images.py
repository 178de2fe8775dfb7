"""Gemma 3 with images through the engine against transformers' `Gemma3ForConditionalGeneration`
(a tiny random model: SigLIP tower of 8 x 8 patches pooled to 16 soft tokens, the test
tokenizer with Gemma 3's three image tokens added): greedy tokens of image + text prompts
alone, batched with a text-only request, with chunked prefill (a chunk never splits an
image: its tokens attend both ways); the same image twice hits the encoder cache and the
prefix cache, another image with the same text shares no image page."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from PIL import Image

from jaxserve import LLM, SamplingParams
from tests.conftest import TINY_ENGINE

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>"}
MAX_TOKENS = 8
ENGINE = {**TINY_ENGINE, "warmup": False, "block_size": 8, "max_num_batched_tokens": 32}


def picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (20 + seed, 24, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def built(smollm2_tokenizer, tmp_path_factory):
    """(directory, transformers model, transformers processor)."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": list(IMAGE_TOKENS.values())})
    for name, text in IMAGE_TOKENS.items():
        setattr(tok, name, text)
        setattr(tok, name + "_id", tok.convert_tokens_to_ids(text))
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in IMAGE_TOKENS.items()}
    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, sliding_window=24, max_position_embeddings=256,
                         layer_types=["sliding_attention", "full_attention"],
                         initializer_range=0.1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, image_size=32, patch_size=4),
        mm_tokens_per_image=16, boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
        attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms and the projector away from their init, so they matter
        for name, p in hf.named_parameters():
            if "norm" in name or "projection" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    path = str(tmp_path_factory.mktemp("gemma3_images"))
    hf.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    images = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    images.save_pretrained(path)
    proc = transformers.Gemma3Processor(image_processor=images, tokenizer=tok,
                                        image_seq_length=16)
    return path, hf, proc


def hf_greedy(built, text: str, images: list) -> list[int]:
    _, hf, proc = built
    inputs = proc(text=[text], images=[images] if images else None, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                          do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="module")
def llm(built):
    return LLM(built[0], **ENGINE)


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TWO = "Describe<start_of_image> and compare it with<start_of_image> please."
ONE = "What is in<start_of_image>?"


def test_image_prompts_equal_transformers_alone_and_batched(llm, built):
    a, b = picture(1), picture(2)
    want_two = hf_greedy(built, TWO, [a, b])
    want_one = hf_greedy(built, ONE, [b])
    want_text = hf_greedy(built, "A plain text prompt about cats", [])
    out = llm.generate([{"prompt": TWO, "multi_modal_data": {"image": [a, b]}}], PARAMS,
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == want_two
    outs = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": b}},
                         "A plain text prompt about cats",
                         {"prompt": TWO, "multi_modal_data": {"image": [a, b]}}],
                        PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want_one, want_text, want_two]


def test_prompt_logprobs_equal_transformers_with_image_tokens_seeing_their_image(llm, built):
    """Every prompt position's logprob, chunked (32-token steps, never inside an image),
    equals transformers' with its image-token mask, and not the causal one: the images'
    tokens attend to each other both ways."""
    _, hf, proc = built
    a, b = picture(1), picture(2)
    inputs = proc(text=[TWO], images=[[a, b]], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    out = llm.generate([{"prompt": TWO, "multi_modal_data": {"image": [a, b]}}],
                       SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    ours = np.array([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:],
                                                    strict=True)])

    def theirs(**kw):
        with torch.no_grad():
            logits = hf(**kw).logits[0, :-1].float()
        return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1),
                                             torch.tensor(ids[1:])].numpy()

    np.testing.assert_allclose(ours, theirs(**inputs), atol=2e-3)
    causal = theirs(**{k: v for k, v in inputs.items() if k != "token_type_ids"})
    assert np.abs(ours - causal).max() > 1e-2


def test_the_images_matter(llm, built):
    a, b = picture(1), picture(2)
    outs = llm.generate([{"prompt": ONE, "multi_modal_data": {"image": img}}
                         for img in (a, b)], PARAMS, use_tqdm=False)
    assert outs[0].outputs[0].token_ids != outs[1].outputs[0].token_ids


def test_same_image_hits_both_caches_another_shares_no_image_page(llm):
    engine = llm.engine
    cache = engine.runner.encoder
    c, d = picture(5), picture(6)
    prompt = "Tell me a long story about" + "<start_of_image>" + " and more words after it"
    llm.generate([{"prompt": prompt, "multi_modal_data": {"image": c}}], PARAMS,
                 use_tqdm=False)
    hits, misses = cache.hits, cache.misses
    before = llm.get_metrics()
    out = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": c}}], PARAMS,
                       use_tqdm=False)[0]
    assert cache.misses == misses  # not encoded again
    assert out.num_cached_tokens >= 16  # pages past the image from the prefix cache
    # other text before it: no page shared, the image found encoded (counted)
    llm.generate([{"prompt": "Other words" + prompt, "multi_modal_data": {"image": c}}],
                 PARAMS, use_tqdm=False)
    after = llm.get_metrics()
    assert after["jaxserve:prefix_cache_hits"] >= before["jaxserve:prefix_cache_hits"] + 16
    assert after["jaxserve:mm_cache_hits"] == before["jaxserve:mm_cache_hits"] + 1
    assert after["jaxserve:encoder_cache_misses"] == before["jaxserve:encoder_cache_misses"]
    other = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": d}}], PARAMS,
                         use_tqdm=False)[0]
    assert cache.misses == misses + 1
    first_image_page = out.prompt_token_ids.index(engine.inputs.images.layout.placeholder_id) // 8
    assert other.num_cached_tokens <= first_image_page * 8  # only the text before it
    assert hits <= cache.hits


@pytest.mark.parametrize("prompt, data, message", [
    (ONE, {"image": [picture(1), picture(2)]}, "1 image marker"),
    (ONE, {"video": [picture(1)]}, "multi_modal_data must be"),
    (ONE, {"image": "data:image/png;base64,AAAA"}, r"multi_modal_data.image\[0\]"),
])
def test_bad_image_requests_are_value_errors(llm, prompt, data, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt": prompt, "multi_modal_data": data}], PARAMS, use_tqdm=False)
    assert llm.engine.kv.usage == 0.0


@pytest.mark.slow(reason="two more engines (~10 s each); the default tier serves images above")
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_both_ways_keeps_the_tokens(built, mode):
    """Six image prompts into a pool of 16 pages of 8 tokens: requests are preempted (their
    images encoded again or found in the encoder cache on resume) and still give
    transformers' tokens."""
    imgs = [picture(i) for i in range(1, 4)]
    prompts = [(ONE, [imgs[i % 3]]) for i in range(3)] + [(TWO, [imgs[i], imgs[i - 1]])
                                                          for i in range(3)]
    want = [hf_greedy(built, text, images) for text, images in prompts]
    llm = LLM(built[0], **{**ENGINE, "num_kv_blocks": 16, "preemption_mode": mode,
                           "swap_space": 0.05})
    outs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}
                         for text, images in prompts], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.usage == 0.0


def test_chat_with_a_data_url_image_equals_its_rendered_prompt(llm, built):
    """`LLM.chat` with an `image_url` part (a PNG data URL) renders the marker where the image
    was and sends the image: the same tokens as the rendered text with the image."""
    import base64
    import io

    img = picture(3)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    chat = [{"role": "user", "content": [{"type": "text", "text": "What is in"},
                                          {"type": "image_url", "image_url": {"url": url}},
                                          {"type": "text", "text": "?"}]}]
    got = llm.chat(chat, PARAMS, use_tqdm=False)[0]
    text = built[2].tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is in<start_of_image>?"}], tokenize=False,
        add_generation_prompt=True)
    want = llm.generate([{"prompt": text, "multi_modal_data": {"image": img}}], PARAMS,
                        use_tqdm=False)[0]
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
