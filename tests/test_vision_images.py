"""Request images: decoding, limits, hashes, and the bounded LRU of tower outputs."""

from __future__ import annotations

import base64
import hashlib
import io

import pytest

pytest.importorskip("PIL")
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

from rewind.vision.features import FeatureLRU  # noqa: E402
from rewind.vision.images import (  # noqa: E402
    ImageCollector,
    ImageError,
    ImageLimits,
    image_from_base64,
    image_from_bytes,
    image_from_url,
)


def encoded(width: int = 40, height: int = 30, fmt: str = "PNG", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_data_url_decodes_to_rgb_with_the_sha256_of_the_bytes(fmt):
    data = encoded(fmt=fmt)
    image = image_from_url(data_url(data, f"image/{fmt.lower()}"))
    assert image.pixels.mode == "RGB"
    assert image.size == (40, 30)
    assert image.sha256 == hashlib.sha256(data).digest()
    assert image.nbytes == len(data)


def test_grayscale_and_alpha_become_rgb():
    buffer = io.BytesIO()
    Image.new("LA", (8, 8), (128, 200)).save(buffer, "PNG")
    assert image_from_bytes(buffer.getvalue()).pixels.mode == "RGB"


def test_same_pixels_other_encoding_is_another_image():
    png, bmp = image_from_bytes(encoded(fmt="PNG")), image_from_bytes(encoded(fmt="BMP"))
    assert png.sha256 != bmp.sha256


@pytest.mark.parametrize("payload, message", [
    (b"not an image at all", "could not be decoded"),
    (b"", "empty"),
    (encoded()[:60], "could not be decoded"),  # a truncated PNG
])
def test_undecodable_bytes_are_refused(payload, message):
    with pytest.raises(ImageError, match=message):
        image_from_bytes(payload)


def test_invalid_base64_is_refused():
    with pytest.raises(ImageError, match="not valid base64"):
        image_from_base64("@@@ not base64 @@@")
    with pytest.raises(ImageError, match="not valid base64"):
        image_from_url("data:image/png;base64,abc$")


def test_size_limits():
    data = encoded(100, 100)
    with pytest.raises(ImageError, match="bytes; the limit"):
        image_from_bytes(data, ImageLimits(max_bytes=len(data) - 1))
    with pytest.raises(ImageError, match="larger than the limit"):
        image_from_base64(base64.b64encode(data).decode(), ImageLimits(max_bytes=len(data) // 2))
    with pytest.raises(ImageError, match="100x100 pixels"):
        image_from_bytes(data, ImageLimits(max_pixels=100 * 100 - 1))
    assert image_from_bytes(data, ImageLimits(max_bytes=len(data), max_pixels=100 * 100))


def test_urls_other_than_base64_data_are_refused_unless_allowed():
    with pytest.raises(ImageError, match="--allow-image-urls"):
        image_from_url("https://example.com/cat.png")
    with pytest.raises(ImageError, match="base64"):
        image_from_url("data:image/png,rawbytes")
    with pytest.raises(ImageError, match="data: URL"):
        image_from_url("file:///etc/passwd")
    with pytest.raises(ImageError, match="non-empty"):
        image_from_url("")


def test_collector_counts_images_in_order_and_caps_them():
    collector = ImageCollector(ImageLimits(max_images=2))
    first = collector.add_url(data_url(encoded(seed=1)))
    second = collector.add_base64(base64.b64encode(encoded(seed=2)).decode())
    assert [i.sha256 for i in collector.images] == [first.sha256, second.sha256]
    with pytest.raises(ImageError, match="too many images: at most 2"):
        collector.add_url(data_url(encoded(seed=3)))


class Sized:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def test_feature_lru_evicts_least_recent_within_budget():
    lru = FeatureLRU(budget_bytes=100)
    assert lru.put(b"a", Sized(40)) and lru.put(b"b", Sized(40))
    assert lru.get(b"a") is not None  # a is now the most recent
    assert lru.put(b"c", Sized(40))  # over budget: b goes
    assert b"b" not in lru and b"a" in lru and b"c" in lru
    assert lru.get(b"b") is None
    assert not lru.put(b"huge", Sized(101))  # larger than the whole budget: refused
    stats = lru.stats()
    assert stats["bytes"] == 80 and stats["entries"] == 2
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (1, 1, 1)


def test_feature_lru_replacing_a_key_keeps_the_byte_count():
    lru = FeatureLRU(budget_bytes=100)
    lru.put(b"a", Sized(30))
    lru.put(b"a", Sized(50))
    assert lru.stats()["bytes"] == 50 and len(lru) == 1


def test_known_image_is_hashed_not_decoded_until_its_pixels_are_needed():
    data = encoded(seed=7)
    sha = hashlib.sha256(data).digest()
    lazy = image_from_bytes(data, known=lambda digest: digest == sha)
    assert lazy.pixels is None and lazy.sha256 == sha
    assert lazy.rgb().size == (40, 30)  # decoded on demand
    eager = image_from_bytes(encoded(seed=8), known=lambda digest: digest == sha)
    assert eager.pixels is not None
    # Limits still hold for known bytes.
    with pytest.raises(ImageError, match="bytes; the limit"):
        image_from_bytes(data, ImageLimits(max_bytes=10), known=lambda digest: True)
