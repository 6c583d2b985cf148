"""decode_image(data, max_pixels): bytes -> an RGB PIL image, or a MediaError.

Image.open only reads the header; the pixel count it gives is checked against the cap before
load() decodes a single pixel, so a small file that claims 30000 x 30000 (a decompression
bomb) costs its header. Pillow's own guard (Image.MAX_IMAGE_PIXELS, which raises at twice the
value) is set to the same cap as a second line. Only the formats below are opened: Pillow's
others include ones that run external programs (EPS) or are rarely safe to parse.

Every decoder failure becomes MediaError("the image could not be decoded"): a decoder's own
message can hold internals (object addresses, paths), and the client needs none of them.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image

from metrale.multimodal.errors import MediaError

FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP")


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the header alone."""
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            return image.size
    except Exception:  # noqa: BLE001 - any decoder failure looks the same from outside
        raise MediaError("the image could not be decoded") from None


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=FORMATS) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise MediaError(f"the image is {width} x {height} pixels, more than the {max_pixels:,} "
                                     f"allowed (--media-max-image-pixels)")
                if width < 1 or height < 1:
                    raise MediaError("the image has no pixels")
                image.load()
                return image.convert("RGB")
    except MediaError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):  # Pillow's guard fired first, in open
        raise MediaError(f"the image has more than the {max_pixels:,} pixels allowed (--media-max-image-pixels)") from None
    except Exception:  # noqa: BLE001 - Pillow raises many types (OSError, SyntaxError, ValueError, bombs, ...)
        raise MediaError("the image could not be decoded") from None
