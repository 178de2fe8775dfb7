"""Qwen2.5-VL's vision tower (`models.vision.qwen2_5_vl`) and M-RoPE (`models.mrope`) against
transformers' `Qwen2_5_VLForConditionalGeneration` with tiny random weights: the tower's
outputs for images from `QwenVLProcessor` (two sizes in one call, one alone; windows that split
the images), `get_rope_index`'s positions and the decoder rotary's cos/sin."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from PIL import Image

from jaxserve.multimodal.processors import QwenVLProcessor
from models.loaders.safetensors_dir import SafetensorsDir
from models.mrope import mrope_cos_sin, mrope_positions, mrope_section_of, mrope_text_positions
from models.vision.qwen2_5_vl import QwenVisionConfig, encode_images, find_prefix, load_qwen_vision
from models.vision.qwen2_5_vl_layout import vision_layout

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

IMAGE_TOKEN = 49152
SECTION = [2, 3, 3]  # the decoder's head_dim 16: 8 bands
# Window 56 px = 2 merged patches a side: the 112x168 image's 4x6 merged grid is 6 whole
# windows, the 84x140 one's 3x5 grid has windows cut by both edges.
SIZES = [(112, 168), (84, 140)]


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """A tiny random Qwen2.5-VL, saved by `save_pretrained`: (model, directory)."""
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=49160, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": SECTION}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=64, window_size=56, fullatt_block_indexes=[1],
                           initializer_range=0.2),
        image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN + 1,
        vision_start_token_id=IMAGE_TOKEN + 2, vision_end_token_id=IMAGE_TOKEN + 3)
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # beside XLA on two cores (tests/conftest.py's torch_one_thread)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # norms and biases away from 1 and 0, so each weight matters
        for name, p in model.model.visual.named_parameters():
            if p.ndim == 1:
                centre = 1.0 if "norm" in name or "ln_q" in name else 0.0
                p.copy_(centre + 0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen_vl")
    model.save_pretrained(path)
    yield model, path
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ours(hf_model):
    model, path = hf_model
    cfg = QwenVisionConfig.from_hf(model.config.vision_config.to_dict())
    return cfg, load_qwen_vision(SafetensorsDir(str(path)), cfg)


def images(sizes):
    rng = np.random.default_rng(1)
    proc = QwenVLProcessor()
    return [proc(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
            for h, w in sizes]


def theirs(model, inputs) -> np.ndarray:
    pixels = torch.from_numpy(np.concatenate([i.pixel_values for i in inputs]))
    grid = torch.tensor([i.grid_thw for i in inputs])
    with torch.no_grad():
        return model.model.visual(pixels, grid_thw=grid).pooler_output.numpy()


def encode(cfg, params, inputs) -> np.ndarray:
    pixels = jnp.asarray(np.concatenate([i.pixel_values for i in inputs]))
    return np.asarray(encode_images(params, cfg, pixels, tuple(i.grid_thw for i in inputs)))


@pytest.mark.parametrize("sizes", [SIZES, SIZES[1:]], ids=["two_sizes", "one_image"])
def test_encoder_equals_transformers(hf_model, ours, sizes):
    cfg, params = ours
    inputs = images(sizes)
    want = theirs(hf_model[0], inputs)
    got = encode(cfg, params, inputs)
    assert got.shape == want.shape == (sum(i.num_tokens for i in inputs), 64)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.abs(want).max() > 0.5  # outputs of a size where 1e-4 means something
    layout = vision_layout(tuple(i.grid_thw for i in inputs), 2, cfg.window_units)
    windows = layout.windows.valid.sum(axis=1)
    assert len(windows) > len(inputs) and windows.min() < windows.max()  # split, some cut


def test_windows_and_full_blocks_both_matter(hf_model, ours):
    cfg, params = ours
    inputs = images(SIZES[1:])
    want = theirs(hf_model[0], inputs)
    for full in ((), (0, 1, 2)):  # every block windowed, every block full
        other = dataclasses.replace(cfg, fullatt_block_indexes=full)
        assert np.abs(encode(other, params, inputs) - want).max() > 1e-2


def test_encoder_compiles_once_per_grid(ours):
    cfg, params = ours
    inputs = images(SIZES[1:])
    encode(cfg, params, inputs)
    before = encode_images._cache_size()
    encode(cfg, params, images(SIZES[1:]))
    assert encode_images._cache_size() == before


def test_config_defaults_are_transformers(hf_model):
    hf_defaults = transformers.Qwen2_5_VLVisionConfig().to_dict()
    assert QwenVisionConfig.from_hf(hf_defaults) == QwenVisionConfig.from_hf({})
    assert QwenVisionConfig.from_hf({}) == QwenVisionConfig()


@pytest.mark.parametrize("field, value, match", [
    ("model_type", "qwen2_vl", "model_type"),
    ("rope_parameters", {"rope_type": "default"}, "rope_type"),
    ("hidden_act", "relu6", "hidden_act"),
    ("num_heads", 5, "hidden_size"),
    ("hidden_size", 36, "hidden_size"),  # head_dim 18 with 2 heads: not a multiple of 4
    ("patch_size", [14, 14], "patch_size"),
    ("window_size", 20, "window_size"),
    ("fullatt_block_indexes", [1, 3], "fullatt_block_indexes"),
])
def test_config_refusals_name_the_field(field, value, match):
    base = {"depth": 3, "hidden_size": 32, "num_heads": 2, "fullatt_block_indexes": [1]}
    with pytest.raises(ValueError, match=match):
        QwenVisionConfig.from_hf({**base, field: value})


class Renamed:
    """The tiny checkpoint's vision tensors under `model.visual.` (another saver's names)."""

    def __init__(self, source):
        self.source = source

    def get(self, name):
        if not name.startswith("model.visual."):
            raise KeyError(name)
        return self.source.get(name[len("model."):])

    def where(self, name):
        return "renamed"


def test_loader_prefixes_and_refusals(hf_model, ours):
    cfg, params = ours
    source = SafetensorsDir(str(hf_model[1]))
    assert find_prefix(source) == "visual."
    renamed = load_qwen_vision(Renamed(source), cfg)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), renamed, params))
    with pytest.raises(ValueError, match="no vision tower"):
        load_qwen_vision(Renamed(Renamed(source)), cfg)  # no tensor under either prefix
    with pytest.raises(ValueError, match="mlp.gate_proj.weight"):
        load_qwen_vision(source, dataclasses.replace(cfg, intermediate_size=40))
    with pytest.raises(ValueError, match=r"blocks\.3\.norm1\.weight"):
        load_qwen_vision(source, dataclasses.replace(cfg, depth=4))


def rope_index(model, ids, grids):
    ids_t = torch.tensor([ids])
    return model.model.get_rope_index(ids_t, (ids_t == IMAGE_TOKEN).int(),
                                      image_grid_thw=torch.tensor(grids))


def prompt(inputs, text=(5, 3, 4)):
    """Text, image, text, image, text: int token ids with each image's placeholders."""
    ids = list(range(100, 100 + text[0]))
    for n, image in zip(text[1:], inputs, strict=True):
        ids += [IMAGE_TOKEN] * image.num_tokens + list(range(200, 200 + n))
    return ids


def test_mrope_positions_equal_get_rope_index(hf_model):
    inputs = images(SIZES)
    ids, grids = prompt(inputs), [i.grid_thw for i in inputs]
    want, want_delta = rope_index(hf_model[0], ids, grids)
    got, delta = mrope_positions(ids, grids, IMAGE_TOKEN, 2)
    assert got.dtype == np.int32 and got.shape == (3, len(ids))
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert delta == int(want_delta) < 0
    # generated tokens continue from the prompt's largest position
    assert (mrope_text_positions(len(ids), 2, delta) == got.max() + np.array([1, 2])).all()
    text_only, zero = mrope_positions([1, 2, 3], [], IMAGE_TOKEN, 2)
    assert zero == 0 and (text_only == np.arange(3)).all()


def test_mrope_positions_refusals():
    inputs = images(SIZES[1:])
    ids = prompt(inputs, text=(2, 1))
    with pytest.raises(ValueError, match="image tokens"):
        mrope_positions(ids[:-2], [inputs[0].grid_thw], IMAGE_TOKEN, 2)
    split = ids[:5] + [7] + ids[5:]  # the same count, cut by a text token
    with pytest.raises(ValueError, match="consecutive"):
        mrope_positions(split, [inputs[0].grid_thw], IMAGE_TOKEN, 2)


def test_mrope_cos_sin_equal_transformers(hf_model):
    model = hf_model[0]
    inputs = images(SIZES)
    positions, _ = mrope_positions(prompt(inputs), [i.grid_thw for i in inputs], IMAGE_TOKEN, 2)
    pos_t = torch.from_numpy(positions.astype(np.int64))[:, None, :]  # [3, 1, T]
    with torch.no_grad():
        cos, sin = model.model.language_model.rotary_emb(torch.zeros(1, dtype=torch.float32),
                                                         pos_t)
    section = mrope_section_of(model.config.text_config.to_dict())
    assert section == tuple(SECTION)
    ours_cos, ours_sin = jax.jit(mrope_cos_sin, static_argnums=(1, 2, 3))(
        jnp.asarray(positions), 16, 10000.0, section)
    np.testing.assert_allclose(ours_cos, cos[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(ours_sin, sin[0].numpy(), atol=1e-6)
    with pytest.raises(ValueError, match="mrope_section"):
        mrope_cos_sin(jnp.asarray(positions), 16, 10000.0, (2, 3, 4))
    assert mrope_section_of({}) == (16, 24, 24)
    assert mrope_section_of({"rope_scaling": {"type": "mrope", "mrope_section": [1, 2, 3]}}) == (
        1, 2, 3)
