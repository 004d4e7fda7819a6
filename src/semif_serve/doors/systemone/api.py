"""The System One door: `POST /v1/systemone` and `GET /v1/models`, TypeSafe's wire format.

Map each typed question (noul, choice, score; a box as its four edge questions) onto the
decision core's options, ask every question of a request (in every ordering) as one shared
batch, and map the outcome back to System One answers, or a domain error through
`SYSTEMONE_ERRORS`, the one table of this door. Every error on these paths, whoever raises it
(admission, routing, the door), is rendered by `SystemOneDoor.render` in TypeSafe's shapes.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request, Security
from fastapi.responses import JSONResponse, Response

from semif_serve import __version__
from semif_serve.domain import types as domain
from semif_serve.domain.echo import quoted
from semif_serve.domain.images import VerifiedImages
from semif_serve.domain.requests import DecisionRequest, Limits
from semif_serve.domain.types import Question
from semif_serve.doors.base import (
    BEARER,
    DecisionDoor,
    json_reply,
)
from semif_serve.doors.systemone.assets import ImageLimits, place_images, resolve_images
from semif_serve.doors.systemone.errors import (
    NO_VISION,
    PUBLISHED_ERRORS,
    SYSTEMONE_ERRORS,
    UNKNOWN_MODEL,
    error_reply,
)
from semif_serve.doors.systemone.lev import answer_lev, lev_listing
from semif_serve.doors.systemone.mapping import (
    Policy,
    answers_of,
    core_questions,
    evaluated_tokens,
    rows_asked,
    timing_block,
)
from semif_serve.doors.systemone.multipart import (
    MultipartRefused,
    TooManyParts,
    is_multipart,
    parse_multipart,
)
from semif_serve.doors.systemone.schemas import (
    MAX_OPTIONS,
    MODELS_PATH,
    SYSTEMONE_PATH,
    AdapterInfo,
    ModelEntry,
    ModelList,
    SystemOneRequest,
    SystemOneResponse,
    SystemOneValidationError,
    Usage,
    parse_request,
)
from semif_serve.doors.systemone.sizes import reply_bytes
from semif_serve.http.errors import ServiceError
from semif_serve.http.headers import headers_of
from semif_serve.service.models import LEV, SEMIF
from semif_serve.service.models import ModelEntry as ServedModel
from semif_serve.service.startup import Service


def release_date(service: Service) -> str:
    """SEMIF_MODEL_RELEASE_DATE, else the day (UTC) the checkpoint's config.json was written."""
    settings = service.settings
    if settings.model_release_date is not None:
        return settings.model_release_date.isoformat()
    config = settings.require_model() / "config.json"
    return datetime.fromtimestamp(config.stat().st_mtime, UTC).date().isoformat()


class SystemOneDoor(DecisionDoor):
    """TypeSafe's System One over the decision core."""

    path_prefix = "/v1/"
    protected_paths = frozenset({SYSTEMONE_PATH, MODELS_PATH})
    request_models = (SystemOneRequest,)
    errors = SYSTEMONE_ERRORS
    names_question = True  # a refusal's message names the question by its id
    request_id_headers = (b"x-typesafe-request-id",)  # what TypeSafe's SDKs read

    def __init__(self, service: Service) -> None:
        super().__init__(service)
        settings = service.settings
        self.policy = Policy(settings.systemone_orderings, settings.systemone_workloads)
        identity = service.core.identity
        self.model_name = f"{identity.source}@{identity.revision}"
        self.max_options = min(MAX_OPTIONS, service.core.capacity)
        # Facts of the loaded model and the settings, computed once at startup.
        self.release_date = release_date(service)
        allow = settings.systemone_allow_aliases  # the Jev names, unless SEMIF_MODELS declares them
        self.aliases = tuple(
            name for name in service.models.aliases if service.models.resolve(name, jev_aliases=allow)
        )
        self.limits = Limits(
            settings.systemone_max_input_tokens,
            self.max_options,
            settings.systemone_max_rows,
            settings.systemone_max_request_tokens,
            settings.max_reply_bytes,
        )
        self.image_limits = ImageLimits(
            settings.systemone_max_images,
            settings.systemone_max_image_pixels,
            settings.systemone_max_image_bytes,
        )
        self.verified_images = VerifiedImages()  # decoded whole once: a cached image is not decoded again

    def refuse_past_row_cap(self, data: dict[str, Any]) -> None:
        """Refuse (413) a decoded request whose questions already ask for more rows than the cap,
        counted from the JSON before it is validated or mapped: milliseconds, whatever it holds."""
        if self.lev_entry(data.get("model")) is not None:
            return  # a lev model's rows are its own orders, counted from its plan (lev_core.py)
        rows = rows_asked(data, self.policy)
        limit = self.service.settings.systemone_max_rows
        if rows > limit:
            exc = domain.TooManyRows(rows, limit)
            raise self.refusal(exc, True, ())

    def lev_entry(self, model: object) -> ServedModel | None:
        """The lev model (method "lev") a request naming `model` reads, or None."""
        entry = self.served(model) if isinstance(model, str) else None
        return entry if entry is not None and entry.method == LEV else None

    def body_limit(self, path: str, content_type: str | None, default: int) -> int:
        """A multipart body on `/v1/systemone` may carry SEMIF_SYSTEMONE_MAX_IMAGE_BYTES of images
        beside a JSON request part of at most the JSON body limit."""
        if path == SYSTEMONE_PATH and is_multipart(content_type):
            return default + self.service.settings.systemone_max_image_bytes
        return default

    def parse(
        self, content_type: str | None, body: bytes
    ) -> tuple[SystemOneRequest, dict[str, bytes] | None]:
        """The validated request and, for a multipart body, its parts by name (None for JSON);
        run off the event loop."""
        if not is_multipart(content_type):
            return parse_request(body, self.max_options, self.refuse_past_row_cap), None
        try:
            # The `request` part, one per image allowed, and one more: an image over the count
            # gets the image-count 413 below, with the request read.
            multipart = parse_multipart(content_type or "", body, self.image_limits.max_images + 2)
        except TooManyParts as exc:
            raise ServiceError(
                413, "request_too_large", f"{exc} (a `request` part and SEMIF_SYSTEMONE_MAX_IMAGES images)"
            ) from None
        except MultipartRefused as exc:
            raise SystemOneValidationError(
                [{"loc": ["body"], "msg": str(exc), "type": "value_error"}]
            ) from None
        limit = self.service.settings.max_body_bytes
        if len(multipart.request) > limit:
            raise ServiceError(
                413,
                "request_too_large",
                f"the `request` part is {len(multipart.request)} bytes, over SEMIF_MAX_BODY_BYTES ({limit})",
            )
        return parse_request(multipart.request, self.max_options, self.refuse_past_row_cap), multipart.parts

    def mapped(self, parsed: SystemOneRequest, model: str) -> tuple[list[tuple[Question, ...]], int]:
        """The core questions each question is asked as, and the count of the reply naming
        `model`; run off the event loop (both are linear in the request's text)."""
        asked = [core_questions(qid, q, self.policy) for qid, q in parsed.questions.items()]
        return asked, reply_bytes(parsed.questions, asked, model)

    def served(self, model: str) -> ServedModel | None:
        """The served model a request naming `model` reads (a model's name, or an alias when
        allowed; the base's real name too), or None when unknown."""
        if model == self.model_name:
            return self.service.models.models[self.service.models.base]
        if model in self.aliases:
            return self.service.models.resolve(model)
        entry = self.service.models.models.get(model)
        return entry if entry is not None and not entry.is_base else None

    def render(self, error: ServiceError, request: Request) -> Response:
        """Any error on `/v1/...` in TypeSafe's shapes (errors.py); the request id headers are
        stamped by the request context."""
        return error_reply(error)

    def models(self) -> ModelList:
        """`GET /v1/models`: the loaded model's real identity first, then the aliases it answers."""
        identity = self.service.core.identity
        demo = " Random demo weights: the answers carry no meaning." if identity.demo else ""
        real = ModelEntry(
            name=self.model_name,
            description=(
                f"{identity.source} at revision {identity.revision} ({identity.dtype}), read by SemIf's "
                f"option-logit readout in one forward pass (semif-serve {__version__}); up to "
                f"{self.max_options} options.{demo}"
            ),
            release_date=self.release_date,
            x_source=identity.source,
            x_revision=identity.revision,
            x_max_options=self.max_options,
            x_answer_codes=self.service.core.capacity,
            x_max_input_tokens=self.service.settings.systemone_max_input_tokens,
            x_reads_images=self.service.core.reads_images,
            x_max_images=self.image_limits.max_images,
            x_max_image_pixels=self.image_limits.max_image_pixels,
            x_max_image_bytes=self.image_limits.max_image_bytes,
        )
        real.x_method = SEMIF
        real.x_calibration = self.service.core.calibration.workloads_of(None)
        over = [self.model_over_base(entry) for entry in self.service.models.adapters]
        aliases = []
        for alias in self.aliases:
            target = self.service.models.resolve(alias)
            name = self.model_name if target is None or target.is_base else target.name
            aliases.append(
                ModelEntry(
                    name=alias,
                    description=f"Alias of {name}.",
                    release_date=self.release_date,
                    x_alias_of=name,
                )
            )
        return ModelList(models=[real, *over, *aliases])

    def model_over_base(self, entry: ServedModel) -> ModelEntry:
        """`/v1/models`' entry of a model over the base: its method, adapter, scale, calibration."""
        if entry.lev_base:  # the base read with lev's method: no adapter
            release = self.service.lev.release(entry.name)
            return lev_listing(release, None, entry.name, self.model_name, self.release_date)
        bank = self.service.engine.adapters
        served = bank.adapters[bank.index(entry.name)]
        adapter = AdapterInfo(
            name=served.weights.directory.name,
            rank=served.weights.rank,
            modules=len(served.weights.modules),
            factor=served.scale,
        )
        if entry.method == LEV:  # a lev release: its own listing (lev.py)
            release = self.service.lev.release(entry.name)
            return lev_listing(release, adapter, entry.name, self.model_name, self.release_date)
        listed = ModelEntry(
            name=entry.name,
            description=f"{entry.name}: a LoRA adapter over {self.model_name}, read by SemIf's "
            "option-logit readout in the same forwards as the base.",
            release_date=self.release_date,
            x_method=entry.method,
            x_max_options=self.max_options,
            x_reads_images=self.service.core.reads_images,
            x_calibration=self.service.core.calibration.workloads_of(entry.name),
        )
        listed.x_adapter = adapter
        listed.x_scale = served.multiplier
        return listed

    async def answer(self, request: Request, body: bytes) -> SystemOneResponse:
        """`POST /v1/systemone`: every question (and ordering) over the state in one batch."""
        content_type = headers_of(request.scope).media_type  # the one Content-Type admission bounded
        parsed, parts = await asyncio.to_thread(self.parse, content_type, body)
        # A lev model (method "lev") is answered by lev's method, on its own path (lev.py).
        if (entry := self.lev_entry(parsed.model)) is not None:
            return await answer_lev(self.service, request, parsed, entry, self.limits)
        if parsed.assets:  # decoding images is CPU work: off the event loop
            images = await asyncio.to_thread(
                resolve_images, parsed, parts, self.image_limits, self.verified_images
            )
        else:  # only the placeholder and part checks: no thread hop for a text-only request
            images = resolve_images(parsed, parts, self.image_limits)
        entry = self.served(parsed.model)
        if entry is None:
            aliases = f" (aliases: {', '.join(self.aliases)})" if self.aliases else ""
            over = [e.name for e in self.service.models.adapters]
            names = ", ".join(repr(n) for n in [self.model_name, *over])
            raise ServiceError(
                UNKNOWN_MODEL.status,
                UNKNOWN_MODEL.code,
                f"unknown model {quoted(parsed.model)}; this server serves {names}{aliases}",
            )
        adapter = None if entry.is_base else entry.name
        reply_model = adapter or self.model_name
        if images and not self.service.core.reads_images:
            raise ServiceError(
                NO_VISION.status,
                NO_VISION.code,
                f"the loaded model {self.model_name!r} does not read images: its checkpoint has no "
                "vision tower, so a request with `assets` is refused rather than answered from "
                "the placeholder text",
                "assets",
            )
        parsed, images = place_images(parsed, images)
        asked, need = await asyncio.to_thread(self.mapped, parsed, reply_model)
        questions = [question for own in asked for question in own]
        # One row runs like /decide's (the plain forward or a cached state); several share one prefill.
        call = DecisionRequest(
            parsed.state,
            tuple(questions),
            shared=False,
            limits=self.limits,
            images=tuple(images),
            reply_bytes=need,
            model=adapter,
            served_as=reply_model,
        )
        outcome = await self.ask(request, call)
        answers = await asyncio.to_thread(answers_of, parsed.questions, asked, outcome.questions)
        return SystemOneResponse(
            model=reply_model,
            answers=answers,
            usage=Usage(input_tokens=evaluated_tokens(outcome), output_tokens=0),
            x_timing=timing_block(outcome),
        )

    def router(self) -> APIRouter:
        """`POST /v1/systemone` and `GET /v1/models`, declared for the published schema."""
        router = APIRouter(dependencies=[Security(BEARER)], responses=PUBLISHED_ERRORS)

        self.add_post(
            router,
            SYSTEMONE_PATH,
            name="systemone",
            summary="System One: noul, choice, score and box questions over one state, one batch",
            body=SystemOneRequest,
            reply=SystemOneResponse,
            build=self.answer,
        )

        @router.get(
            MODELS_PATH, summary="The loaded model and its aliases", responses={200: {"model": ModelList}}
        )
        async def models() -> JSONResponse:
            return json_reply(self.models())

        return router
