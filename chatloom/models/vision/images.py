"""Reading untrusted image bytes into a PIL image, with the checks a server needs.

Every refusal is an ImageError whose message names the problem (not an image, corrupt, too many
pixels), so the product can answer 400 with it. The pixel limit is checked from the header, before
any pixel is decoded: a small file that claims 50,000 x 50,000 pixels (a decompression bomb) costs
nothing to refuse.
"""
from __future__ import annotations

import hashlib
import io
import warnings

from PIL import Image, UnidentifiedImageError

# Formats a browser or an API client sends; others (PSD, EPS, ...) are refused by name.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageError(ValueError):
    """An image cannot be used; the message says why, for the user."""


def content_hash(data: bytes) -> str:
    """The image's key in the encoder cache and the prefix cache: a hash of its bytes."""
    return hashlib.sha256(data).hexdigest()


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """The first frame of `data` as an RGB-ready PIL image, fully decoded; ImageError if it is not a
    supported image, is corrupt, or has more than `max_pixels` pixels."""
    if not data:
        raise ImageError("the image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width < 1 or height < 1:
                raise ImageError("the image has no pixels")
            if width * height > max_pixels:
                raise ImageError(f"the image has {width} x {height} pixels, more than the limit of {max_pixels}")
            image.load()
    except ImageError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        if isinstance(exc, UnidentifiedImageError):
            raise ImageError(f"the data is not an image ({', '.join(FORMATS)})") from None
        raise ImageError("the image has more pixels than allowed (a decompression bomb)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageError(f"the image is corrupt: {exc}") from None
    return image
