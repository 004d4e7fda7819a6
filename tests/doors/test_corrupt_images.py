"""Corrupt images are refused whole (422 naming the asset) before any engine work; valid ones of
every kind still read as before. Each corrupt file is built here, with Pillow and by hand, and
the ones Pillow itself decodes without complaint are shown to be so (it fills pixels it never
read): the refusal comes from the service's own checks, not from Pillow.
"""

from __future__ import annotations

import io
import re
import struct
import threading
import time
import zlib

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image as PILImage

from harness.server import LoopbackServer
from semif_serve.app import create_app
from semif_serve.domain import images as images_module
from semif_serve.domain.images import ImageRejected, VerifiedImages, read_image
from tests.doors.test_systemone_images import (
    NO_VISION,
    PLACEHOLDER,
    body,
    chunk,
    image_asset,
    post,
    post_multipart,
    refused,
)
from tests.support import TOKEN, in_process_client

WHERE = ["body", "assets", PLACEHOLDER, "data_base64"]


def noise(size=(64, 64)) -> PILImage.Image:
    return PILImage.effect_noise(size, 60).convert("RGB")


def encoded(image: PILImage.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **options)
    return out.getvalue()


PNG = encoded(noise(), "PNG")
JPEG = encoded(noise(), "JPEG")
PROGRESSIVE = encoded(noise(), "JPEG", progressive=True)
RESTARTS = encoded(noise(), "JPEG", restart_marker_rows=1)
# A restart interval of one MCU: 16 MCUs of 16 x 16 (4:2:0), so 15 restart markers.
RESTART_EVERY_MCU = encoded(noise(), "JPEG", quality=90, restart_marker_blocks=1)
PROGRESSIVE_RESTARTS = encoded(noise(), "JPEG", progressive=True, restart_marker_blocks=1)


def with_frame_size(data: bytes, sof: bytes, width: int, height: int) -> bytes:
    """The JPEG with its frame header (SOF) declaring width x height; its scan data unchanged."""
    at = data.index(sof)
    return data[: at + 5] + struct.pack(">HH", height, width) + data[at + 9 :]


def with_marker(data: bytes, old: bytes, new: bytes) -> bytes:
    at = data.index(old)
    return data[:at] + new + data[at + 2 :]


def png_of_rows(width: int, height: int, rows: int, cut: int = 0) -> bytes:
    """A PNG, byte by byte with right CRCs and IEND, whose one zlib stream holds `rows` rows
    (its last `cut` bytes dropped)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = zlib.compress((b"\x00" + b"\x80" * 3 * width) * rows)
    data = data[: len(data) - cut]
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def flip_byte(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]


def idat_crc_at(data: bytes) -> int:
    at = data.index(b"IDAT")
    (length,) = struct.unpack(">I", data[at - 4 : at])
    return at + 4 + length


def short_restart_interval(data: bytes) -> bytes:
    """The JPEG with ten bytes cut from the end of its second restart interval."""
    restarts = [i for i in range(len(data) - 1) if data[i] == 0xFF and 0xD0 <= data[i + 1] <= 0xD7]
    return data[: restarts[1] - 10] + data[restarts[1] :]


def restart_markers(data: bytes) -> list[int]:
    return [m.start() for m in re.finditer(rb"\xff[\xd0-\xd7]", data)]


def without_restart_intervals(data: bytes, first: int, count: int = 1) -> bytes:
    """The JPEG without the restart marker `first` (counted over the whole file) and the
    `count` - 1 next ones and the intervals they open: the markers left are whole intervals."""
    rst = restart_markers(data)
    return data[: rst[first]] + data[rst[first + count] :]


def palette_png(depth: int, indices: list[int], palette: bytes | None, *, after: bytes = b"") -> bytes:
    """An 8 x 2 palette PNG (colour type 3), byte by byte, each row the pixel `indices` at
    `depth` bits; its PLTE chunk holds `palette` (none if None); `after`: chunks after IDAT."""
    width, per_byte = 8, 8 // depth
    row = bytearray()
    for at in range(0, width, per_byte):
        value = 0
        for index in indices[at : at + per_byte]:
            value = value << depth | index
        row.append(value)
    header = struct.pack(">IIBBBBB", width, 2, depth, 3, 0, 0, 0)
    plte = chunk(b"PLTE", palette) if palette is not None else b""
    idat = chunk(b"IDAT", zlib.compress((b"\x00" + bytes(row)) * 2))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + plte + idat + after + chunk(b"IEND", b"")


def without_last_scan(data: bytes) -> bytes:
    return data[: data.rindex(b"\xff\xda")] + b"\xff\xd9"


CORRUPT = {
    **{f"png cut at {cut}": PNG[: int(len(PNG) * cut)] for cut in (0.1, 0.5, 0.9)},
    **{f"jpeg cut at {cut}": JPEG[: int(len(JPEG) * cut)] for cut in (0.1, 0.5, 0.9)},
    **{f"progressive jpeg cut at {cut}": PROGRESSIVE[: int(len(PROGRESSIVE) * cut)] for cut in (0.3, 0.8)},
    "png without IEND": PNG[:-12],
    "png cut inside IEND": PNG[:-5],
    "png with a wrong IDAT CRC": flip_byte(PNG, idat_crc_at(PNG)),
    "png with a wrong IEND CRC": flip_byte(PNG, len(PNG) - 1),
    "png whose zlib stream ends four rows in": png_of_rows(64, 64, 4),
    "png whose zlib stream lacks its checksum": png_of_rows(64, 64, 64, cut=4),
    "jpeg without EOI": JPEG[:-2],
    "jpeg header 1024x1024 over a 64x64 scan": with_frame_size(JPEG, b"\xff\xc0", 1024, 1024),
    "jpeg header 64x72 over a 64x64 scan": with_frame_size(JPEG, b"\xff\xc0", 64, 72),
    "progressive jpeg header 1024x1024": with_frame_size(PROGRESSIVE, b"\xff\xc2", 1024, 1024),
    "jpeg with a short restart interval": short_restart_interval(RESTARTS),
    "progressive jpeg missing its last scan": without_last_scan(PROGRESSIVE),
    "jpeg missing a whole restart interval": without_restart_intervals(RESTART_EVERY_MCU, 3),
    "jpeg missing eight restart intervals (markers still in turn)": without_restart_intervals(
        RESTART_EVERY_MCU, 3, 8
    ),
    "jpeg whose restart interval (DRI) is doubled": RESTART_EVERY_MCU.replace(
        b"\xff\xdd\x00\x04\x00\x01", b"\xff\xdd\x00\x04\x00\x02"
    ),
    "progressive jpeg missing a whole restart interval of an AC scan": without_restart_intervals(
        PROGRESSIVE_RESTARTS, 30
    ),
    "palette png without a palette (PLTE)": palette_png(8, [3] * 8, None),
    "palette png whose pixels index past its 1-entry palette": palette_png(8, [200] * 8, b"\x10\x20\x30"),
    "4-bit palette png whose pixels index past its 3-entry palette": palette_png(
        4, [0, 1, 2, 3] * 2, b"\x80" * 9
    ),
    "palette png whose PLTE is not whole entries": palette_png(8, [0] * 8, b"\x10\x20\x30\x40"),
    "1-bit palette png with a 3-entry palette": palette_png(1, [0, 1] * 4, b"\x80" * 9),
    "palette png whose PLTE comes after its image data": palette_png(
        8, [0] * 8, None, after=chunk(b"PLTE", b"\x10\x20\x30")
    ),
    "arithmetic-coded jpeg (SOF9)": with_marker(JPEG, b"\xff\xc0", b"\xff\xc9"),
    "arithmetic-coded progressive jpeg (SOF10)": with_marker(PROGRESSIVE, b"\xff\xc2", b"\xff\xca"),
    "lossless jpeg (SOF3)": with_marker(JPEG, b"\xff\xc0", b"\xff\xc3"),
    "hierarchical jpeg (SOF5)": with_marker(JPEG, b"\xff\xc0", b"\xff\xc5"),
}
# Of those, the files Pillow 13 decodes without an error (it fills what it did not read).
PILLOW_FILLS = [
    "png without IEND",
    "png cut inside IEND",
    "png with a wrong IDAT CRC",
    "png with a wrong IEND CRC",
    "png whose zlib stream ends four rows in",
    "png whose zlib stream lacks its checksum",
    "jpeg header 1024x1024 over a 64x64 scan",
    "jpeg header 64x72 over a 64x64 scan",
    "progressive jpeg header 1024x1024",
    "jpeg with a short restart interval",
    "progressive jpeg missing its last scan",
    "jpeg missing a whole restart interval",
    "jpeg missing eight restart intervals (markers still in turn)",
    "jpeg whose restart interval (DRI) is doubled",
    "progressive jpeg missing a whole restart interval of an AC scan",
    "palette png without a palette (PLTE)",
    "palette png whose pixels index past its 1-entry palette",
    "4-bit palette png whose pixels index past its 3-entry palette",
    "palette png whose PLTE is not whole entries",
    "1-bit palette png with a 3-entry palette",
    "palette png whose PLTE comes after its image data",
    "arithmetic-coded jpeg (SOF9)",
    "arithmetic-coded progressive jpeg (SOF10)",
]


def fmt_of(data: bytes) -> str:
    return "png" if data.startswith(b"\x89PNG") else "jpeg"


def test_pillow_itself_decodes_these_corrupt_files_without_an_error():
    for name in PILLOW_FILLS:
        with PILImage.open(io.BytesIO(CORRUPT[name])) as image:
            image.load()  # no error: what the service refuses, Pillow would have answered


@pytest.mark.parametrize("name", list(CORRUPT))
def test_a_corrupt_image_is_a_422_naming_the_asset(client, name):
    data = CORRUPT[name]
    reply = post(client, body(assets={PLACEHOLDER: image_asset(data, fmt_of(data))}))
    assert reply.status_code == 422, reply.text
    (item,) = reply.json()["detail"]
    assert item["loc"] == WHERE and item["type"] == "value_error"
    assert fmt_of(data).upper() in item["msg"]


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("png without IEND", "IEND"),
        ("png with a wrong IDAT CRC", "CRC"),
        ("png whose zlib stream ends four rows in", "of the 12352 bytes"),  # 64 rows of 1 + 192
        ("jpeg without EOI", "EOI"),
        ("jpeg header 1024x1024 over a 64x64 scan", "1024 x 1024"),
        ("jpeg with a short restart interval", "restart interval"),
        ("png whose zlib stream lacks its checksum", "checksum"),
        ("progressive jpeg missing its last scan", "unread"),
        ("arithmetic-coded jpeg (SOF9)", "arithmetic-coded"),
        ("lossless jpeg (SOF3)", "lossless"),
        ("jpeg missing a whole restart interval", "RST4 at byte .* where RST3 is next"),
        (
            "jpeg missing eight restart intervals (markers still in turn)",
            "has 7 restart markers where .* make 15",
        ),
        ("jpeg whose restart interval (DRI) is doubled", "more restart markers than the 7"),
        ("progressive jpeg missing a whole restart interval of an AC scan", "restart interval is missing"),
        ("palette png without a palette (PLTE)", "without a palette"),
        (
            "palette png whose pixels index past its 1-entry palette",
            "index 200, past its palette .* of 1 entries",
        ),
        ("4-bit palette png whose pixels index past its 3-entry palette", "index 3, past"),
        ("palette png whose PLTE is not whole entries", "not a whole number"),
        ("1-bit palette png with a 3-entry palette", "has at most 2"),
        ("palette png whose PLTE comes after its image data", "without a palette"),
    ],
)
def test_the_refusal_says_what_is_wrong(name, words):
    with pytest.raises(ImageRejected, match=words):
        read_image(PLACEHOLDER, CORRUPT[name], claimed=None, max_pixels=16_777_216)


@settings(max_examples=150, deadline=None)
@given(
    source=st.sampled_from(
        [PNG, JPEG, PROGRESSIVE, RESTARTS, PROGRESSIVE_RESTARTS, palette_png(4, [1] * 8, b"\x80" * 6)]
    ),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
    cut=st.integers(0, 10**6),
)
def test_any_edit_or_cut_of_a_valid_image_is_read_or_refused_never_an_other_error(source, edits, cut):
    data = bytearray(source[: max(8, len(source) - cut % len(source))])
    for at, value in edits:
        data[at % len(data)] = value
    try:
        image = read_image(PLACEHOLDER, bytes(data), claimed=None, max_pixels=16_777_216)
    except ImageRejected:
        return
    assert image.width * image.height <= 16_777_216


def test_a_corrupt_image_sent_as_a_multipart_part_names_the_part(client):
    reply = post_multipart(
        client,
        body(assets={PLACEHOLDER: {"type": "image", "part": "asset-0"}}),
        {"asset-0": CORRUPT["jpeg header 1024x1024 over a 64x64 scan"]},
    )
    assert reply.status_code == 422, reply.text
    assert reply.json()["detail"][0]["loc"] == ["body", "assets", PLACEHOLDER, "part"]


def test_webp_and_gif_bytes_are_refused_as_neither_png_nor_jpeg(client):
    for fmt in ("WEBP", "GIF"):
        reply = post(client, body(assets={PLACEHOLDER: image_asset(encoded(noise(), fmt), "png")}))
        assert reply.status_code == 422 and "neither a PNG nor a JPEG" in reply.json()["detail"][0]["msg"]


def ancillary_png() -> bytes:
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("Comment", "ancillary chunks before and after the image data")
    info.add_itxt("Title", "titre", lang="fr", zip=True)
    return encoded(noise(), "PNG", pnginfo=info, dpi=(72, 72), icc_profile=b"")


def rotated_jpeg() -> bytes:
    exif = PILImage.Exif()
    exif[0x0112] = 6
    return encoded(noise((40, 20)), "JPEG", exif=exif)


def with_scan_end_zero(data: bytes) -> bytes:
    """A baseline JPEG whose scan header says its scan ends at coefficient 0 (Se = 0): libjpeg
    reads every coefficient of a sequential scan anyway (and warns), so the pixels are whole."""
    sos = data.index(b"\xff\xda")
    at = sos + 4 + 1 + 2 * data[sos + 4] + 1
    return data[:at] + b"\x00" + data[at + 1 :]


def mpo() -> bytes:
    return encoded(noise((16, 16)), "MPO", save_all=True, append_images=[noise((16, 16))])


VALID = {
    "png": (PNG, (64, 64)),
    "interlaced png": (encoded(noise(), "PNG", interlace=True), (64, 64)),
    "png with ancillary chunks": (ancillary_png(), (64, 64)),
    "png with bytes after IEND": (PNG + b"trailing", (64, 64)),
    "16-bit grey png": (encoded(PILImage.new("I;16", (30, 10)), "PNG"), (30, 10)),
    "palette png": (encoded(noise().convert("P"), "PNG"), (64, 64)),
    **{
        f"{depth}-bit palette png{' with tRNS' if alpha else ''}": (
            encoded(
                noise((17, 33)).quantize(2**depth),
                "PNG",
                bits=depth,
                **({"transparency": 0} if alpha else {}),
            ),
            (17, 33),
        )
        for depth in (1, 2, 4, 8)
        for alpha in (False, True)
    },
    "palette png by hand, every index in its palette": (
        palette_png(2, [0, 1, 2, 3] * 2, b"\x80" * 12),
        (8, 2),
    ),
    "palette png by hand, a palette longer than its indices": (
        palette_png(8, [1] * 8, b"\x80" * 765),
        (8, 2),
    ),
    "baseline jpeg": (JPEG, (64, 64)),
    "optimised 4:4:4 jpeg": (encoded(noise(), "JPEG", optimize=True, subsampling=0, quality=95), (64, 64)),
    "progressive jpeg": (PROGRESSIVE, (64, 64)),
    "jpeg with restart markers": (RESTARTS, (64, 64)),
    "jpeg restarting at every MCU": (RESTART_EVERY_MCU, (64, 64)),
    "progressive jpeg restarting at every MCU": (PROGRESSIVE_RESTARTS, (64, 64)),
    **{
        f"{kind} {width}x{height} jpeg restarting every {blocks} MCUs": (
            encoded(noise((width, height)), "JPEG", restart_marker_blocks=blocks, **options),
            (width, height),
        )
        for kind, options in {
            "4:2:0": {},
            "4:2:2": {"subsampling": 1},
            "4:4:4": {"subsampling": 0},
            "progressive 4:2:0": {"progressive": True},
            "progressive 4:4:4": {"progressive": True, "subsampling": 0},
        }.items()
        for width, height in ((17, 33), (37, 23), (9, 8))
        for blocks in (1, 3)
    },
    "progressive jpeg restarting every row": (
        encoded(noise((41, 19)), "JPEG", progressive=True, restart_marker_rows=1),
        (41, 19),
    ),
    "grey progressive jpeg with restarts": (
        encoded(noise((17, 33)).convert("L"), "JPEG", progressive=True, restart_marker_blocks=2),
        (17, 33),
    ),
    "cmyk jpeg with restarts": (
        encoded(noise((17, 33)).convert("CMYK"), "JPEG", restart_marker_blocks=1),
        (17, 33),
    ),
    "baseline jpeg whose scan header says Se = 0": (with_scan_end_zero(JPEG), (64, 64)),
    "grey jpeg": (encoded(noise().convert("L"), "JPEG"), (64, 64)),
    "cmyk jpeg": (encoded(noise().convert("CMYK"), "JPEG"), (64, 64)),
    "exif-rotated jpeg": (rotated_jpeg(), (20, 40)),
    "multi-picture jpeg (MPO)": (mpo(), (16, 16)),
    "odd-sized jpeg": (encoded(noise((37, 23)), "JPEG"), (37, 23)),
}


@pytest.mark.parametrize("name", list(VALID))
def test_a_valid_image_of_every_kind_passes_every_image_rule(client, name):
    data, upright = VALID[name]
    image = read_image(PLACEHOLDER, data, claimed=None, max_pixels=16_777_216)
    assert (image.width, image.height) == upright
    reply = post(client, body(assets={PLACEHOLDER: image_asset(data, fmt_of(data))}))
    assert NO_VISION in refused(reply, 400, "api_usage_error")  # past every image rule


def test_an_image_decoded_whole_once_is_not_decoded_again_and_a_corrupt_one_is_never_remembered(monkeypatch):
    verified = VerifiedImages()
    first = read_image(PLACEHOLDER, JPEG, claimed="jpeg", max_pixels=10**6, verified=verified)
    assert verified.get(first.sha256) == (64, 64)

    def no_decode(*args):
        raise AssertionError("decoded again")

    with monkeypatch.context() as patched:
        patched.setattr(images_module, "decode_whole", no_decode)
        again = read_image(PLACEHOLDER, JPEG, claimed="jpeg", max_pixels=10**6, verified=verified)
        assert again == first
        with pytest.raises(ImageRejected, match="pixels"):  # the header limits still apply
            read_image(PLACEHOLDER, JPEG, claimed="jpeg", max_pixels=4095, verified=verified)
    bad = CORRUPT["jpeg header 1024x1024 over a 64x64 scan"]
    for _ in range(2):
        with pytest.raises(ImageRejected):
            read_image(PLACEHOLDER, bad, claimed=None, max_pixels=16_777_216, verified=verified)
    assert len(verified._sizes) == 1


def test_verified_images_keep_the_most_recent():
    verified = VerifiedImages(capacity=2)
    for digest in ("a", "b", "c"):
        verified.add(digest, (1, 1))
    assert verified.get("a") is None and verified.get("c") == (1, 1)
    verified.get("b")
    verified.add("d", (2, 2))
    assert verified.get("c") is None and verified.get("b") == (1, 1)


# -- on the vision checkpoint, over a live socket -----------------------------------------------------


@pytest.fixture(scope="module")
def vision_server(vision_service):
    with LoopbackServer(create_app(vision_service)) as running:
        yield running


def live_post(server, request: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/systemone",
        json=request,
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=timeout,
    )


def test_the_corrupt_header_jpeg_is_refused_before_any_engine_work_while_health_and_a_tiny_request_answer(
    vision_server, vision_service, monkeypatch
):
    engine_calls: list[str] = []
    tower = type(vision_service.engine.vision)
    original = tower.pixels
    monkeypatch.setattr(
        tower, "pixels", lambda self, image: engine_calls.append("pixels") or original(self, image)
    )
    bad = image_asset(CORRUPT["jpeg header 1024x1024 over a 64x64 scan"], "jpeg")
    replies: list[tuple[int, float]] = []

    def send_corrupt() -> None:
        for _ in range(3):
            started = time.perf_counter()
            reply = live_post(vision_server, body(assets={PLACEHOLDER: bad}))
            replies.append((reply.status_code, time.perf_counter() - started))

    sender = threading.Thread(target=send_corrupt)
    sender.start()
    health_times = []
    while sender.is_alive() or not health_times:
        started = time.perf_counter()
        assert httpx.get(f"{vision_server.url}/health", timeout=10).status_code == 200
        health_times.append(time.perf_counter() - started)
        time.sleep(0.05)  # the probes' pacing while the sender runs (it waits for nothing)
    sender.join()
    started = time.perf_counter()
    tiny = live_post(vision_server, body(state="A plain sentence."))
    tiny_wait = time.perf_counter() - started
    assert [status for status, _ in replies] == [422, 422, 422]
    assert max(seconds for _, seconds in replies) < 5  # before: 200 after 10 s of engine time
    assert max(health_times) < 2.0  # not held by the engine (~10 s before); 1.2 s seen on a loaded CI machine
    assert tiny.status_code == 200 and tiny_wait < 30
    assert engine_calls == []  # no pixel of the corrupt image reached the engine


def test_a_valid_image_is_still_answered_on_the_vision_checkpoint(vision_service):
    client = in_process_client(create_app(vision_service))
    for data in (PNG, PROGRESSIVE, rotated_jpeg(), mpo()):
        reply = post(client, body(assets={PLACEHOLDER: image_asset(data, fmt_of(data))}))
        assert reply.status_code == 200, reply.text
        assert 0.0 <= reply.json()["answers"]["red"]["noul"] <= 1.0
