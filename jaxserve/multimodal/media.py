"""Images from where requests name them: `data:` URLs, `file://` paths under an allowed
directory (vLLM's `--allowed-local-media-path`), `http(s)` with a size and time limit, and
PIL images passed in Python; each decoded to RGB and checked against the pixel limit.

Every failure is a `ValueError` that names the content part it came from (`where`), so the
server answers a 400 about that part and nothing else is touched.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import urllib.parse
import urllib.request

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # what the decoder accepts


@dataclasses.dataclass(frozen=True)
class MediaLimits:
    """What an image may be and where it may come from.

    Attributes:
        allowed_local_media_path: The directory `file://` URLs may read under (None: no
            local files).
        max_bytes: The largest encoded image read (data URL, file or download).
        max_pixels: The largest decoded image (width x height).
        fetch_timeout_s: Seconds an `http(s)` download may take.
        allow_http: Whether `http(s)` URLs are fetched at all (off on a machine without a
            network).
    """

    allowed_local_media_path: str | None = None
    max_bytes: int = 20 << 20
    max_pixels: int = 40_000_000
    fetch_timeout_s: float = 10.0
    allow_http: bool = True


def _decode(data: bytes, limits: MediaLimits, where: str) -> Image.Image:
    """RGB image from encoded bytes, or a ValueError naming `where`."""
    if len(data) > limits.max_bytes:
        raise ValueError(f"{where}: the image is {len(data)} bytes, more than the "
                         f"{limits.max_bytes} allowed")
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        _check_size(image, limits, where)  # from the header, before decoding the pixels
        image.load()
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError) as e:
        raise ValueError(f"{where}: the image could not be decoded ({e})") from None
    return checked(image, limits, where)


def _check_size(image: Image.Image, limits: MediaLimits, where: str) -> None:
    width, height = image.size
    if width < 1 or height < 1:
        raise ValueError(f"{where}: the image is empty ({width}x{height})")
    if width * height > limits.max_pixels:
        raise ValueError(f"{where}: the image has {width}x{height} = {width * height} pixels, "
                         f"more than the {limits.max_pixels} allowed")


def checked(image: Image.Image, limits: MediaLimits, where: str) -> Image.Image:
    """`image` in RGB if it is within `limits.max_pixels`, else a ValueError naming `where`.

    Raises:
        ValueError: Not a PIL image, empty, or more pixels than allowed.
    """
    if not isinstance(image, Image.Image):
        raise ValueError(f"{where}: expected a PIL image, got {type(image).__name__}")
    _check_size(image, limits, where)
    return image if image.mode == "RGB" else image.convert("RGB")


def _data_url(url: str, limits: MediaLimits, where: str) -> Image.Image:
    header, sep, payload = url[len("data:"):].partition(",")
    if not sep or not header.endswith(";base64") or not header.startswith("image/"):
        raise ValueError(f"{where}: a data URL must be data:image/<type>;base64,<data>")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise ValueError(f"{where}: the image is over the {limits.max_bytes} bytes allowed")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where}: the data URL's base64 is invalid") from None
    return _decode(data, limits, where)


def _local_file(url: str, limits: MediaLimits, where: str) -> Image.Image:
    if limits.allowed_local_media_path is None:
        raise ValueError(f"{where}: file:// URLs are refused (start the server with "
                         "--allowed-local-media-path to allow a directory)")
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    root = os.path.realpath(limits.allowed_local_media_path)
    if os.path.commonpath([path, root]) != root:
        raise ValueError(f"{where}: {path} is outside --allowed-local-media-path {root}")
    try:
        with open(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)
    except OSError as e:
        raise ValueError(f"{where}: cannot read {path} ({e.strerror})") from None
    return _decode(data, limits, where)


def _download(url: str, limits: MediaLimits, where: str) -> Image.Image:
    if not limits.allow_http:
        raise ValueError(f"{where}: http(s) image URLs are off on this server")
    try:
        with urllib.request.urlopen(url, timeout=limits.fetch_timeout_s) as response:
            data = response.read(limits.max_bytes + 1)
    except (OSError, ValueError) as e:  # URLError and timeouts are OSErrors
        raise ValueError(f"{where}: could not fetch {url} ({e})") from None
    return _decode(data, limits, where)


def load_image(source, limits: MediaLimits, where: str = "image") -> Image.Image:
    """The RGB image a request names.

    Args:
        source: A PIL image, or a URL: `data:image/...;base64,...`, `file://...` (under
            `limits.allowed_local_media_path`) or `http(s)://...`.
        limits: What is allowed.
        where: The content part, named in errors (e.g. `messages[0].content[1]`).

    Raises:
        ValueError: Naming `where`: an unknown scheme, a refused or unreadable source, bytes
            that are not an image, or an image over the limits.
    """
    if not isinstance(source, str):
        return checked(source, limits, where)
    scheme = source.split(":", 1)[0].lower() if ":" in source else ""
    if scheme == "data":
        return _data_url(source, limits, where)
    if scheme == "file":
        return _local_file(source, limits, where)
    if scheme in ("http", "https"):
        return _download(source, limits, where)
    raise ValueError(f"{where}: unsupported image URL {source[:40]!r} (data:, file:// or "
                     "http(s):// expected)")
