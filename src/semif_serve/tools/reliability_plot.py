"""The reliability diagram `semif-serve calibrate --plot` writes: accuracy per confidence bin
before and after the fitted temperature, drawn into an RGB pixel array and saved as a PNG with
zlib and struct alone (no plotting library in the service's dependencies)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from semif_serve.domain.numerics import ConfidenceBin

PLOT = 300  # side of each panel's square plot area, in pixels
LEFT, TOP, BOTTOM, RIGHT, GAP = 56, 64, 48, 24, 72
WIDTH = LEFT + 2 * PLOT + GAP + RIGHT
HEIGHT = TOP + PLOT + BOTTOM
SCALE = 2  # font pixels per glyph pixel

WHITE = (255, 255, 255)
GRID = (225, 225, 225)
AXIS = (60, 60, 60)
BAR = (70, 110, 190)
DIAGONAL = (200, 60, 60)
INK = (20, 20, 20)

# A 5x7 bitmap font for the characters the titles use; anything else is drawn as "?".
_GLYPHS = {
    "A": " ### |#   #|#   #|#####|#   #|#   #|#   #",
    "B": "#### |#   #|#   #|#### |#   #|#   #|#### ",
    "C": " ### |#   #|#    |#    |#    |#   #| ### ",
    "D": "#### |#   #|#   #|#   #|#   #|#   #|#### ",
    "E": "#####|#    |#    |#### |#    |#    |#####",
    "F": "#####|#    |#    |#### |#    |#    |#    ",
    "G": " ### |#   #|#    |# ###|#   #|#   #| ####",
    "H": "#   #|#   #|#   #|#####|#   #|#   #|#   #",
    "I": " ### |  #  |  #  |  #  |  #  |  #  | ### ",
    "J": "  ###|   # |   # |   # |   # |#  # | ##  ",
    "K": "#   #|#  # |# #  |##   |# #  |#  # |#   #",
    "L": "#    |#    |#    |#    |#    |#    |#####",
    "M": "#   #|## ##|# # #|# # #|#   #|#   #|#   #",
    "N": "#   #|#   #|##  #|# # #|#  ##|#   #|#   #",
    "O": " ### |#   #|#   #|#   #|#   #|#   #| ### ",
    "P": "#### |#   #|#   #|#### |#    |#    |#    ",
    "Q": " ### |#   #|#   #|#   #|# # #|#  # | ## #",
    "R": "#### |#   #|#   #|#### |# #  |#  # |#   #",
    "S": " ####|#    |#    | ### |    #|    #|#### ",
    "T": "#####|  #  |  #  |  #  |  #  |  #  |  #  ",
    "U": "#   #|#   #|#   #|#   #|#   #|#   #| ### ",
    "V": "#   #|#   #|#   #|#   #|#   #| # # |  #  ",
    "W": "#   #|#   #|#   #|# # #|# # #|# # #| # # ",
    "X": "#   #|#   #| # # |  #  | # # |#   #|#   #",
    "Y": "#   #|#   #| # # |  #  |  #  |  #  |  #  ",
    "Z": "#####|    #|   # |  #  | #   |#    |#####",
    "0": " ### |#   #|#  ##|# # #|##  #|#   #| ### ",
    "1": "  #  | ##  |  #  |  #  |  #  |  #  | ### ",
    "2": " ### |#   #|    #|   # |  #  | #   |#####",
    "3": "#####|   # |  #  |   # |    #|#   #| ### ",
    "4": "   # |  ## | # # |#  # |#####|   # |   # ",
    "5": "#####|#    |#### |    #|    #|#   #| ### ",
    "6": "  ## | #   |#    |#### |#   #|#   #| ### ",
    "7": "#####|    #|   # |  #  | #   | #   | #   ",
    "8": " ### |#   #|#   #| ### |#   #|#   #| ### ",
    "9": " ### |#   #|#   #| ####|    #|   # | ##  ",
    ".": "     |     |     |     |     | ##  | ##  ",
    ",": "     |     |     |     | ##  |  #  | #   ",
    "=": "     |     |#####|     |#####|     |     ",
    ":": "     | ##  | ##  |     | ##  | ##  |     ",
    "-": "     |     |     |#####|     |     |     ",
    "_": "     |     |     |     |     |     |#####",
    "(": "   # |  #  | #   | #   | #   |  #  |   # ",
    ")": " #   |  #  |   # |   # |   # |  #  | #   ",
    "/": "     |    #|   # |  #  | #   |#    |     ",
    "?": " ### |#   #|    #|   # |  #  |     |  #  ",
    " ": "     |     |     |     |     |     |     ",
}
GLYPH_W, GLYPH_H = 5, 7
ADVANCE = (GLYPH_W + 1) * SCALE


@dataclass(frozen=True)
class Panel:
    """One half of the diagram: its title and the bins it draws."""

    title: str
    bins: Sequence[ConfidenceBin]


def plot_origin(panel: int) -> tuple[int, int]:
    """The pixel (x, y) of panel `panel`'s plot-area corner at confidence 0, accuracy 1 (top left)."""
    return LEFT + panel * (PLOT + GAP), TOP


class Canvas:
    """An RGB pixel array with the few drawing operations the diagram needs."""

    def __init__(self, width: int, height: int, background: tuple[int, int, int] = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def put(self, x: int, y: int, color: tuple[int, int, int]) -> None:
        """Set one pixel; points outside the canvas are ignored."""
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i : i + 3] = bytes(color)

    def fill(self, x0: int, y0: int, x1: int, y1: int, color: tuple[int, int, int]) -> None:
        """Fill the rectangle [x0, x1) x [y0, y1)."""
        x0, x1 = max(x0, 0), min(x1, self.width)
        if x1 <= x0:
            return
        run = bytes(color) * (x1 - x0)
        for y in range(max(y0, 0), min(y1, self.height)):
            start = 3 * (y * self.width + x0)
            self.pixels[start : start + len(run)] = run

    def text(self, x: int, y: int, words: str, color: tuple[int, int, int] = INK) -> None:
        """Draw `words` (upper-cased) with the 5x7 font, top-left corner at (x, y)."""
        for i, char in enumerate(words.upper()):
            rows = _GLYPHS.get(char, _GLYPHS["?"]).split("|")
            for gy, row in enumerate(rows):
                for gx, cell in enumerate(row):
                    if cell == "#":
                        left, top = x + i * ADVANCE + gx * SCALE, y + gy * SCALE
                        self.fill(left, top, left + SCALE, top + SCALE, color)

    def png(self, text_chunks: dict[str, str] | None = None) -> bytes:
        """The canvas as an 8-bit RGB PNG (filter 0 on every row), with optional tEXt chunks."""

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        stride = 3 * self.width
        raw = b"".join(
            b"\x00" + bytes(self.pixels[y * stride : (y + 1) * stride]) for y in range(self.height)
        )
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        texts = [
            chunk(b"tEXt", key.encode("latin-1") + b"\x00" + value.encode("latin-1", "replace"))
            for key, value in (text_chunks or {}).items()
        ]
        return b"".join(
            [b"\x89PNG\r\n\x1a\n", chunk(b"IHDR", header), *texts]
            + [chunk(b"IDAT", zlib.compress(raw, 9)), chunk(b"IEND", b"")]
        )


def _draw_panel(canvas: Canvas, index: int, panel: Panel) -> None:
    x0, y0 = plot_origin(index)
    bins = len(panel.bins)
    for tick in range(bins + 1):  # grid every bin width, both ways
        offset = round(tick * PLOT / bins)
        canvas.fill(x0 + offset, y0, x0 + offset + 1, y0 + PLOT, GRID)
        canvas.fill(x0, y0 + offset, x0 + PLOT, y0 + offset + 1, GRID)
    for b, confidence_bin in enumerate(panel.bins):
        if confidence_bin.count == 0:
            continue
        left, right = x0 + round(b * PLOT / bins) + 2, x0 + round((b + 1) * PLOT / bins) - 1
        canvas.fill(left, y0 + PLOT - round(confidence_bin.accuracy * PLOT), right, y0 + PLOT, BAR)
    for step in range(PLOT):  # perfect calibration: accuracy equals confidence
        canvas.put(x0 + step, y0 + PLOT - 1 - step, DIAGONAL)
    canvas.fill(x0 - 1, y0, x0, y0 + PLOT + 1, AXIS)
    canvas.fill(x0 - 1, y0 + PLOT, x0 + PLOT, y0 + PLOT + 1, AXIS)
    canvas.text(x0, y0 - 24, panel.title)
    canvas.text(x0 - 14, y0 + PLOT + 6, "0")
    canvas.text(x0 + PLOT - 10, y0 + PLOT + 6, "1")
    canvas.text(x0 - 14, y0, "1")
    label = "CONFIDENCE"
    canvas.text(x0 + (PLOT - len(label) * ADVANCE) // 2, y0 + PLOT + 24, label)
    for i, char in enumerate("ACCURACY"):  # the y label, one letter per line
        canvas.text(x0 - 40, y0 + 60 + i * 18, char)


def reliability_png(heading: str, before: Panel, after: Panel) -> bytes:
    """The two-panel reliability diagram as PNG bytes: bars are accuracy per bin, red is y = x."""
    canvas = Canvas(WIDTH, HEIGHT)
    canvas.text(LEFT, 10, heading)
    for index, panel in enumerate((before, after)):
        _draw_panel(canvas, index, panel)
    title = f"{heading} | {before.title} | {after.title}"
    return canvas.png({"Title": title, "Software": "semif-serve calibrate"})


def write_reliability_png(path: Path, heading: str, before: Panel, after: Panel) -> None:
    """Write `reliability_png(...)` to `path`."""
    Path(path).write_bytes(reliability_png(heading, before, after))
