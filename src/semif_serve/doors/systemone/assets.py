"""System One's `assets`: every image of a request resolved, checked and tied to its placeholders.

An asset is an image given as base64 (`data_base64` + `format`) or as a multipart part
(`part`). Every placeholder must be used by some string of the state, of an instruction or
of the criteria (a key or a value, at any depth), every `<image:...>` placeholder in those
strings must have an asset, every part is claimed by exactly one asset, and a box question
needs an image. Counts, bytes and pixels are checked before anything is decoded. Broken
rules are 422s in FastAPI's `detail[]` shape naming the field; limits passed are 413s.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from semif_serve.domain.echo import quoted
from semif_serve.domain.images import ImageAsset, ImageRejected, VerifiedImages, read_image
from semif_serve.doors.systemone.schemas import (
    AssetEntry,
    BoxQuestion,
    ChoiceQuestion,
    NoulQuestion,
    ScoreQuestion,
    SystemOneRequest,
    SystemOneValidationError,
)
from semif_serve.http.errors import ServiceError

# The SDK's placeholders are `<image:{uuid4 hex}>`; any `<image:...>` a string holds must be an asset.
PLACEHOLDER = re.compile(r"<image:[^<>\s]{1,256}>")
Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class ImageLimits:
    """The operator's bounds on a request's images."""

    max_images: int
    max_image_pixels: int
    max_image_bytes: int


def texts(request: SystemOneRequest) -> Iterator[tuple[Loc, str]]:
    """Every string the model reads (keys and values, at any depth) with where it sits: a
    choice option's name only where its description is null (the name is then what is read)."""
    yield from _strings(request.state, ("body", "state"))
    for qid, question in request.questions.items():
        where: Loc = ("body", "questions", qid)
        if question.instructions is not None:
            yield from _strings(question.instructions, (*where, "instructions"))
        if isinstance(question, NoulQuestion) and question.criteria is not None:
            for side in ("true", "false"):
                value = getattr(question.criteria, side)
                if value is not None:
                    yield from _strings(value, (*where, "criteria", side))
        elif isinstance(question, ChoiceQuestion):
            for name, description in question.criteria.items():
                if description is None:
                    yield (*where, "criteria", name), name
                else:
                    yield from _strings(description, (*where, "criteria", name))
        elif isinstance(question, ScoreQuestion):
            yield from _strings(question.criteria, (*where, "criteria"))


def _strings(value: Any, loc: Loc) -> Iterator[tuple[Loc, str]]:
    if isinstance(value, str):
        yield loc, value
    elif isinstance(value, dict):
        for key, child in value.items():
            yield (*loc, key), key
            yield from _strings(child, (*loc, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _strings(child, (*loc, i))


def _error(loc: Loc, msg: str, kind: str = "value_error") -> dict[str, Any]:
    return {"loc": list(loc), "msg": msg, "type": kind}


def _too_large(field: str, message: str) -> ServiceError:
    return ServiceError(413, "request_too_large", f"{field}: {message}", field)


def placeholders(names: Iterable[str]) -> re.Pattern[str] | None:
    """One pattern for a request's asset keys, a longer key first (one that holds another wins)."""
    ordered = sorted(names, key=len, reverse=True)
    return re.compile("|".join(re.escape(n) for n in ordered)) if ordered else None


def check_references(request: SystemOneRequest) -> list[dict[str, Any]]:
    """The broken reference rules: placeholders without an asset, assets no string the model
    reads uses (an asset's key counts where it is found as the images are placed: inside a
    longer asset's key it is not), box questions without an image."""
    assets = request.assets or {}
    errors: list[dict[str, Any]] = []
    used: set[str] = set()
    pattern = placeholders(assets)
    for loc, text in texts(request):
        if pattern is not None:
            used.update(match[0] for match in pattern.finditer(text))
        for match in PLACEHOLDER.finditer(text):
            if match[0] not in assets:
                errors.append(_error(loc, f"the placeholder {quoted(match[0])} has no asset in `assets`"))
    for name in assets:
        if name not in used:
            errors.append(
                _error(
                    ("body", "assets", name),
                    "no string the model reads (the state, the instructions, the criteria; a "
                    "choice option's name only where its description is null) refers to this "
                    "asset outside another asset's key",
                )
            )
    if not assets:
        for qid, question in request.questions.items():
            if isinstance(question, BoxQuestion):
                errors.append(
                    _error(
                        ("body", "questions", qid),
                        "a box question locates something in an image; this request has no image asset",
                    )
                )
    return errors


def _claimed_bytes(
    request: SystemOneRequest, parts: dict[str, bytes] | None
) -> tuple[dict[str, bytes | str], list[dict[str, Any]]]:
    """Each asset's source (its part's bytes, or its base64 text) and the broken part rules."""
    errors: list[dict[str, Any]] = []
    sources: dict[str, bytes | str] = {}
    claimed: dict[str, str] = {}
    for name, entry in (request.assets or {}).items():
        where = ("body", "assets", name, "part")
        if entry.part is None:
            sources[name] = entry.data_base64 or ""
        elif parts is None:
            errors.append(
                _error(where, "a JSON body has no parts: send `part` assets as multipart/form-data")
            )
        elif entry.part not in parts:
            errors.append(_error(where, f"the body has no part named {quoted(entry.part)}"))
        elif entry.part in claimed:
            errors.append(
                _error(
                    where,
                    f"the part {quoted(entry.part)} is already claimed by {quoted(claimed[entry.part])}",
                )
            )
        else:
            claimed[entry.part] = name
            sources[name] = parts[entry.part]
    for part in parts or {}:
        if part not in claimed:
            errors.append(_error(("body",), f"the multipart part {quoted(part)} is claimed by no asset"))
    return sources, errors


def resolve_images(
    request: SystemOneRequest,
    parts: dict[str, bytes] | None,
    limits: ImageLimits,
    verified: VerifiedImages | None = None,
) -> list[ImageAsset]:
    """Every image of the request, checked, in `assets` order (empty without assets); each
    decoded whole unless `verified` holds its digest.

    Raises SystemOneValidationError (422) for a broken rule and a 413 ServiceError for a
    limit passed, before any image is decoded past its header.
    """
    errors = check_references(request)
    sources, part_errors = _claimed_bytes(request, parts)
    errors += part_errors
    if errors:
        raise SystemOneValidationError(errors)
    assets = request.assets or {}
    if len(assets) > limits.max_images:
        raise _too_large(
            "assets",
            f"{len(assets)} images, over SEMIF_SYSTEMONE_MAX_IMAGES ({limits.max_images})",
        )
    # Base64 is 4 characters per 3 bytes: bound the decoded size before decoding anything.
    estimated = sum(len(s) if isinstance(s, bytes) else len(s) * 3 // 4 for s in sources.values())
    if estimated > limits.max_image_bytes + 2 * len(sources):
        raise _too_large("assets", _bytes_over(estimated, limits.max_image_bytes))
    decoded = {name: _decoded(name, source) for name, source in sources.items()}
    total = sum(len(data) for data in decoded.values())
    if total > limits.max_image_bytes:
        raise _too_large("assets", _bytes_over(total, limits.max_image_bytes))
    images = []
    for name, data in decoded.items():
        images.append(_read(name, assets[name], data, limits.max_image_pixels, verified))
    return images


def _bytes_over(total: int, limit: int) -> str:
    return f"the images are {total} bytes, over SEMIF_SYSTEMONE_MAX_IMAGE_BYTES ({limit})"


def _decoded(name: str, source: bytes | str) -> bytes:
    if isinstance(source, bytes):
        return source
    try:
        return base64.b64decode("".join(source.split()), validate=True)
    except (binascii.Error, ValueError):
        raise SystemOneValidationError(
            [_error(("body", "assets", name, "data_base64"), "`data_base64` is not valid base64")]
        ) from None


def _read(
    name: str, entry: AssetEntry, data: bytes, max_pixels: int, verified: VerifiedImages | None
) -> ImageAsset:
    field = "data_base64" if entry.part is None else "part"
    try:
        return read_image(name, data, claimed=entry.format, max_pixels=max_pixels, verified=verified)
    except ImageRejected as exc:
        if exc.too_large:
            raise _too_large(
                f"assets[{name!r}]", f"{exc.message} (SEMIF_SYSTEMONE_MAX_IMAGE_PIXELS)"
            ) from None
        raise SystemOneValidationError([_error(("body", "assets", name, field), exc.message)]) from None


def shown(image: ImageAsset, index: int) -> str:
    """How an image stands in the rendered prompt: a slot that names it by position and digest
    (no character JSON escapes, so it reads the same at any depth of structured text, and the
    SDK's random placeholders never change the prompt)."""
    return f"<image:{index}:{image.sha256}>"


def place_images(
    request: SystemOneRequest, images: Sequence[ImageAsset]
) -> tuple[SystemOneRequest, list[ImageAsset]]:
    """The request with every asset key, where it appears in a string the model reads, replaced
    by its image's slot (`shown`), and the images renamed to their slots for the engine. Nothing
    else of the prompt (the service's own text) is touched."""
    if not images:
        return request, []
    slots = {image.placeholder: shown(image, i) for i, image in enumerate(images)}
    pattern = placeholders(slots)
    assert pattern is not None

    def swap(value: Any) -> Any:
        if isinstance(value, str):
            return pattern.sub(lambda m: slots[m[0]], value)
        if isinstance(value, dict):
            return {swap(k): swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        return value

    questions: dict[str, Any] = {}
    for qid, question in request.questions.items():
        update: dict[str, Any] = {}
        if question.instructions is not None:
            update["instructions"] = swap(question.instructions)
        if isinstance(question, NoulQuestion) and question.criteria is not None:
            update["criteria"] = question.criteria.model_copy(
                update={side: swap(getattr(question.criteria, side)) for side in ("true", "false")}
            )
        elif isinstance(question, ChoiceQuestion):
            # The name stays the option's id; a null description reads the name, so it gets the slot.
            update["criteria"] = {
                name: swap(name if description is None else description)
                for name, description in question.criteria.items()
            }
        elif isinstance(question, ScoreQuestion):
            update["criteria"] = swap(question.criteria)
        questions[qid] = question.model_copy(update=update)
    placed = request.model_copy(update={"state": swap(request.state), "questions": questions})
    renamed = [dataclasses.replace(image, placeholder=slots[image.placeholder]) for image in images]
    return placed, renamed
