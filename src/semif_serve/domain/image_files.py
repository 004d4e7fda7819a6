"""The structure of PNG and JPEG files, read from their bytes, for what Pillow's decoders do not say.

Pillow decodes without complaint, and fills with pixels it never read: a PNG whose zlib stream
ends before its last row (the rest left black), a PNG without IEND or with a wrong CRC after
its first IDAT, a JPEG whose entropy-coded data ends before the frame its header declares
(libjpeg fills the rest grey and warns; Pillow silences the warning), a JPEG missing a whole
restart interval (libjpeg resynchronises at the next restart marker and fills the gap grey), a
JPEG without EOI, a JPEG whose frame header names a coding it reads as garbage (arithmetic
coding reads any bits), a palette PNG without a palette (Pillow invents one) or with pixels
past its palette's end.
`png_layout` and `jpeg_layout` walk the chunks and markers (cheap: no pixel is decoded) and
refuse those; `png_data_complete` inflates the image data to count it; `jpeg_padded` gives the
bytes a JPEG completeness probe decodes (see domain.images.decode_whole).
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Channels per PNG colour type (greyscale, RGB, palette, grey + alpha, RGBA).
PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}
# Adam7's seven passes: (first column, first row, column step, row step).
ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
INFLATE_STEP = 1 << 20  # bytes inflated at a time while counting: never the whole image at once

# JPEG frame headers (SOF markers) by the coding they declare; Pillow's libjpeg reads the first three.
JPEG_READ = {0xC0: "baseline", 0xC1: "extended sequential", 0xC2: "progressive"}
JPEG_REFUSED = {
    0xC3: "lossless",
    0xC5: "differential sequential (hierarchical)",
    0xC6: "differential progressive (hierarchical)",
    0xC7: "differential lossless (hierarchical)",
    0xC9: "arithmetic-coded sequential",
    0xCA: "arithmetic-coded progressive",
    0xCB: "arithmetic-coded lossless",
    0xCD: "arithmetic-coded differential sequential",
    0xCE: "arithmetic-coded differential progressive",
    0xCF: "arithmetic-coded differential lossless",
    0xDE: "hierarchical (DHP)",
    0xDC: "DNL (a height given after the scan)",
}
SOS, EOI, SOI, DRI = 0xDA, 0xD9, 0xD8, 0xDD
RESTARTS = range(0xD0, 0xD8)  # RST0..RST7, written in turn (modulo 8) between restart intervals
# A marker in entropy-coded data: the first 0xFF of a run (fill bytes belong to the marker),
# not followed by the 0x00 that stuffs a data byte 0xFF. Possessive and anchored: linear time.
ENTROPY_MARKER = re.compile(rb"(?<!\xff)\xff++([^\x00])")
MARKER = re.compile(rb"\xff++(.)", re.DOTALL)
# Entropy-coded segments one JPEG may hold (a restart interval is one): a 4096 x 4096 picture
# restarting at every MCU has 65,536.
MAX_JPEG_SEGMENTS = 200_000


class BrokenImage(ValueError):
    """Bytes whose structure is not a whole image of their format; the message says why."""


@dataclass(frozen=True)
class PngLayout:
    """What the header of a structurally whole PNG declares, and its image data (IDAT) in order."""

    width: int
    height: int
    bit_depth: int
    colour_type: int
    interlaced: bool
    idat: tuple[tuple[int, int], ...]  # (start, stop) of each IDAT chunk's data
    palette: int = 0  # entries of the PLTE chunk (0: none)

    @property
    def raw_bytes(self) -> int:
        """Bytes the image data inflates to: each row of each pass, its filter byte first."""
        bits = PNG_CHANNELS.get(self.colour_type, 1) * self.bit_depth
        passes = ADAM7 if self.interlaced else ((0, 0, 1, 1),)
        total = 0
        for x0, y0, dx, dy in passes:
            columns = max(0, -(-(self.width - x0) // dx))
            rows = max(0, -(-(self.height - y0) // dy))
            if columns and rows:
                total += rows * (1 + -(-(columns * bits) // 8))
        return total


def png_layout(data: bytes) -> PngLayout:
    """Walk every chunk of a PNG: IHDR first, each chunk whole with its CRC right, IEND last; a
    palette image's (colour type 3) PLTE before its image data, of at most 2^bit depth entries.
    Raises BrokenImage."""
    view, pos = memoryview(data), len(PNG_SIGNATURE)
    idat: list[tuple[int, int]] = []
    header: tuple[int, ...] | None = None
    palette: int | None = None
    while True:
        if pos + 8 > len(data):
            raise BrokenImage("the PNG ends before its IEND chunk")
        length, kind = struct.unpack_from(">I4s", data, pos)
        stop = pos + 8 + length
        if stop + 4 > len(data):
            raise BrokenImage(f"the PNG is cut inside its {kind.decode('latin-1')!r} chunk")
        (crc,) = struct.unpack_from(">I", data, stop)
        if zlib.crc32(view[pos + 4 : stop]) != crc:
            raise BrokenImage(f"the CRC of the PNG's {kind.decode('latin-1')!r} chunk at byte {pos} is wrong")
        if kind == b"IHDR":
            if header is not None:
                raise BrokenImage("the PNG has two IHDR chunks")
            if length != 13:
                raise BrokenImage("the PNG's IHDR chunk is not 13 bytes")
            header = struct.unpack_from(">IIBBBBB", data, pos + 8)
        elif header is None:
            raise BrokenImage("the PNG's first chunk is not IHDR")
        elif kind == b"PLTE" and header[3] == 3:  # other types' PLTE is a hint no decoder reads
            palette = _png_palette(length, header[2], palette)
        elif kind == b"IDAT":
            if not idat and header[3] == 3 and palette is None:  # a PLTE after IDAT comes too late
                raise BrokenImage(
                    "the PNG is a palette image (colour type 3) without a palette (PLTE) before its "
                    "image data (its decoder would invent the colours)"
                )
            idat.append((pos + 8, stop))
        elif kind == b"IEND":
            break
        pos = stop + 4
    if header is None or not idat:
        raise BrokenImage("the PNG has no image data (IDAT)")
    width, height, depth, colour, _, _, interlace = header
    return PngLayout(
        width=width,
        height=height,
        bit_depth=depth,
        colour_type=colour,
        interlaced=interlace == 1,
        idat=tuple(idat),
        palette=palette or 0,
    )


def _png_palette(length: int, depth: int, seen: int | None) -> int:
    """The entries of a palette PNG's PLTE chunk of `length` bytes (at most 2^`depth`). Raises BrokenImage."""
    if seen is not None:
        raise BrokenImage("the PNG has two palette (PLTE) chunks")
    if length == 0 or length % 3:
        raise BrokenImage(f"the PNG's palette (PLTE) is {length} bytes, not a whole number of RGB entries")
    entries = length // 3
    if entries > min(256, 1 << depth):
        raise BrokenImage(
            f"the PNG's palette (PLTE) has {entries} entries: a {depth}-bit palette image has "
            f"at most {min(256, 1 << depth)}"
        )
    return entries


def png_data_complete(data: bytes, layout: PngLayout) -> None:
    """Inflate the image data and check it is one whole zlib stream holding every row the header
    declares (Pillow leaves missing rows black). Raises BrokenImage."""
    inflater, produced, expected = zlib.decompressobj(), 0, layout.raw_bytes
    view = memoryview(data)
    try:
        for start, stop in layout.idat:
            pending: bytes | memoryview = view[start:stop]
            while pending and not inflater.eof:
                produced += len(inflater.decompress(pending, INFLATE_STEP))
                pending = inflater.unconsumed_tail
            if inflater.eof:
                break
    except zlib.error:
        raise BrokenImage("the PNG's image data is not a valid zlib stream") from None
    if produced < expected:
        raise BrokenImage(
            f"the PNG's image data holds {produced} of the {expected} bytes its "
            f"{layout.width} x {layout.height} header declares"
        )
    if not inflater.eof:
        raise BrokenImage("the PNG's image data (zlib stream) is cut before its end and checksum")


@dataclass(frozen=True)
class JpegLayout:
    """A structurally whole JPEG's first picture: its coding, scans, and where each
    entropy-coded segment (a scan, or a restart interval of one) ends."""

    coding: str
    scans: int
    segment_ends: tuple[int, ...]
    end: int  # one past the first picture's EOI (an MPO's next picture may follow)


def jpeg_layout(data: bytes, max_scans: int) -> JpegLayout:
    """Walk a JPEG's markers up to its first EOI: one frame of a coding Pillow reads, at most
    `max_scans` scans (checked as they are met), each component's every coefficient read to its
    last bit by some scan, every scan's data followed by a marker, and within each scan every
    restart interval the scan's MCUs and the restart interval (DRI) in force make, their restart
    markers in turn. Raises BrokenImage."""
    pos, frame, scans, interval = 2, None, 0, 0
    ends: list[int] = []
    known: dict[int, list[int]] = {}  # per component: the lowest bit of each coefficient read so far
    geometry = FrameGeometry(0, 0, {})
    while True:
        match = MARKER.match(data, pos)
        if match is None:
            if pos + 1 < len(data):
                raise BrokenImage(f"the JPEG has bytes that are not a marker at byte {pos}")
            raise BrokenImage("the JPEG ends before its end marker (EOI)")
        marker, pos = match[1][0], match.end()
        if marker == EOI:
            break
        if marker in RESTARTS or marker in (SOI, 0x01):
            raise BrokenImage(f"the JPEG has a stray marker 0xFF{marker:02X} at byte {match.start()}")
        if pos + 2 > len(data):
            raise BrokenImage("the JPEG ends before its end marker (EOI)")
        (length,) = struct.unpack_from(">H", data, pos)
        body = data[pos + 2 : pos + length]
        if length < 2 or len(body) < length - 2:
            raise BrokenImage(f"the JPEG is cut inside its segment 0xFF{marker:02X}")
        pos += length
        if marker in JPEG_REFUSED:
            raise BrokenImage(
                f"the JPEG is {JPEG_REFUSED[marker]}: this service reads baseline, "
                "extended sequential and progressive Huffman-coded JPEGs only"
            )
        if marker in JPEG_READ:
            if frame is not None:
                raise BrokenImage("the JPEG has two frame headers (SOF) in one picture")
            frame = marker
            known, geometry = _frame_components(body)
        elif marker == DRI:
            if len(body) != 2:
                raise BrokenImage(f"the JPEG's restart interval (DRI) segment is {len(body)} bytes, not 2")
            (interval,) = struct.unpack(">H", body)  # in MCUs, for the scans that follow; 0: none
        elif marker == SOS:
            if frame is None:
                raise BrokenImage("the JPEG has a scan before its frame header (SOF)")
            scans += 1
            if scans > max_scans:
                raise BrokenImage(f"the JPEG has more than {max_scans} scans, the most this service decodes")
            mcus = geometry.mcus(_read_scan(body, known, sequential=frame != 0xC2))
            restarts = -(-mcus // interval) - 1 if interval else 0
            pos = _entropy_end(data, pos, ends, restarts, scans)
    if frame is None:
        raise BrokenImage("the JPEG has no frame header (SOF)")
    for component, bits in known.items():
        if any(bit != 0 for bit in bits):
            raise BrokenImage(
                f"the JPEG's scans leave coefficients of component {component} unread "
                "(its decoder would fill them with zeros)"
            )
    return JpegLayout(JPEG_READ[frame], scans, tuple(ends), pos)


@dataclass(frozen=True)
class FrameGeometry:
    """A frame's size and each component's sampling factors (H, V), by component id."""

    width: int
    height: int
    sampling: dict[int, tuple[int, int]]

    def mcus(self, components: list[int]) -> int:
        """The MCUs of a scan of these components: an interleaved scan's MCU covers 8 Hmax x
        8 Vmax pixels; a scan of one component has one of that component's 8 x 8 blocks per MCU."""
        h_max = max(h for h, _ in self.sampling.values())
        v_max = max(v for _, v in self.sampling.values())
        if len(components) > 1:
            return -(-self.width // (8 * h_max)) * -(-self.height // (8 * v_max))
        h, v = self.sampling[components[0]]
        return -(-self.width * h // (8 * h_max)) * -(-self.height * v // (8 * v_max))


def _frame_components(body: bytes) -> tuple[dict[int, list[int]], FrameGeometry]:
    if len(body) < 6 or body[5] == 0 or len(body) < 6 + 3 * body[5]:
        raise BrokenImage("the JPEG's frame header (SOF) is cut short")
    if body[0] != 8:
        raise BrokenImage(f"the JPEG has {body[0]}-bit samples: this service reads 8-bit JPEGs only")
    height, width = struct.unpack_from(">HH", body, 1)
    if width == 0 or height == 0:
        raise BrokenImage(f"the JPEG's frame header (SOF) declares {width} x {height} pixels")
    sampling = {}
    for i in range(body[5]):
        h, v = body[7 + 3 * i] >> 4, body[7 + 3 * i] & 0x0F
        if not (1 <= h <= 4 and 1 <= v <= 4):
            raise BrokenImage(f"the JPEG's component {body[6 + 3 * i]} has sampling factors {h} x {v}")
        sampling[body[6 + 3 * i]] = (h, v)
    unread = 99  # no bit of the coefficient read yet
    return {component: [unread] * 64 for component in sampling}, FrameGeometry(width, height, sampling)


def _read_scan(body: bytes, known: dict[int, list[int]], *, sequential: bool) -> list[int]:
    """Mark the coefficients the scan reads; returns the ids of its components."""
    count = body[0] if body else 0
    if count == 0 or len(body) < 4 + 2 * count:
        raise BrokenImage("the JPEG's scan header (SOS) is cut short")
    first, last, bits = body[1 + 2 * count], body[2 + 2 * count], body[3 + 2 * count]
    if sequential:  # libjpeg reads every coefficient of a sequential scan, whatever Ss, Se and Al say
        first, last, bits = 0, 63, 0
    for i in range(count):
        component = known.get(body[1 + 2 * i])
        if component is None:
            raise BrokenImage(f"the JPEG's scan names component {body[1 + 2 * i]}, not in its frame")
        for k in range(first, min(last, 63) + 1):
            component[k] = bits & 0x0F  # a scan leaves coefficient k known down to bit Al
    return [body[1 + 2 * i] for i in range(count)]


def _entropy_end(data: bytes, pos: int, ends: list[int], restarts: int, scan: int) -> int:
    """Where the scan's entropy-coded data starting at `pos` ends (its next marker other than a
    restart), after exactly `restarts` restart markers, RST0, RST1, ... (modulo 8): libjpeg, at
    a restart marker out of turn, skips to it and fills the intervals between grey. The end of
    every segment is appended to `ends`."""
    seen = 0
    for match in ENTROPY_MARKER.finditer(data, pos):
        ends.append(match.start())
        if len(ends) > MAX_JPEG_SEGMENTS:
            raise BrokenImage(f"the JPEG has more than {MAX_JPEG_SEGMENTS} restart intervals")
        marker = match[1][0]
        if marker not in RESTARTS:
            if seen != restarts:
                raise BrokenImage(_missing_intervals(scan, seen, restarts))
            return match.start()
        if seen == restarts:
            raise BrokenImage(
                f"the JPEG's scan {scan} has more restart markers than the {restarts} its restart "
                "interval and size make"
            )
        if marker - RESTARTS.start != seen % 8:
            raise BrokenImage(
                f"the JPEG's scan {scan} has restart marker RST{marker - RESTARTS.start} at byte "
                f"{match.start()} where RST{seen % 8} is next (a restart interval is missing: its "
                "decoder would fill it)"
            )
        seen += 1
    raise BrokenImage("the JPEG ends inside its scan data, before its end marker (EOI)")


def _missing_intervals(scan: int, seen: int, restarts: int) -> str:
    return (
        f"the JPEG's scan {scan} has {seen} restart markers where its restart interval and size make "
        f"{restarts} (a restart interval is missing: its decoder would fill it)"
    )


def jpeg_padded(data: bytes, layout: JpegLayout, padding: bytes) -> bytes:
    """The first picture with `padding` (no 0xFF in it) inserted where each entropy-coded segment
    ends. A decoder that read every segment whole skips it (bytes before a marker); one that
    ran short of a segment's data reads it instead of filling, so the pixels differ."""
    pieces, start = [], 0
    for end in layout.segment_ends:
        pieces += [data[start:end], padding]
        start = end
    pieces.append(data[start : layout.end])
    return b"".join(pieces)
