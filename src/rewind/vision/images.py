"""Images sent with a request: decode and check them before any model work.

Requests carry images as base64 (OpenAI `data:` URLs, Anthropic `source.data`). They are decoded
here, on the caller's thread, into plain RGB pixels plus the SHA-256 of the bytes as sent: the
hash names the image in prompt-cache keys and in the vision-feature LRU, so the same picture sent
again is recognised without looking at its pixels. Every failure is an `ImageError` whose message
a client can act on; the server turns it into a 400.

Fetching http(s) URLs is off unless the server allows it (a server that fetches arbitrary URLs
on request is an SSRF hole); even then only this module fetches, with a size cap and a timeout.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Defaults that stop a request from exhausting memory before the model sees it.
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # encoded size, as sent
MAX_IMAGE_PIXELS = 50_000_000  # decoded width * height (a decompression bomb stops here)
MAX_IMAGES_PER_REQUEST = 8
URL_TIMEOUT_SECONDS = 10.0

_DATA_URL = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)$", re.DOTALL)


class ImageError(ValueError):
    """An image that cannot be used: not decodable, too large, too many, or a refused URL."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = MAX_IMAGE_BYTES
    max_pixels: int = MAX_IMAGE_PIXELS
    max_images: int = MAX_IMAGES_PER_REQUEST
    allow_urls: bool = False


# Is an image with this SHA-256 already known good (its tower output kept)? Then decoding it
# again can wait until its pixels are needed, which they are not while its features are kept.
KnownImage = Callable[[bytes], bool]


@dataclass(frozen=True)
class DecodedImage:
    """One request image: RGB pixels (a PIL image) and the SHA-256 of its encoded bytes.

    `pixels` is None for an image whose bytes were already decoded and used before (see
    KnownImage); `rgb()` decodes it from `data` if its pixels are needed after all."""

    pixels: Any  # PIL.Image.Image in RGB mode, or None (not decoded yet)
    sha256: bytes
    nbytes: int  # encoded size
    data: bytes = b""  # the encoded bytes, kept only while pixels is None

    @property
    def size(self) -> tuple[int, int]:
        return self.rgb().size

    def rgb(self) -> Any:
        return self.pixels if self.pixels is not None else _decode(self.data, ImageLimits())


def image_from_bytes(data: bytes, limits: ImageLimits = ImageLimits(),
                     known: KnownImage | None = None) -> DecodedImage:
    """Decode encoded image bytes (PNG, JPEG, WebP, GIF, ...) into RGB pixels, within limits.
    With `known`, the bytes of an image it knows are kept undecoded."""
    if not data:
        raise ImageError("the image is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is {len(data)} bytes; the limit is {limits.max_bytes} bytes")
    sha = hashlib.sha256(data).digest()
    if known is not None and known(sha):
        return DecodedImage(pixels=None, sha256=sha, nbytes=len(data), data=data)
    return DecodedImage(pixels=_decode(data, limits), sha256=sha, nbytes=len(data))


def _decode(data: bytes, limits: ImageLimits) -> Any:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as probe:
            width, height = probe.size
            if width * height > limits.max_pixels:
                raise ImageError(f"the image is {width}x{height} pixels; the limit is "
                                 f"{limits.max_pixels} pixels")
            probe.load()
            pixels = probe.convert("RGB")
    except ImageError:
        raise
    except (Image.DecompressionBombError, OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"the image could not be decoded: {exc}") from exc
    return pixels


def image_from_base64(text: str, limits: ImageLimits = ImageLimits(),
                      known: KnownImage | None = None) -> DecodedImage:
    # Base64 is 4/3 of the bytes: refuse an oversized payload before decoding it.
    if len(text) > limits.max_bytes * 4 // 3 + 4:
        raise ImageError(f"the image is larger than the limit of {limits.max_bytes} bytes")
    try:
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the image data is not valid base64: {exc}") from exc
    return image_from_bytes(data, limits, known)


def image_from_url(url: str, limits: ImageLimits = ImageLimits(),
                   known: KnownImage | None = None) -> DecodedImage:
    """A `data:...;base64,` URL, or an http(s) URL when `limits.allow_urls` is set."""
    if not isinstance(url, str) or not url:
        raise ImageError("image_url must be a non-empty string")
    if url.startswith("data:"):
        match = _DATA_URL.match(url)
        if match is None:
            raise ImageError("only base64 data URLs are accepted (data:image/png;base64,...)")
        return image_from_base64(match.group("data"), limits, known)
    if url.startswith(("http://", "https://")):
        if not limits.allow_urls:
            raise ImageError("image URLs are not fetched by this server; send the image inline "
                             "as a base64 data URL (or start the server with --allow-image-urls)")
        return image_from_bytes(_fetch(url, limits), limits, known)
    raise ImageError("image_url must be a data: URL with base64 data"
                     + (" or an http(s) URL" if limits.allow_urls else ""))


def _fetch(url: str, limits: ImageLimits) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT_SECONDS) as response:  # noqa: S310
            data = response.read(limits.max_bytes + 1)
    except OSError as exc:
        raise ImageError(f"the image at {url} could not be fetched: {exc}") from exc
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image at {url} is larger than {limits.max_bytes} bytes")
    return data


class ImageCollector:
    """Gathers a request's images in prompt order and enforces the per-request count."""

    def __init__(self, limits: ImageLimits = ImageLimits(),
                 known: KnownImage | None = None) -> None:
        self.limits = limits
        self.known = known
        self.images: list[DecodedImage] = []

    def add(self, image: DecodedImage) -> None:
        if len(self.images) >= self.limits.max_images:
            raise ImageError(f"too many images: at most {self.limits.max_images} per request")
        self.images.append(image)

    def add_url(self, url: str) -> DecodedImage:
        self._check_room()
        image = image_from_url(url, self.limits, self.known)
        self.add(image)
        return image

    def add_base64(self, data: str) -> DecodedImage:
        self._check_room()
        image = image_from_base64(data, self.limits, self.known)
        self.add(image)
        return image

    def _check_room(self) -> None:
        # Before decoding: a request with 1000 images fails fast, not after decoding them all.
        if len(self.images) >= self.limits.max_images:
            raise ImageError(f"too many images: at most {self.limits.max_images} per request")
