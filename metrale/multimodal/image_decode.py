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

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # JPEG opens MPO (multi-picture JPEG) files too
Image.init()  # registers every plugin, so each of FORMATS has its opener (Pillow loads five by itself)


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with warnings.catch_warnings():
            # Between the cap and twice it, Pillow only warns: the check below refuses those, naming the size.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=FORMATS) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise MediaError(f"the image is {width} x {height} pixels, more than the {max_pixels:,} "
                                     f"pixels allowed (--media-max-image-pixels)")
                if width < 1 or height < 1:
                    raise MediaError("the image has no pixels")
                image.load()
                return image.convert("RGB")
    except MediaError:
        raise
    except Image.DecompressionBombError:  # over twice the cap Pillow's guard fires first, in open
        raise MediaError(f"the image has more than the {max_pixels:,} pixels allowed (--media-max-image-pixels)") from None
    except Exception:  # noqa: BLE001 - Pillow raises many types (OSError, SyntaxError, ValueError, bombs, ...)
        raise MediaError("the image could not be decoded") from None
