"""What every door shares: the door interface, error rules and their lookup, asking the core,
the reply wrapper and the published error responses.

A door declares its paths, its routes and request models, its one table from domain error to
`ErrorRule`, and how it renders an error on its paths; the rest lives here once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from pydantic import BaseModel

from semif_serve.domain.echo import quoted
from semif_serve.domain.types import BatchTiming, DecisionError
from semif_serve.http.errors import ServiceError, internal
from semif_serve.service.decisions import ReplyCount
from semif_serve.service.methods import Ask, Decided
from semif_serve.service.records import RequestRecord
from semif_serve.service.startup import Service

log = logging.getLogger("semif_serve.doors")

BEARER = HTTPBearer(auto_error=False, description="`Authorization: Bearer <token>`")
# A route's work: parse the body, ask the core, build the reply model.
Build = Callable[[Request, bytes], Awaitable[BaseModel]]

# Every status a door may answer besides 200, and why (a door adds its own words per status).
ERROR_STATUSES: dict[int, str] = {
    400: "the body is not JSON, Content-Length is malformed, a header that must be single is repeated, "
    "or the compressed body is corrupt",
    401: "missing, malformed or wrong bearer token",
    404: "no such route",
    405: "the method is not allowed on this route",
    408: "the body did not arrive within SEMIF_BODY_TIMEOUT_SECONDS",
    413: "the body, a prompt, the rows or the reply pass a limit, or a row needs more memory than is left",
    415: "a Content-Encoding other than gzip or zstd (or a stack of them)",
    422: "a field breaks a rule",
    429: "too many requests in progress; Retry-After",
    500: "an unexpected failure; the service stays up",
    503: "out of device memory, or draining; Retry-After",
}


@dataclass(frozen=True)
class ErrorRule:
    """How a door answers one domain error: status and code (TypeSafe's `error_type` on System
    One), the field it names on a one-question route and on a many-question route (`{question}`
    is the question's index), headers, and when it applies (for the contract)."""

    status: int
    code: str
    field: str | None = None
    shared_field: str | None = None
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    when: str = ""

    def field_for(self, shared: bool, question: int | None) -> str | None:
        """The field this rule names: the question's own where its position is known, else the
        list of questions (on a many-question route) or the route's one field."""
        template = self.shared_field if shared else self.field
        if template is None:
            return None
        return (
            template.format(question=question) if question is not None else template.split("[{question}]")[0]
        )


class NoErrorRule(LookupError):
    """A domain error that a door's table has no rule for: a bug, answered 500 and logged by name."""


def rule_for(table: Mapping[type[DecisionError], ErrorRule], exc: DecisionError) -> ErrorRule:
    """The rule for `exc`: its own class's, else the nearest base class's that has one."""
    for kind in type(exc).__mro__:
        if kind in table:
            return table[kind]
    raise NoErrorRule(f"no error rule for {type(exc).__name__}")


def refusal_of(
    table: Mapping[type[DecisionError], ErrorRule], exc: DecisionError, shared: bool, ids: Sequence[str]
) -> ServiceError:
    """A domain error under its rule in `table`: the rule's status, code, headers and field
    (`shared`: on a many-question route), the message prefixed with the question's id where `ids`
    names it."""
    rule = rule_for(table, exc)
    where = ""
    if exc.question is not None and exc.question < len(ids):
        where = f"question {quoted(ids[exc.question])}: "
    field = rule.field_for(shared, exc.question) or exc.field
    return ServiceError(rule.status, rule.code, where + exc.message, field, dict(rule.headers))


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that parses `model` itself (to keep its own 4xx)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def json_reply(reply: BaseModel, status: int = 200, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """A body model as JSON, in its fields' order; fields the door left unset are left out. The
    one serialisation of every reply and error body a door sends."""
    return JSONResponse(reply.model_dump(mode="json", exclude_unset=True), status, dict(headers or {}))


def error_responses(
    model: type[BaseModel], overrides: Mapping[int, tuple[type[BaseModel], str]] | None = None
) -> dict[int | str, dict[str, Any]]:
    """The published error responses of a door: every status in ERROR_STATUSES with the door's
    error body `model`, and a door's own model or words where `overrides` says."""
    published: dict[int | str, dict[str, Any]] = {}
    for status, description in ERROR_STATUSES.items():
        body, words = (overrides or {}).get(status, (model, description))
        published[status] = {"model": body, "description": words}
    return published


def fields_of(kind: type) -> dict[str, Any]:
    """A domain dataclass's fields as annotations: a wire model that publishes the same fields
    takes them from the one declaration, in the domain, instead of restating them."""
    return {f.name: f.type for f in dataclasses.fields(kind)}


class TimingBody(BaseModel):
    """How a shared-path batch ran."""

    __annotations__ = fields_of(BatchTiming)  # every field of the domain's BatchTiming, each required


class DecisionDoor(ABC):
    """An HTTP surface over the decision core: routes, request models and one error table."""

    #: Paths starting with this belong to the door (its error shape answers their 404/405/500).
    path_prefix: ClassVar[str]
    #: Paths that need the bearer token (admission checks it from the headers, before a slot).
    protected_paths: ClassVar[frozenset[str]]
    #: Request bodies the routes parse themselves, published in the OpenAPI schema.
    request_models: ClassVar[tuple[type[BaseModel], ...]]
    #: The door's one table from domain error to its answer.
    errors: ClassVar[Mapping[type[DecisionError], ErrorRule]]
    #: Headers, beside X-Request-ID, that carry the request id on the door's paths.
    request_id_headers: ClassVar[tuple[bytes, ...]] = ()
    #: Whether a refusal's message starts with the question's id (its position is always known).
    names_question: ClassVar[bool] = False

    def __init__(self, service: Service) -> None:
        self.service = service

    def body_limit(self, path: str, content_type: str | None, default: int) -> int:
        """The body limit admission applies to a POST on `path` (default: SEMIF_MAX_BODY_BYTES)."""
        return default

    @abstractmethod
    def router(self) -> APIRouter:
        """The door's routes, ready to include in the app."""

    @abstractmethod
    def render(self, error: ServiceError, request: Request) -> Response:
        """An error on one of the door's paths, in the door's own body shape."""

    def refusal(self, exc: DecisionError, shared: bool, ids: Sequence[str]) -> ServiceError:
        """The door's answer to a domain error under its table (`shared`: a many-question route;
        `ids`: the questions, in order, named where the door `names_question`)."""
        return refusal_of(self.errors, exc, shared, ids if self.names_question else ())

    async def ask(self, request: Request, asked: Ask, reply_bytes: ReplyCount | None = None) -> Decided:
        """Ask the method of the model `asked` names (the door's call: its limits, images and
        defaults; `reply_bytes`, the door's count of its reply from the method's plan), record it
        for the log line and the metrics, and turn a domain error into the door's refusal
        through its table."""
        try:
            decided = await self.service.decide(asked, reply_bytes)
        except DecisionError as exc:
            raise self.refusal(exc, asked.shared, [q.id for q in asked.questions]) from None
        request.state.record = RequestRecord.of(decided, asked)
        return decided

    async def reply(self, request: Request, build: Build) -> JSONResponse:
        """Read the body, build the reply model and send it as JSON, serialised on a worker
        thread (a large reply leaves the event loop free); any failure that is not a refusal is
        a 500 in the door's shape, logged by name."""
        body = await request.body()
        try:
            reply = await build(request, body)
        except ServiceError:
            raise
        except Exception as exc:  # noqa: BLE001 - a failure building the reply is a 500, the service stays up
            detail = f" ({exc})" if isinstance(exc, NoErrorRule) else ""
            log.error("failed to build the response: %s%s", type(exc).__name__, detail)
            raise internal() from None
        return await asyncio.to_thread(json_reply, reply)

    def add_post(
        self,
        router: APIRouter,
        path: str,
        *,
        name: str,
        summary: str,
        body: type[BaseModel],
        reply: type[BaseModel],
        build: Build,
    ) -> None:
        """Declare `POST path`: the route parses `body` itself (keeping the door's own 4xx) and
        answers `reply`; both are published in the OpenAPI schema."""

        async def endpoint(request: Request) -> JSONResponse:
            return await self.reply(request, build)

        router.add_api_route(
            path,
            endpoint,
            methods=["POST"],
            name=name,
            summary=summary,
            responses={200: {"model": reply}},
            openapi_extra=request_body(body),
        )


def door_of(doors: Sequence[DecisionDoor], path: str) -> DecisionDoor:
    """The door that owns `path`: the longest matching prefix wins; the native door ("") is the fallback."""
    return max((d for d in doors if path.startswith(d.path_prefix)), key=lambda d: len(d.path_prefix))
