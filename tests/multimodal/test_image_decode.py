"""Image decoding: the pixel cap from the header before any decoding, and failures that say
nothing of the decoder's insides (reliability case 16)."""

from __future__ import annotations

import io
import time

import pytest
from PIL import Image, ImageFile

from media_servers import png_bytes, png_claiming, png_zlib_bomb
from metrale.multimodal.errors import MediaError
from metrale.multimodal.image_decode import decode_image

CAP = 64 << 20


def refused(data: bytes, cap: int = CAP) -> str:
    with pytest.raises(MediaError) as info:
        decode_image(data, cap)
    assert "0x" not in str(info.value)
    return str(info.value)


def test_a_png_claiming_30000_x_30000_is_refused_before_decoding(monkeypatch):
    data = png_claiming(30000, 30000)
    assert len(data) < 200 and data[16:24] == (30000).to_bytes(4, "big") * 2  # IHDR's width, height
    decoded = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self) or None)
    started = time.monotonic()
    assert "pixels allowed" in refused(data)
    assert time.monotonic() - started < 0.5 and decoded == []
    # Below Pillow's own guard (twice its MAX_IMAGE_PIXELS) the cap still holds.
    assert "pixels allowed" in refused(png_claiming(100, 100), cap=5000)
    assert "100 x 100 pixels" in refused(png_claiming(100, 100), cap=9999)


def test_a_real_zlib_bomb_is_refused_fast():
    bomb = png_zlib_bomb(12000)  # 144 Mpx of zeros
    assert len(bomb) < 64 << 10
    started = time.monotonic()
    assert "pixels allowed" in refused(bomb)
    assert time.monotonic() - started < 0.5


def test_a_small_bomb_under_a_large_cap_decodes():
    image = decode_image(png_zlib_bomb(600), CAP)
    assert image.size == (600, 600) and image.mode == "RGB"


@pytest.mark.parametrize("data", [b"", b"garbage", png_bytes()[:40], png_bytes()[:-20] + b"\0" * 20,
                                  b"\xff\xd8\xff\xe0" + b"\0" * 100,  # a JPEG header and nothing
                                  b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n",  # EPS: never opened
                                  png_claiming(10, 10)])  # its pixel data is short
def test_corrupt_images_say_only_that(data):
    assert refused(data) == "the image could not be decoded"


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "LA", "CMYK"])
def test_converted_to_rgb(mode):
    buffer = io.BytesIO()
    image = Image.new("RGB", (9, 4), (1, 2, 3)).convert(mode)
    image.save(buffer, "PNG" if mode != "CMYK" else "JPEG")
    decoded = decode_image(buffer.getvalue(), CAP)
    assert decoded.mode == "RGB" and decoded.size == (9, 4)


def test_formats():
    for fmt in ("JPEG", "WEBP", "GIF", "BMP"):
        buffer = io.BytesIO()
        Image.new("RGB", (5, 3), (200, 0, 0)).save(buffer, fmt)
        assert decode_image(buffer.getvalue(), CAP).size == (5, 3)
    buffer = io.BytesIO()
    Image.new("RGB", (5, 3)).save(buffer, "TIFF")
    assert refused(buffer.getvalue()) == "the image could not be decoded"  # not on the list
