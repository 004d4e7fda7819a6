"""The published API: `/openapi.json` is the real contract and `/docs` works offline.

A property-based run of schemathesis over the published schema sends generated valid and
invalid bodies to every operation, with and without the token: never a 5xx, and every
response (status, headers, body) conforms to the schema.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from semif_serve.app import create_app
from tests.support import TOKEN


@pytest.fixture(scope="module")
def published(service):
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(service))


CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]
BOUNDED = settings(
    max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
@pytest.mark.parametrize("token", [True, False], ids=["with-token", "without-token"])
def test_generated_requests_never_get_a_5xx_and_every_response_matches_the_schema(published, mode, token):
    headers = {"Authorization": f"Bearer {TOKEN}"} if token else {}
    for result in published.get_all_operations():
        operation = result.ok()
        if mode is GenerationMode.NEGATIVE and not list(operation.body):
            continue  # nothing in a bodiless GET to make invalid

        @BOUNDED
        @given(case=operation.as_strategy(generation_mode=mode))
        def exercise(case):
            case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
            case.call_and_validate(headers=headers, checks=CHECKS)

        exercise()


def test_the_schema_declares_every_route_its_bodies_and_the_bearer_scheme(client):
    published = client.get("/openapi.json", auth=False).json()
    assert set(published["paths"]) == {
        "/decide",
        "/decide/shared",
        "/calibrate",
        "/health",
        "/livez",
        "/metrics",
        "/v1/systemone",
        "/v1/models",
    }
    for path in ("/decide", "/decide/shared", "/calibrate"):
        operation = published["paths"][path]["post"]
        assert operation["security"] == [{"HTTPBearer": []}]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        for status in ("200", "401", "422", "429", "500", "503"):
            assert status in operation["responses"], (path, status)
    assert published["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    for name in (
        "DecisionBody",
        "SharedDecisionsBody",
        "CalibrateBody",
        "CalibrationReport",
        "ErrorEnvelope",
        "DecisionResult",
        "HealthBody",
    ):
        assert name in published["components"]["schemas"]
    system_one = published["paths"]["/v1/systemone"]["post"]
    assert system_one["security"] == [{"HTTPBearer": []}]
    assert system_one["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/SystemOneRequest"
    )
    for status in ("200", "400", "401", "413", "422", "429", "503"):
        assert status in system_one["responses"], status


def test_the_docs_page_loads_its_assets_from_the_service_itself(client):
    page = client.get("/docs", auth=False)
    assert page.status_code == 200 and "swagger-ui" in page.text
    assert "cdn" not in page.text.lower().replace("/docs/assets", "")
    assets = [part.split('"')[0] for part in page.text.split('="/docs/assets/')[1:]]
    assert {"swagger-ui-bundle.js", "swagger-ui.css"} <= set(assets)
    for asset in assets:
        assert client.get(f"/docs/assets/{asset}", auth=False).status_code == 200
