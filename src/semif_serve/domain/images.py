"""Images a request carries: what their bytes really are, their size read from the header
before a pixel is decoded, and their digest.

Formats are detected from the bytes (never from a label): PNG and JPEG only. The pixel count
is checked against the limit from the header alone, so a few kilobytes that declare
100,000 x 100,000 pixels are refused without inflating; only then is the image decoded in
full, which proves the bytes are the image they claim to be.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from dataclasses import dataclass, field
from typing import Any

# The wire's format names -> the format they mean (jpg and jpeg are one format).
FORMATS = {"png": "png", "jpg": "jpeg", "jpeg": "jpeg"}
SIGNATURES = {b"\x89PNG\r\n\x1a\n": "png", b"\xff\xd8\xff": "jpeg"}
# Pillow's formats -> ours. MPO, a JPEG holding several pictures (phones' "Ultra HDR"), is
# opened by the JPEG plugin; its first picture is read.
PILLOW_FORMATS = {"PNG": "png", "JPEG": "jpeg", "MPO": "jpeg"}
PILLOW_OPENERS = ["PNG", "JPEG"]
# Qwen's image processor (smart_resize) reads no image whose long side is over 200 times its short one.
MAX_ASPECT_RATIO = 200
# A progressive JPEG decodes once per scan (start-of-scan marker): encoders write about 10;
# a few kilobytes of empty scans would otherwise buy minutes of decoding.
MAX_JPEG_SCANS = 100
START_OF_SCAN = b"\xff\xda"  # entropy-coded data stuffs every 0xFF with 0x00: only markers match
ORIENTATION = 0x0112  # the EXIF tag; values 5 to 8 turn the picture by a quarter


class ImageRejected(ValueError):
    """Bytes that are not an image we read, or one past a limit; `too_large` says which."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.too_large = too_large


@dataclass(frozen=True)
class ImageAsset:
    """One image of a request: its placeholder, format, size, bytes and their SHA-256."""

    placeholder: str
    format: str  # "png" or "jpeg"
    width: int
    height: int
    data: bytes = field(repr=False)
    sha256: str


def sniff_format(data: bytes) -> str | None:
    """The format the bytes' signature says (png or jpeg), or None."""
    return next((name for magic, name in SIGNATURES.items() if data.startswith(magic)), None)


def read_image(placeholder: str, data: bytes, *, claimed: str | None, max_pixels: int) -> ImageAsset:
    """Check `data` is a whole PNG or JPEG (the `claimed` wire format, when one is given) of at
    most `max_pixels` pixels and an aspect ratio under MAX_ASPECT_RATIO, both read from its
    header before decoding; raises ImageRejected."""
    if not data:
        raise ImageRejected("the image is empty")
    found = sniff_format(data)
    if found is None:
        raise ImageRejected("the bytes are neither a PNG nor a JPEG image")
    if claimed is not None and FORMATS[claimed] != found:
        raise ImageRejected(f"the asset says {claimed!r} but its bytes are a {found.upper()} image")
    from PIL import Image, UnidentifiedImageError

    if found == "jpeg" and (scans := data.count(START_OF_SCAN)) > MAX_JPEG_SCANS:
        raise ImageRejected(f"the JPEG has {scans} scans, over the {MAX_JPEG_SCANS} this service decodes")
    with warnings.catch_warnings():
        # Our own limit applies below; Pillow's bomb warning and error mean the same thing earlier.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            with Image.open(io.BytesIO(data), formats=PILLOW_OPENERS) as image:
                width, height = image.size  # from the header: nothing is decoded yet
                if width * height > max_pixels:
                    raise ImageRejected(_too_many_pixels(width, height, max_pixels), too_large=True)
                if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
                    raise ImageRejected(
                        f"the image is {width} x {height}: the model's image processor reads no image "
                        f"whose long side is more than {MAX_ASPECT_RATIO} times its short side"
                    )
                if PILLOW_FORMATS.get(image.format or "") != found:
                    raise ImageRejected(f"the bytes are not a valid {found.upper()} image")
                image.load()
                if image.getexif().get(ORIENTATION) in (5, 6, 7, 8):
                    width, height = height, width  # read upright, as a viewer shows it
        except Image.DecompressionBombError:
            raise ImageRejected(
                f"the image declares more pixels than the limit of {max_pixels}", too_large=True
            ) from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            if isinstance(exc, ImageRejected):
                raise
            raise ImageRejected(f"the bytes are not a valid {found.upper()} image ({exc})") from None
    return ImageAsset(placeholder, found, width, height, data, hashlib.sha256(data).hexdigest())


def upright_rgb(image: Any) -> Any:
    """An opened image as the model reads it: turned upright as its EXIF orientation says, in
    8-bit RGB (16-bit greys scaled, not clipped: Pillow's own conversion would clip them white)."""
    from PIL import Image, ImageOps

    image = ImageOps.exif_transpose(image)
    if image.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        import numpy as np

        image = Image.fromarray((np.asarray(image, dtype=np.uint32) >> 8).astype(np.uint8), "L")
    return image.convert("RGB")


def _too_many_pixels(width: int, height: int, limit: int) -> str:
    return f"the image is {width} x {height} = {width * height} pixels, over the limit of {limit}"
