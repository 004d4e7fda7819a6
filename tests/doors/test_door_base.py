"""What the door base gives every door: the error-rule lookup, the refusal's field, the published
error statuses, the rendered status on admission's refusals, the request id headers and the
route labels of the metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from semif_serve.app import create_app
from semif_serve.domain.types import DecisionError, TooLargeForMemory, TooManyRows
from semif_serve.doors.base import DecisionDoor, ErrorRule, NoErrorRule, refusal_of, rule_for
from semif_serve.doors.native.api import NATIVE_ERRORS
from semif_serve.doors.systemone.errors import SYSTEMONE_ERRORS
from semif_serve.http.errors import ServiceError
from semif_serve.service.startup import Service
from tests.support import TOKEN, decision
from tests.support.memory_sim import SimulatedMemory

AUTH = {"Authorization": f"Bearer {TOKEN}"}
SYSTEMONE = {"model": "jev-latest", "state": "All zones healthy.", "questions": {"ok": {"type": "noul"}}}


def request(app, method: str, url: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, url, **kw)

    return asyncio.run(go())


class Unforeseen(DecisionError):
    """A domain error that no door has a rule for."""


# -- the lookup -------------------------------------------------------------------------------------


def test_a_domain_error_without_a_rule_is_a_named_lookup_error_not_a_stop_iteration() -> None:
    with pytest.raises(NoErrorRule, match="Unforeseen"):
        rule_for(NATIVE_ERRORS, Unforeseen("nobody planned this"))
    with pytest.raises(NoErrorRule):
        rule_for(SYSTEMONE_ERRORS, Unforeseen("nobody planned this"))


def test_a_subclass_of_a_mapped_error_gets_its_base_classs_rule() -> None:
    class Wider(TooManyRows):
        pass

    assert rule_for(NATIVE_ERRORS, Wider(9, 4)) is NATIVE_ERRORS[TooManyRows]


@pytest.mark.parametrize(
    "path,body,shape", [("/decide", decision(), "error"), ("/v1/systemone", SYSTEMONE, "detail")]
)
def test_an_unmapped_domain_error_is_a_500_in_the_doors_shape_and_the_service_goes_on(
    service, monkeypatch, path, body, shape
) -> None:
    app = create_app(service)

    async def unforeseen(*args, **kwargs):
        raise Unforeseen("nobody planned this")

    monkeypatch.setattr(service, "decide", unforeseen)
    failed = request(app, "POST", path, json=body, headers=AUTH)
    assert failed.status_code == 500
    assert set(failed.json()) == {shape}
    monkeypatch.undo()
    assert request(app, "POST", path, json=body, headers=AUTH).status_code == 200


# -- the field a refusal names ----------------------------------------------------------------------


def test_a_refusal_whose_decision_is_unknown_names_the_decisions_not_the_first_one() -> None:
    refusal = TooLargeForMemory(10 * 2**30, 2**30)
    assert refusal.question is None
    assert refusal_of(NATIVE_ERRORS, refusal, True, ()).field == "decisions"
    refusal.question = 2
    assert refusal_of(NATIVE_ERRORS, refusal, True, ()).field == "decisions[2]"


def test_a_memory_refusal_names_the_widest_decision_whichever_it_is(engine, checkpoint) -> None:
    from tests.support import make_settings

    service = Service.start(
        make_settings(checkpoint), engine=engine.with_options(memory=SimulatedMemory(floor=0, cap=1))
    )
    long_question = "Is every one of the following zones healthy: " + ", ".join(
        f"zone-{i}" for i in range(60)
    )
    body = {"state": "s", "decisions": [decision(id="short"), decision(id="long", question=long_question)]}
    response = request(create_app(service), "POST", "/decide/shared", json=body, headers=AUTH)
    assert response.status_code == 413
    assert response.json()["error"]["field"] == "decisions[1]"


# -- the published schema ---------------------------------------------------------------------------


def test_every_operation_publishes_every_error_status_the_service_answers(client) -> None:
    schema = client.get("/openapi.json").json()
    for path, method in [("/decide", "post"), ("/decide/shared", "post"), ("/v1/systemone", "post")]:
        published = set(schema["paths"][path][method]["responses"])
        assert {"400", "401", "408", "413", "415", "422", "429", "500", "503"} <= published, path
    systemone = schema["paths"]["/v1/systemone"]["post"]["responses"]
    assert systemone["500"]["content"]["application/json"]["schema"]["$ref"].endswith("/TypeSafeError")
    assert systemone["422"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/TypeSafeValidationError"
    )


# -- admission's refusals ---------------------------------------------------------------------------


class TeapotDoor(DecisionDoor):
    """A door whose error shape has its own status: what admission sends must be what it renders."""

    path_prefix = "/teapot/"
    protected_paths = frozenset({"/teapot/brew"})
    request_models = ()
    errors: dict[type[DecisionError], ErrorRule] = {}

    def router(self) -> APIRouter:
        return APIRouter()

    def render(self, error: ServiceError, request: Request) -> Response:
        return JSONResponse({"teapot": error.code}, status_code=418)

    def refusal(self, exc, shared, ids) -> ServiceError:
        raise AssertionError("never asked")


def test_admission_sends_the_status_of_the_response_the_door_rendered(service) -> None:
    app = create_app(service, doors=[TeapotDoor(service)])
    refused = request(app, "POST", "/teapot/brew", json={})
    assert refused.status_code == 418
    assert refused.json() == {"teapot": "unauthorized"}


# -- request ids and route labels -------------------------------------------------------------------


def test_system_one_replies_carry_the_request_id_where_typesafes_sdks_read_it(client) -> None:
    answered = client.post("/v1/systemone", json=SYSTEMONE, headers={"X-Request-ID": "trace-1"})
    refused = client.post("/v1/systemone", json=SYSTEMONE, auth=False, headers={"X-Request-ID": "trace-2"})
    assert answered.status_code == 200 and refused.status_code == 401
    assert answered.headers["x-typesafe-request-id"] == answered.headers["x-request-id"] == "trace-1"
    assert refused.headers["x-typesafe-request-id"] == refused.headers["x-request-id"] == "trace-2"
    native = client.post("/decide", json=decision(), headers={"X-Request-ID": "trace-3"})
    assert native.headers["x-request-id"] == "trace-3" and "x-typesafe-request-id" not in native.headers


def test_system_one_routes_are_counted_under_their_own_labels(client) -> None:
    assert client.post("/v1/systemone", json=SYSTEMONE).status_code == 200
    assert client.get("/v1/models").status_code == 200
    assert client.get("/no/such/route").status_code == 404
    metrics = client.get("/metrics").text
    assert 'semif_requests_total{route="/v1/systemone",status="200"}' in metrics
    assert 'semif_requests_total{route="/v1/models",status="200"}' in metrics
    assert 'semif_requests_total{route="other",status="404"}' in metrics
