"""Loading the images requests name (`jaxserve.multimodal.media`): data URLs of every
accepted format, allow-listed local files, PIL images; and every refusal a ValueError that
names the content part."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
from PIL import Image

from jaxserve.multimodal.media import MediaLimits, load_image

WHERE = "messages[0].content[1]"
W = re.escape(WHERE)  # for pytest.raises(match=)


def picture(width=12, height=8, mode="RGB") -> Image.Image:
    rng = np.random.default_rng(width * height)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).convert(mode)


def encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_data_urls_decode_to_rgb(fmt):
    img = picture()
    got = load_image(data_url(encoded(img, fmt), f"image/{fmt.lower()}"), MediaLimits())
    assert got.mode == "RGB" and got.size == (12, 8)
    if fmt != "JPEG":  # lossless: the same pixels
        assert np.array_equal(np.asarray(got), np.asarray(img))


def test_pil_images_pass_and_grey_becomes_rgb():
    got = load_image(picture(mode="L"), MediaLimits())
    assert got.mode == "RGB" and got.size == (12, 8)


def test_local_files_only_under_the_allowed_directory(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(encoded(picture(), "PNG"))
    (tmp_path / "secret.png").write_bytes(encoded(picture(), "PNG"))
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    assert load_image(f"file://{allowed}/a.png", limits).size == (12, 8)
    with pytest.raises(ValueError, match=f"{W}: .*outside --allowed-local-media-path"):
        load_image(f"file://{allowed}/../secret.png", limits, WHERE)
    with pytest.raises(ValueError, match=f"{W}: file:// URLs are refused"):
        load_image(f"file://{allowed}/a.png", MediaLimits(), WHERE)
    with pytest.raises(ValueError, match=f"{W}: cannot read"):
        load_image(f"file://{allowed}/missing.png", limits, WHERE)


@pytest.mark.parametrize("source, message", [
    (data_url(b"not an image"), "could not be decoded"),
    ("data:image/png;base64,@@@", "base64 is invalid"),
    ("data:text/plain;base64,aGk=", "data URL must be"),
    ("data:image/png," + "x" * 10, "data URL must be"),
    ("ftp://host/a.png", "unsupported image URL"),
    ("a.png", "unsupported image URL"),
    ("http://example.invalid/a.png", "http\\(s\\) image URLs are off"),
])
def test_bad_sources_name_the_part(source, message):
    with pytest.raises(ValueError, match=f"^{W}: .*{message}"):
        load_image(source, MediaLimits(allow_http=False), WHERE)


def test_limits_on_bytes_and_pixels():
    png = encoded(picture(40, 30), "PNG")
    with pytest.raises(ValueError, match=f"{W}: the image has 40x30 = 1200 pixels"):
        load_image(data_url(png), MediaLimits(max_pixels=1000), WHERE)
    with pytest.raises(ValueError, match=f"{W}: the image is over the 100 bytes"):
        load_image(data_url(png), MediaLimits(max_bytes=100), WHERE)
    with pytest.raises(ValueError, match=f"{W}: the image has"):
        load_image(picture(40, 30), MediaLimits(max_pixels=1000), WHERE)
    with pytest.raises(ValueError, match=f"{W}: expected a PIL image"):
        load_image(b"bytes", MediaLimits(), WHERE)
