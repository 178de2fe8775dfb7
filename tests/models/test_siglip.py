"""Gemma 3's vision tower and projector (`models.vision.siglip`) equal transformers'
`Gemma3ForConditionalGeneration.get_image_features` for a tiny random model, on images the
test makes and preprocesses with our processor; bad vision configs name their field."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.multimodal.processors import Gemma3Processor
from models.loaders.safetensors_dir import SafetensorsDir
from models.vision.siglip import SiglipConfig, encode_images, load_siglip
from tests.multimodal.test_processors import image

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# 32-pixel images of 4-pixel patches: an 8 x 8 grid pooled to 4 x 4 = 16 soft tokens.
CONFIG = dict(text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, sliding_window=8),
              vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, image_size=32, patch_size=4),
              mm_tokens_per_image=16, image_token_index=299, boi_token_index=297,
              eoi_token_index=298)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(the transformers model, our config, our params)."""
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(**CONFIG)).float().eval()
    with torch.no_grad():  # norms and the projection away from their zero init
        for name, p in hf.model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                if "norm" in name or "projection" in name:
                    p.copy_(0.5 * torch.randn(p.shape))
    path = str(tmp_path_factory.mktemp("gemma3_vision"))
    hf.save_pretrained(path)
    cfg = SiglipConfig.from_hf(hf.config.to_dict())
    return hf, cfg, load_siglip(SafetensorsDir(path), cfg)


def test_soft_tokens_equal_transformers(tiny):
    hf, cfg, params = tiny
    proc = Gemma3Processor(size=32, tokens=cfg.tokens_per_image)
    pixels = np.stack([proc(image(*s, seed=i)).pixel_values
                       for i, s in enumerate([(40, 30), (32, 32), (17, 50)])])
    with torch.no_grad():
        want = hf.model.get_image_features(torch.from_numpy(pixels)).pooler_output.numpy()
    got = np.asarray(jax.jit(encode_images, static_argnums=1)(params, cfg, pixels))
    assert got.shape == want.shape == (3, 16, 64)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)
    # one image alone gives its row of the batch (images never see each other)
    alone = np.asarray(encode_images(params, cfg, pixels[1:2]))
    np.testing.assert_allclose(alone[0], got[1], atol=1e-5)


@pytest.mark.parametrize("changes, field", [
    (dict(vision_config=dict(image_size=30, patch_size=4)), "image_size"),
    (dict(mm_tokens_per_image=15), "mm_tokens_per_image"),
    (dict(mm_tokens_per_image=9), "mm_tokens_per_image"),  # 3 does not divide 8
    (dict(vision_config=dict(image_size=32, patch_size=4, num_attention_heads=5)),
     "num_attention_heads"),
    (dict(vision_config=dict(image_size=32, patch_size=4, hidden_act="swish")), "hidden_act"),
])
def test_bad_vision_configs_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        SiglipConfig.from_hf({**CONFIG, **changes})


def test_a_tensor_of_the_wrong_shape_is_named(tiny):
    _, cfg, _ = tiny

    class Source:
        def get(self, name):
            return np.zeros((3,), np.float32)

    with pytest.raises(ValueError, match="encoder.layers.0.layer_norm1.weight: shape"):
        load_siglip(Source(), cfg)
