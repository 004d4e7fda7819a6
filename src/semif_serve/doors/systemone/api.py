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
from semif_serve.domain.requests import BASE, Defaults, Limits
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
from semif_serve.doors.systemone.mapping import (
    answers_of,
    asked_questions,
    rows_asked,
    timing_block,
    usage_of,
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
    ModelList,
    ModelListing,
    SystemOneRequest,
    SystemOneResponse,
    SystemOneValidationError,
    parse_request,
)
from semif_serve.doors.systemone.sizes import reply_bytes
from semif_serve.http.errors import ServiceError
from semif_serve.http.headers import headers_of
from semif_serve.service.decisions import refuse_unread
from semif_serve.service.methods import Ask, Served
from semif_serve.service.startup import Service


def release_date(service: Service) -> str:
    """SEMIF_MODEL_RELEASE_DATE, else the day (UTC) the checkpoint's config.json was written."""
    settings = service.settings
    if settings.model_release_date is not None:
        return settings.model_release_date.isoformat()
    config = settings.require_model() / "config.json"
    return datetime.fromtimestamp(config.stat().st_mtime, UTC).date().isoformat()


class SystemOneDoor(DecisionDoor):
    """TypeSafe's System One over the decision methods."""

    path_prefix = "/v1/"
    protected_paths = frozenset({SYSTEMONE_PATH, MODELS_PATH})
    request_models = (SystemOneRequest,)
    errors = SYSTEMONE_ERRORS
    names_question = True  # a refusal's message names the question by its id
    request_id_headers = (b"x-typesafe-request-id",)  # what TypeSafe's SDKs read

    def __init__(self, service: Service) -> None:
        super().__init__(service)
        settings = service.settings
        self.defaults = Defaults(settings.systemone_orderings, settings.systemone_workloads)
        identity = service.engine.identity
        self.model_name = f"{identity.source}@{identity.revision}"
        self.max_options = min(MAX_OPTIONS, service.engine.capacity)
        # Facts of the loaded model and the settings, computed once at startup.
        self.release_date = release_date(service)
        self.allow_aliases = (
            settings.systemone_allow_aliases
        )  # the Jev names, unless SEMIF_MODELS declares them
        models = service.models.models
        self.aliases = tuple(
            name for name in models.aliases if models.resolve(name, jev_aliases=self.allow_aliases)
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

    def served(self, model: object) -> Served | None:
        """What serves a request naming `model` (a model's name, or an alias where allowed), or None."""
        if not isinstance(model, str):
            return None
        return self.service.models.resolve(model, jev_aliases=self.allow_aliases)

    def refuse_past_row_cap(self, data: dict[str, Any], served: Served | None) -> None:
        """Refuse (413) a decoded request whose questions already ask for more rows than the cap,
        counted from the JSON by the method of the model it names (the base's where it names none
        it serves) before it is validated or mapped: milliseconds, whatever it holds."""
        method = (served or self.service.models.base).method
        rows = rows_asked(data, method, self.defaults)
        limit = self.service.settings.systemone_max_rows
        if rows > limit:
            raise self.refusal(domain.TooManyRows(rows, limit), True, ())

    def body_limit(self, path: str, content_type: str | None, default: int) -> int:
        """A multipart body on `/v1/systemone` may carry SEMIF_SYSTEMONE_MAX_IMAGE_BYTES of images
        beside a JSON request part of at most the JSON body limit."""
        if path == SYSTEMONE_PATH and is_multipart(content_type):
            return default + self.service.settings.systemone_max_image_bytes
        return default

    def parse(
        self, content_type: str | None, body: bytes
    ) -> tuple[SystemOneRequest, dict[str, bytes] | None, Served | None]:
        """The validated request, a multipart body's parts by name (None for JSON) and what serves
        the model it names (resolved once, before validation: the row screen counts by its method;
        None: unknown); run off the event loop."""
        resolved: list[Served | None] = [None]

        def screen(data: dict[str, Any]) -> None:
            resolved[0] = self.served(data.get("model"))
            self.refuse_past_row_cap(data, resolved[0])

        if not is_multipart(content_type):
            return parse_request(body, self.max_options, screen), None, resolved[0]
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
        parsed = parse_request(multipart.request, self.max_options, screen)
        return parsed, multipart.parts, resolved[0]

    def unknown_model(self, model: str) -> ServiceError:
        """The door's refusal of a model it does not serve, listing those it does."""
        aliases = f" (aliases: {', '.join(self.aliases)})" if self.aliases else ""
        over = [served.name for served in self.service.models.over_base]
        names = ", ".join(repr(n) for n in [self.model_name, *over])
        return ServiceError(
            UNKNOWN_MODEL.status,
            UNKNOWN_MODEL.code,
            f"unknown model {quoted(model)}; this server serves {names}{aliases}",
        )

    def render(self, error: ServiceError, request: Request) -> Response:
        """Any error on `/v1/...` in TypeSafe's shapes (errors.py); the request id headers are
        stamped by the request context."""
        return error_reply(error)

    def models(self) -> ModelList:
        """`GET /v1/models`: the loaded model's real identity first, then every model over it and
        the aliases it answers."""
        engine = self.service.engine
        identity = engine.identity
        demo = " Random demo weights: the answers carry no meaning." if identity.demo else ""
        real = ModelListing(
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
            x_answer_codes=engine.capacity,
            x_max_input_tokens=self.service.settings.systemone_max_input_tokens,
            x_reads_images=engine.reads_images,
            x_max_images=self.image_limits.max_images,
            x_max_image_pixels=self.image_limits.max_image_pixels,
            x_max_image_bytes=self.image_limits.max_image_bytes,
        )
        real.x_method = self.service.models.base.method.name
        real.x_calibration = self.service.calibration.workloads_of(None)
        over = [self.listing(served) for served in self.service.models.over_base]
        aliases = []
        for alias in self.aliases:
            target = self.service.models.resolve(alias)
            name = self.model_name if target is None or target.is_base else target.name
            aliases.append(
                ModelListing(
                    name=alias,
                    description=f"Alias of {name}.",
                    release_date=self.release_date,
                    x_alias_of=name,
                )
            )
        return ModelList(models=[real, *over, *aliases])

    def listing(self, served: Served) -> ModelListing:
        """`/v1/models`' entry of a model over the base: its method's facts (`listing`), at most
        System One's options, and the adapter the engine serves it with."""
        fields = served.method.listing(served)
        fields["x_max_options"] = min(MAX_OPTIONS, fields.get("x_max_options", MAX_OPTIONS))
        if served.adapter != BASE:
            adapter = self.service.engine.adapters.adapters[served.adapter]
            fields["x_adapter"] = AdapterInfo(
                name=adapter.weights.directory.name,
                rank=adapter.weights.rank,
                modules=len(adapter.weights.modules),
                factor=adapter.scale,
            )
        return ModelListing(name=served.name, release_date=self.release_date, **fields)

    async def answer(self, request: Request, body: bytes) -> SystemOneResponse:
        """`POST /v1/systemone`: every question (and ordering) over the state, read by the method
        of the model it names, in one batch."""
        content_type = headers_of(request.scope).media_type  # the one Content-Type admission bounded
        parsed, parts, served = await asyncio.to_thread(self.parse, content_type, body)
        if served is None:
            raise self.unknown_model(parsed.model)
        method = served.method
        ask = Ask(
            served,
            parsed.state,
            asked_questions(parsed.questions),
            self.limits,
            defaults=self.defaults,
            named=served.name,
            fields={"images": "assets"},
        )
        try:
            refuse_unread(ask, images=bool(parsed.assets))  # before any image is decoded
        except domain.DecisionError as exc:
            raise self.refusal(exc, True, list(parsed.questions)) from None
        if parsed.assets:  # decoding images is CPU work: off the event loop
            images = await asyncio.to_thread(
                resolve_images, parsed, parts, self.image_limits, self.verified_images
            )
        else:  # only the placeholder and part checks: no thread hop for a text-only request
            images = resolve_images(parsed, parts, self.image_limits)
        if images and not self.service.engine.reads_images:
            raise ServiceError(
                NO_VISION.status,
                NO_VISION.code,
                f"the loaded model {self.model_name!r} does not read images: its checkpoint has no "
                "vision tower, so a request with `assets` is refused rather than answered from "
                "the placeholder text",
                "assets",
            )
        parsed, images = place_images(parsed, images)
        ask = Ask(
            served,
            parsed.state,
            asked_questions(parsed.questions),
            self.limits,
            images=tuple(images),
            defaults=self.defaults,
            named=served.name,
            fields={"images": "assets"},
        )
        kinds = [(qid, q.type) for qid, q in parsed.questions.items()]
        decided = await self.ask(request, ask, lambda plan: reply_bytes(method, plan, kinds, served.name))
        assert decided.answers is not None  # every System One question is typed
        answers = await asyncio.to_thread(answers_of, list(parsed.questions), decided.answers, method)
        return SystemOneResponse(
            model=served.name,
            answers=answers,
            usage=usage_of(decided),
            x_timing=timing_block(decided),
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
