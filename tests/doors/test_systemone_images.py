"""System One requests that carry images (`assets`, placeholders, multipart bodies, box questions),
through the real app on the tiny Qwen3.5, and through the official SDK against a live service.

Here on a checkpoint WITHOUT a vision tower: every request with an image must be refused with
a 4xx saying so, never answered from the placeholder text; every broken rule about images is a
4xx in TypeSafe's shapes naming the field; a text-only request is answered as before. (Reading
images, on the demo's checkpoint with a vision tower: test_systemone_vision.py.)
"""

from __future__ import annotations

import base64
import io
import json
import struct
import tracemalloc
import zlib

import httpx
import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image as PILImage
from typesafe_sdk import (
    Box,
    Choice,
    Image,
    Noul,
    TypeSafeBadRequestError,
    TypeSafeClient,
    TypeSafeUnprocessableEntityError,
)

from harness.server import LoopbackServer
from semif_serve.app import create_app
from semif_serve.domain.images import ImageRejected, read_image
from semif_serve.doors.systemone.multipart import MultipartRefused, parse_multipart
from semif_serve.service.startup import Service
from tests.support import TOKEN, make_settings

PLACEHOLDER = "<image:0123456789abcdef0123456789abcdef>"
OTHER = "<image:fedcba9876543210fedcba9876543210>"
NO_VISION = "does not read images"


def png(color=(255, 0, 0), size=(8, 8)) -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def jpeg(color=(0, 0, 255), size=(8, 8)) -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", size, color).save(out, format="JPEG")
    return out.getvalue()


def chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_declaring(width: int, height: int) -> bytes:
    """A PNG, written byte by byte, whose header declares width x height RGB pixels; its one IDAT
    holds the first rows only (a decoder that trusted it would allocate the whole canvas)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\x00" * (1 + 3 * width) * 4, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def body(state="A photo: " + PLACEHOLDER, assets=None, questions=None, **extra) -> dict:
    request = {
        "model": "jev-latest",
        "state": state,
        "questions": questions or {"red": {"type": "noul", "instructions": "Is the photo red?"}},
        **extra,
    }
    if assets is not None:
        request["assets"] = assets
    return request


def image_asset(data: bytes | None = None, fmt: str = "png") -> dict:
    return {"type": "image", "format": fmt, "data_base64": b64(png() if data is None else data)}


def multipart(request: dict, parts: dict[str, bytes], *, boundary: str = "b0undary") -> tuple[str, bytes]:
    """A multipart/form-data body laid out as RFC 7578 says, written here by hand."""
    out = []
    for name, content, kind in [
        ("request", json.dumps(request).encode(), "application/json"),
        *((n, c, "image/png") for n, c in parts.items()),
    ]:
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\nContent-Type: {kind}\r\n'
        out.append(head.encode() + b"\r\n" + content + b"\r\n")
    out.append(f"--{boundary}--\r\n".encode())
    return f"multipart/form-data; boundary={boundary}", b"".join(out)


def post(client, request: dict):
    return client.post("/v1/systemone", json=request)


def post_multipart(client, request: dict, parts: dict[str, bytes]):
    content_type, content = multipart(request, parts)
    return client.post("/v1/systemone", content=content, headers={"Content-Type": content_type})


def refused_validation(reply, loc: list) -> str:
    assert reply.status_code == 422, reply.text
    items = reply.json()["detail"]
    matching = [item for item in items if item["loc"] == loc]
    assert matching, f"no error at {loc}: {items}"
    return matching[0]["msg"]


def refused(reply, status: int, error_type: str) -> str:
    assert reply.status_code == status, reply.text
    detail = reply.json()["detail"]
    assert detail["error_type"] == error_type
    return detail["message"]


# -- no silent answers -------------------------------------------------------------------------------


def test_a_valid_image_in_the_state_is_refused_because_the_model_reads_no_images(client):
    for data in (png((255, 0, 0)), png((0, 0, 255))):
        message = refused(post(client, body(assets={PLACEHOLDER: image_asset(data)})), 400, "api_usage_error")
        assert NO_VISION in message and "placeholder text" in message


@pytest.mark.parametrize(
    "where",
    ["instructions", "criteria"],
)
def test_an_image_inside_an_instruction_or_a_criterion_is_refused_too(client, where):
    question = {
        "type": "noul",
        "instructions": "Is it red?",
        "criteria": {"true": "Red.", "false": "Not red."},
    }
    if where == "instructions":
        question["instructions"] = {"photo": PLACEHOLDER, "question": "Is it red?"}
    else:
        question["criteria"]["true"] = f"Looks like {PLACEHOLDER}."
    reply = post(client, body(state="text", assets={PLACEHOLDER: image_asset()}, questions={"q": question}))
    assert NO_VISION in refused(reply, 400, "api_usage_error")


def test_a_placeholder_in_a_choice_option_name_counts_as_a_reference(client):
    question = {"type": "choice", "criteria": {PLACEHOLDER: None, "none of these": None}}
    reply = post(client, body(state="text", assets={PLACEHOLDER: image_asset()}, questions={"q": question}))
    assert NO_VISION in refused(reply, 400, "api_usage_error")


def test_a_text_only_request_is_still_answered(client):
    reply = post(client, body(state="A plain sentence."))
    assert reply.status_code == 200, reply.text
    assert 0.0 <= reply.json()["answers"]["red"]["noul"] <= 1.0


# -- refusals naming the field -------------------------------------------------------------------------


def test_a_placeholder_without_any_assets_is_refused_where_it_stands(client):
    reply = post(client, body(state={"caption": "x", "photo": ["see", PLACEHOLDER]}))
    msg = refused_validation(reply, ["body", "state", "photo", 1])
    assert PLACEHOLDER in msg and "no asset" in msg


def test_a_placeholder_with_no_asset_among_other_assets_is_refused(client):
    reply = post(client, body(state=f"{PLACEHOLDER} and {OTHER}", assets={PLACEHOLDER: image_asset()}))
    assert OTHER in refused_validation(reply, ["body", "state"])


def test_an_asset_no_string_refers_to_is_refused(client):
    reply = post(client, body(state=PLACEHOLDER, assets={PLACEHOLDER: image_asset(), OTHER: image_asset()}))
    assert "refers to this asset" in refused_validation(reply, ["body", "assets", OTHER])


def test_an_empty_assets_map_is_refused(client):
    refused_validation(post(client, body(assets={})), ["body", "assets"])


@pytest.mark.parametrize(
    ("change", "loc_tail"),
    [
        ({"type": "video"}, ["type"]),
        ({"format": "gif"}, ["format"]),
        ({"data_base64": "not base64 at all!"}, ["data_base64"]),
        ({"data_base64": ""}, ["data_base64"]),
        ({"format": "jpeg"}, ["data_base64"]),  # the bytes are a PNG
        ({"data_base64": b64(b"GIF89a" + b"\x00" * 40)}, ["data_base64"]),
        ({"data_base64": b64(png()[:40])}, ["data_base64"]),  # a PNG cut after its header
    ],
)
def test_an_asset_that_is_not_a_png_or_jpeg_image_it_claims_to_be_is_refused(client, change, loc_tail):
    asset = {**image_asset(), **change}
    refused_validation(
        post(client, body(assets={PLACEHOLDER: asset})), ["body", "assets", PLACEHOLDER, *loc_tail]
    )


@pytest.mark.parametrize("size", [(2, 401), (1000, 4), (1, 201)])
def test_an_image_whose_long_side_is_over_200_times_its_short_one_is_refused_naming_the_asset(client, size):
    asset = image_asset(png(size=size))
    message = refused_validation(
        post(client, body(assets={PLACEHOLDER: asset})), ["body", "assets", PLACEHOLDER, "data_base64"]
    )
    assert f"{size[0]} x {size[1]}" in message and "200 times" in message


def test_an_image_at_the_aspect_limit_is_read(client):
    reply = post(client, body(assets={PLACEHOLDER: image_asset(png(size=(1, 200)))}))
    assert NO_VISION in refused(reply, 400, "api_usage_error")  # past every image rule


def progressive_jpeg(scans_repeated: int = 0) -> bytes:
    """A real progressive JPEG (Pillow writes about ten scans), its last scan repeated."""
    out = io.BytesIO()
    PILImage.new("RGB", (64, 48), (10, 200, 30)).save(out, format="JPEG", progressive=True)
    data = out.getvalue()
    last = data.rindex(b"\xff\xda")
    return data[:-2] + data[last:-2] * scans_repeated + b"\xff\xd9"


def test_a_progressive_jpeg_is_read_and_one_of_over_a_hundred_scans_is_refused(client):
    assert 2 < progressive_jpeg().count(b"\xff\xda") < 20
    read = post(client, body(assets={PLACEHOLDER: image_asset(progressive_jpeg(), "jpeg")}))
    assert NO_VISION in refused(read, 400, "api_usage_error")
    many = progressive_jpeg(100)
    PILImage.open(io.BytesIO(many)).load()  # Pillow itself would decode every scan
    message = refused_validation(
        post(client, body(assets={PLACEHOLDER: image_asset(many, "jpeg")})),
        ["body", "assets", PLACEHOLDER, "data_base64"],
    )
    assert "scans" in message and "100" in message


def test_a_multi_picture_jpeg_is_read_as_a_jpeg():
    first = io.BytesIO()
    PILImage.new("RGB", (16, 16), (200, 0, 0)).save(
        first, format="MPO", save_all=True, append_images=[PILImage.new("RGB", (16, 16), (0, 0, 200))]
    )
    assert PILImage.open(io.BytesIO(first.getvalue())).format == "MPO"
    image = read_image(PLACEHOLDER, first.getvalue(), claimed="jpg", max_pixels=10**6)
    assert (image.format, image.width, image.height) == ("jpeg", 16, 16)


def test_an_asset_with_neither_bytes_nor_a_part_or_without_format_is_refused(client):
    for asset in ({"type": "image", "format": "png"}, {"type": "image", "data_base64": b64(png())}):
        refused_validation(post(client, body(assets={PLACEHOLDER: asset})), ["body", "assets", PLACEHOLDER])


def test_jpg_and_jpeg_name_one_format(client):
    for fmt in ("jpg", "jpeg"):
        reply = post(client, body(assets={PLACEHOLDER: image_asset(jpeg(), fmt)}))
        assert NO_VISION in refused(reply, 400, "api_usage_error")


def test_a_part_asset_in_a_json_body_is_refused(client):
    reply = post(client, body(assets={PLACEHOLDER: {"type": "image", "part": "asset-0"}}))
    assert "multipart" in refused_validation(reply, ["body", "assets", PLACEHOLDER, "part"])


def test_a_box_question_without_an_image_is_refused_naming_the_question(client):
    reply = post(client, body(state="text", questions={"where": {"type": "box", "instructions": "the dog"}}))
    assert "image" in refused_validation(reply, ["body", "questions", "where"])


def test_a_box_question_about_an_image_is_refused_because_the_model_reads_no_images(client):
    questions = {"where": {"type": "box", "instructions": "the red square"}}
    reply = post(client, body(assets={PLACEHOLDER: image_asset()}, questions=questions))
    assert NO_VISION in refused(reply, 400, "api_usage_error")


# -- multipart, as the SDK sends it ----------------------------------------------------------------------


def part_body(**parts) -> dict:
    return body(assets={PLACEHOLDER: {"type": "image", **parts}})


def test_a_multipart_image_reaches_the_same_refusal_as_its_base64_twin(client):
    reply = post_multipart(client, part_body(part="asset-0"), {"asset-0": png()})
    assert NO_VISION in refused(reply, 400, "api_usage_error")


def test_a_multipart_part_that_is_missing_or_claimed_twice_is_refused(client):
    missing = post_multipart(client, part_body(part="asset-7"), {"asset-0": png()})
    refused_validation(missing, ["body", "assets", PLACEHOLDER, "part"])
    twice = body(
        state=f"{PLACEHOLDER} {OTHER}",
        assets={
            PLACEHOLDER: {"type": "image", "part": "asset-0"},
            OTHER: {"type": "image", "part": "asset-0"},
        },
    )
    assert "already claimed" in refused_validation(
        post_multipart(client, twice, {"asset-0": png()}), ["body", "assets", OTHER, "part"]
    )


def test_a_multipart_part_no_asset_claims_is_refused(client):
    reply = post_multipart(client, part_body(part="asset-0"), {"asset-0": png(), "asset-1": png()})
    assert "asset-1" in refused_validation(reply, ["body"])


def test_a_multipart_part_whose_bytes_are_not_an_image_or_not_its_format_is_refused(client):
    reply = post_multipart(client, part_body(part="asset-0"), {"asset-0": b"plain text"})
    refused_validation(reply, ["body", "assets", PLACEHOLDER, "part"])
    reply = post_multipart(client, part_body(part="asset-0", format="jpeg"), {"asset-0": png()})
    refused_validation(reply, ["body", "assets", PLACEHOLDER, "part"])


def test_a_malformed_multipart_body_is_a_422_on_the_body(client):
    for content_type, content in (
        ("multipart/form-data", b"--x\r\n"),  # no boundary
        (
            "multipart/form-data; boundary=x",
            b'--x\r\nContent-Disposition: form-data; name="request"\r\n\r\n{',
        ),
        ("multipart/form-data; boundary=x", b"--x--\r\n"),  # no request part
    ):
        reply = client.post("/v1/systemone", content=content, headers={"Content-Type": content_type})
        refused_validation(reply, ["body"])


def test_the_multipart_parser_reads_parts_by_name_byte_for_byte():
    image = png() + b"\r\n--not-the-boundary\r\n"
    content_type, content = multipart({"a": 1}, {"asset-0": image})
    parsed = parse_multipart(content_type, content)
    assert json.loads(parsed.request) == {"a": 1} and parsed.parts == {"asset-0": image}
    with pytest.raises(MultipartRefused, match="two parts"):
        parse_multipart(content_type, content.replace(b'name="asset-0"', b'name="request"'))


# -- limits ------------------------------------------------------------------------------------------------


def test_a_png_declaring_ten_billion_pixels_is_refused_from_its_header_without_inflating(client):
    bomb = png_declaring(100_000, 100_000)
    assert len(bomb) < 4096
    message = refused(post(client, body(assets={PLACEHOLDER: image_asset(bomb)})), 413, "request_too_large")
    assert "pixels" in message and PLACEHOLDER in message
    tracemalloc.start()
    with pytest.raises(ImageRejected) as caught:
        read_image(PLACEHOLDER, bomb, claimed="png", max_pixels=16_777_216)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert caught.value.too_large and peak < 1_000_000  # a decoded canvas would be 30 GB


def test_a_png_over_the_pixel_setting_is_refused_and_one_under_it_is_read():
    image = png(size=(40, 30))
    with pytest.raises(ImageRejected, match="40 x 30 = 1200 pixels"):
        read_image(PLACEHOLDER, image, claimed=None, max_pixels=1199)
    read = read_image(PLACEHOLDER, image, claimed=None, max_pixels=1200)
    assert (read.format, read.width, read.height) == ("png", 40, 30)


@pytest.fixture(scope="module")
def tight(engine, checkpoint):
    """A service with small image limits (two images, 64 pixels, 2000 image bytes, 1000-byte JSON)."""
    settings = make_settings(
        checkpoint,
        systemone_max_images=2,
        systemone_max_image_pixels=64,
        systemone_max_image_bytes=2000,
        max_body_bytes=1500,
    )
    app = create_app(Service.start(settings, engine=engine))
    with LoopbackServer(app) as running:
        yield running


def raw_post(server, **kw):
    return httpx.post(
        f"{server.url}/v1/systemone",
        headers={"Authorization": f"Bearer {TOKEN}", **kw.pop("headers", {})},
        **kw,
    )


def test_more_images_than_the_setting_allows_is_a_413_naming_assets(tight):
    names = [f"<image:{i:032x}>" for i in range(3)]
    request = body(state=" ".join(names), assets={n: image_asset(png(size=(2, 2))) for n in names})
    message = refused(raw_post(tight, json=request), 413, "request_too_large")
    assert "3 images" in message and "SEMIF_SYSTEMONE_MAX_IMAGES" in message


def test_a_multipart_body_of_more_parts_than_a_request_and_its_images_is_a_413_before_reading_on(client):
    parts = {f"p{i}": b"" for i in range(5000)}
    content_type, content = multipart(part_body(part="p0"), parts)
    reply = client.post("/v1/systemone", content=content, headers={"Content-Type": content_type})
    message = refused(reply, 413, "request_too_large")
    assert "more than 10 parts" in message and "SEMIF_SYSTEMONE_MAX_IMAGES" in message
    assert len(reply.content) < 1000  # one short refusal, not an error per part


def test_an_image_over_the_pixel_setting_is_a_413(tight):
    request = body(assets={PLACEHOLDER: image_asset(png(size=(9, 8)))})
    assert "72 pixels" in refused(raw_post(tight, json=request), 413, "request_too_large")


def padded_png(total: int) -> bytes:
    """An 8 x 8 PNG padded to about `total` bytes with a text chunk (still a valid PNG)."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("note", "x" * max(0, total - len(png())))
    out = io.BytesIO()
    PILImage.new("RGB", (8, 8), (255, 0, 0)).save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def test_image_bytes_have_their_own_limit_beside_the_body_limit(tight):
    image = padded_png(1700)
    content_type, content = multipart(part_body(part="asset-0"), {"asset-0": image})
    assert 1500 < len(content) < 3500 and len(image) < 2000
    # Over the JSON body limit, under it plus the image limit: admitted, and read as an image.
    reply = raw_post(tight, content=content, headers={"Content-Type": content_type})
    assert NO_VISION in refused(reply, 400, "api_usage_error")
    content_type, content = multipart(part_body(part="asset-0"), {"asset-0": padded_png(2100)})
    reply = raw_post(tight, content=content, headers={"Content-Type": content_type})
    assert "SEMIF_SYSTEMONE_MAX_IMAGE_BYTES" in refused(reply, 413, "request_too_large")


def test_a_base64_image_past_the_image_byte_limit_is_a_413(tight):
    request = body(assets={PLACEHOLDER: image_asset(padded_png(2100))})
    content = json.dumps(request).encode()
    reply = raw_post(tight, content=content, headers={"Content-Type": "application/json"})
    # As JSON it passes the 1500-byte body limit first: base64 travels under the JSON body limit.
    assert "1500 bytes" in refused(reply, 413, "request_too_large")


def test_a_multipart_body_past_the_body_and_image_limits_together_is_refused_by_admission(tight):
    content_type, content = multipart(part_body(part="asset-0"), {"asset-0": b"\x00" * 4000})
    message = refused(
        raw_post(tight, content=content, headers={"Content-Type": content_type}), 413, "request_too_large"
    )
    assert "3500 bytes" in message


def test_a_json_body_on_system_one_keeps_the_json_body_limit(tight):
    request = body(state="x" * 2000)
    message = refused(raw_post(tight, json=request), 413, "request_too_large")
    assert "1500 bytes" in message


# -- what the service says about images ---------------------------------------------------------------------


def test_models_and_health_say_the_model_reads_no_images_and_give_the_limits(client, service):
    (real, *_) = client.get("/v1/models").json()["models"]
    settings = service.settings
    assert real["x_reads_images"] is False
    assert real["x_max_images"] == settings.systemone_max_images == 8
    assert real["x_max_image_pixels"] == settings.systemone_max_image_pixels
    assert real["x_max_image_bytes"] == settings.systemone_max_image_bytes
    images = client.get("/health").json()["images"]
    assert images == {
        "reads_images": False,
        "max_images": 8,
        "max_image_pixels": settings.systemone_max_image_pixels,
        "max_image_bytes": settings.systemone_max_image_bytes,
    }


# -- the official SDK --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(service):
    with LoopbackServer(create_app(service)) as running:
        yield running


def photo(side: int) -> bytes:
    """An incompressible PNG (random pixels) of side x side."""
    import random

    rng = random.Random(side)
    image = PILImage.frombytes("RGB", (side, side), bytes(rng.getrandbits(8) for _ in range(side * side * 3)))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize("where", ["state", "instructions", "criteria", "box"])
def test_the_sdk_sends_an_image_as_multipart_and_gets_the_no_vision_refusal(server, where):
    image = Image(png())
    state: object = "A photo."
    questions: dict = {"q": Noul(instructions="Is it red?")}
    if where == "state":
        state = {"photo": image, "caption": "a square"}
    elif where == "instructions":
        questions = {"q": Noul(instructions=f"Is {image} red?")}
    elif where == "criteria":
        questions = {
            "q": Choice(instructions="Which colour?", criteria={"red": f"like {image}", "blue": None})
        }
    else:
        state = image
        questions = {"q": Box(instructions="the square")}
    with TypeSafeClient(api_key=TOKEN, base_url=server.url) as client, client.attach_assets(image):
        with pytest.raises(TypeSafeBadRequestError, match=NO_VISION):
            client.system_one(state=state, questions=questions)


def test_an_image_the_sdk_does_not_know_is_refused_as_a_placeholder_without_an_asset(server):
    image = Image(png())
    with TypeSafeClient(api_key=TOKEN, base_url=server.url) as client:
        with pytest.raises(TypeSafeUnprocessableEntityError, match="questions.q.instructions"):
            client.system_one(state="A photo.", questions={"q": Noul(instructions=f"Is {image} red?")})


def test_the_sdk_sends_a_photo_of_one_and_a_half_megabytes_past_the_json_body_limit(server, service):
    data = photo(720)
    assert 1_400_000 < len(data) and len(data) > service.settings.max_body_bytes
    sent: list[httpx2.Request] = []
    http = httpx2.Client(timeout=120, event_hooks={"request": [sent.append]})
    with TypeSafeClient(api_key=TOKEN, base_url=server.url, http_client=http) as client:
        with pytest.raises(TypeSafeBadRequestError, match=NO_VISION):
            client.system_one(state=Image(data), questions={"q": Noul(instructions="Is it red?")})
    (request,) = sent
    assert request.headers["content-type"].startswith("multipart/form-data; boundary=")
    assert request.headers["content-encoding"] == "zstd"


# -- nothing about images gets a 5xx ------------------------------------------------------------------------


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=300), cut=st.integers(min_value=0, max_value=400))
def test_arbitrary_image_bytes_or_a_cut_multipart_body_get_a_4xx(client, data, cut):
    real = png()
    image = real[:cut] + data if cut < len(real) else data
    reply = post(client, body(assets={PLACEHOLDER: image_asset(image)}))
    assert 400 <= reply.status_code < 500, reply.text
    content_type, content = multipart(part_body(part="asset-0"), {"asset-0": image})
    reply = client.post("/v1/systemone", content=content[:cut] + data, headers={"Content-Type": content_type})
    assert 400 <= reply.status_code < 500, reply.text
