"""Images a request carries: what their bytes really are, their size read from the header
before a pixel is decoded, their structure, and their digest.

Formats are detected from the bytes (never from a label): PNG and JPEG only. The pixel count
is checked against the limit from the header alone, so a few kilobytes that declare
100,000 x 100,000 pixels are refused without inflating; then the file's structure is walked
(domain.image_files: chunks, CRCs, markers, the coding, the end marker) and the image is
decoded in full and checked to hold every pixel it declares (`decode_whole`), once per
SHA-256 (`VerifiedImages`): decoding never fills pixels it did not read.
"""

from __future__ import annotations

import hashlib
import io
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from semif_serve.domain.echo import quoted
from semif_serve.domain.image_files import (
    BrokenImage,
    JpegLayout,
    PngLayout,
    jpeg_layout,
    jpeg_padded,
    png_data_complete,
    png_layout,
)

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
ORIENTATION = 0x0112  # the EXIF tag; values 5 to 8 turn the picture by a quarter
# What the JPEG completeness probe puts where each entropy-coded segment ends. libjpeg, out of a
# segment's data, reads zero bits to finish the block it is in, then fills: the padding's bits
# must differ from zeros from the first (0x55 = 01010101), over more than a block's codes.
PROBE_PADDING = b"\x55" * 64
VERIFIED_IMAGES = 4096  # digests remembered as decoded whole (a few hundred bytes each)


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


class VerifiedImages:
    """Images already decoded whole, by SHA-256, with their upright size: one sent again is
    checked from its header and structure and not decoded again (the most recent
    `capacity` are kept; thread-safe: requests check their images on worker threads)."""

    def __init__(self, capacity: int = VERIFIED_IMAGES) -> None:
        self.capacity = capacity
        self._sizes: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, digest: str) -> tuple[int, int] | None:
        """The upright size of an image decoded whole before, or None."""
        with self._lock:
            size = self._sizes.get(digest)
            if size is not None:
                self._sizes.move_to_end(digest)
            return size

    def add(self, digest: str, size: tuple[int, int]) -> None:
        """Remember an image decoded whole, dropping the least recently seen past `capacity`."""
        with self._lock:
            self._sizes[digest] = size
            self._sizes.move_to_end(digest)
            while len(self._sizes) > self.capacity:
                self._sizes.popitem(last=False)


def read_image(
    placeholder: str,
    data: bytes,
    *,
    claimed: str | None,
    max_pixels: int,
    verified: VerifiedImages | None = None,
) -> ImageAsset:
    """Check `data` is a whole PNG or JPEG (the `claimed` wire format, when one is given) of at
    most `max_pixels` pixels and an aspect ratio under MAX_ASPECT_RATIO, both read from its
    header before decoding, then its structure, then every pixel (`decode_whole`; skipped for
    a digest `verified` already holds); raises ImageRejected."""
    if not data:
        raise ImageRejected("the image is empty")
    found = sniff_format(data)
    if found is None:
        raise ImageRejected("the bytes are neither a PNG nor a JPEG image")
    if claimed is not None and FORMATS[claimed] != found:
        raise ImageRejected(f"the asset says {quoted(claimed)} but its bytes are a {found.upper()} image")
    from PIL import Image, UnidentifiedImageError

    digest = hashlib.sha256(data).hexdigest()
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
            layout = png_layout(data) if found == "png" else jpeg_layout(data, MAX_JPEG_SCANS)
            upright = verified.get(digest) if verified is not None else None
            if upright is None:
                upright = decode_whole(data, layout)
                if verified is not None:
                    verified.add(digest, upright)
        except BrokenImage as exc:
            raise ImageRejected(str(exc)) from None
        except Image.DecompressionBombError:
            raise ImageRejected(
                f"the image declares more pixels than the limit of {max_pixels}", too_large=True
            ) from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
            if isinstance(exc, ImageRejected):
                raise
            raise ImageRejected(f"the bytes are not a valid {found.upper()} image") from None
    return ImageAsset(placeholder, found, *upright, data, digest)


def decode_whole(data: bytes, layout: PngLayout | JpegLayout) -> tuple[int, int]:
    """Decode every pixel of a structurally whole image and check none was filled in: a PNG's
    image data must inflate to every row (counted) and a palette PNG's pixels must index its
    palette; a JPEG must decode to the same pixels with padding where each entropy-coded segment
    ends (a decoder that ran short of a segment reads the padding instead of filling, so the
    pixels differ). Returns the upright (width, height);
    raises BrokenImage, or Pillow's own errors."""
    from PIL import Image, ImageChops

    if isinstance(layout, PngLayout):
        png_data_complete(data, layout)
    with Image.open(io.BytesIO(data), formats=PILLOW_OPENERS) as image:
        image.load()
        if isinstance(layout, PngLayout) and layout.colour_type == 3:
            _, largest = image.getextrema()  # mode P: the palette indices themselves
            if isinstance(largest, tuple) or largest >= layout.palette:
                raise BrokenImage(
                    f"the PNG's pixels use palette index {largest}, past its palette (PLTE) of "
                    f"{layout.palette} entries (its decoder would invent the colour)"
                )
        if isinstance(layout, JpegLayout):
            padded = io.BytesIO(jpeg_padded(data, layout, PROBE_PADDING))
            with Image.open(padded, formats=["JPEG"]) as probe:
                probe.load()
                if ImageChops.difference(image, probe).getbbox() is not None:
                    raise BrokenImage(
                        f"the JPEG's entropy-coded data runs out before the {image.width} x {image.height} "
                        "picture its header declares is read (a scan or restart interval is cut "
                        "short: the decoder would fill the rest)"
                    )
        width, height = image.size
        if image.getexif().get(ORIENTATION) in (5, 6, 7, 8):
            width, height = height, width  # read upright, as a viewer shows it
    return width, height


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
