"""Fuzzing every POST route through the real app: never a 5xx, and every 4xx in its door's shape.

To cover another POST route, add it to ROUTES with a valid body to mutate (and its error shape
to SHAPES when it is not the native envelope).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from semif_serve.app import create_app
from semif_serve.http.json_body import MAX_DEPTH, MAX_INT_DIGITS
from tests.support import TOKEN, decision

ROUTES = {
    "/decide": decision(),
    "/decide/shared": {"state": {"log": ["ok"]}, "decisions": [decision(), decision(id="q2")]},
    "/v1/systemone": {
        "model": "jev-latest",
        "state": {"log": ["ok"]},
        "questions": {
            "n": {"type": "noul", "instructions": "Ok?", "criteria": {"true": "Yes.", "false": None}},
            "c": {
                "type": "choice",
                "criteria": {"a": "First.", "b": None, "c": {"k": [1]}},
                "x_orderings": "shifts",
            },
            "s": {"type": "score", "instructions": {"q": "How much?"}, "criteria": ["low", "high"]},
        },
    },
}
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

any_text = st.text(st.characters(exclude_categories=()), max_size=12)  # surrogates included
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | any_text,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(any_text, children, max_size=3),
    max_leaves=12,
)
JSON_PIECES = ["{", "}", "[", "]", '"', ":", ",", "1", "-", "e", "null", "tru", "\\u", "\\ud800", '"id"', " "]
malformed_json = st.lists(st.sampled_from(JSON_PIECES), max_size=30).map("".join).map(str.encode)
huge_numbers = st.sampled_from(
    [
        "9" * (MAX_INT_DIGITS + 1),
        "-" + "1" * (MAX_INT_DIGITS + 50),
        "1" + "0" * 5000 + ".5",
        "1e999999",
        "-1e-999999",
        "NaN",
        "Infinity",
    ]
)
deep_nesting = st.integers(MAX_DEPTH - 2, 3000).map(lambda depth: "[" * depth + "]" * depth)


@pytest.fixture(scope="module")
def app(service):
    return create_app(service)


def post(app, route: str, body: bytes) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fuzz") as client:
            return await client.post(route, content=body, headers={"Authorization": f"Bearer {TOKEN}"})

    return asyncio.run(go())


def assert_native_error(response: httpx.Response) -> None:
    error = response.json()["error"]
    assert set(error) == {"code", "message", "field", "request_id"}
    assert isinstance(error["code"], str) and isinstance(error["message"], str)
    assert error["field"] is None or isinstance(error["field"], str)
    assert error["request_id"] == response.headers["x-request-id"]


def assert_typesafe_error(response: httpx.Response) -> None:
    detail = response.json()["detail"]
    if response.status_code == 422:
        assert isinstance(detail, list) and detail
        for item in detail:
            assert set(item) == {"loc", "msg", "type"} and item["loc"][0] == "body"
            assert isinstance(item["msg"], str) and isinstance(item["type"], str)
    else:
        assert set(detail) == {"error_type", "message"}
        assert isinstance(detail["error_type"], str) and isinstance(detail["message"], str)
    assert response.headers["x-request-id"]


SHAPES = {"/v1/systemone": assert_typesafe_error}


def assert_answered_in_contract(app, route: str, body: bytes) -> None:
    response = post(app, route, body)
    assert response.status_code < 500, (response.status_code, response.text, body[:200])
    if response.status_code >= 400:
        SHAPES.get(route, assert_native_error)(response)
    else:
        answer = json.loads(response.text, parse_constant=lambda c: pytest.fail(f"{c} in a 200 body"))
        assert response.status_code == 200 and isinstance(answer, dict)
    assert app.admission.in_progress == 0


def paths(value, prefix=()):
    """Every (path) into a JSON value, the value itself first."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from paths(item, (*prefix, i))


def replaced(document, path, new):
    """A copy of `document` with the value at `path` replaced by `new` (the whole document for ())."""
    if not path:
        return new
    copy = json.loads(json.dumps(document))
    target = copy
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = new
    return copy


def spliced(route: str, path_index: int, raw: str) -> bytes:
    """The route's valid body with one value replaced by raw JSON text (which json.dumps cannot write)."""
    base = ROUTES[route]
    where = list(paths(base))[path_index % len(list(paths(base)))]
    marker = "\u0000SPLICE\u0000"
    return json.dumps(replaced(base, where, marker)).replace(json.dumps(marker), raw).encode()


routes = pytest.mark.parametrize("route", list(ROUTES))


@routes
@FUZZ
@given(body=st.binary(max_size=300))
def test_random_bytes_never_get_a_5xx(app, route, body):
    assert_answered_in_contract(app, route, body)


@routes
@FUZZ
@given(body=malformed_json)
def test_malformed_json_never_gets_a_5xx(app, route, body):
    assert_answered_in_contract(app, route, body)


@routes
@FUZZ
@given(path_index=st.integers(0, 100), value=json_values)
def test_any_field_with_a_wrong_type_or_random_unicode_never_gets_a_5xx(app, route, path_index, value):
    body = spliced(route, path_index, json.dumps(value, ensure_ascii=True))  # lone surrogates as \\udXXX
    assert_answered_in_contract(app, route, body)


@routes
@FUZZ
@given(path_index=st.integers(0, 100), raw=huge_numbers | deep_nesting, extra=st.booleans())
def test_huge_numbers_and_deep_nesting_anywhere_never_get_a_5xx(app, route, path_index, raw, extra):
    if extra:  # in an ignored field
        body = json.dumps({**ROUTES[route], "label": "\u0000X\u0000"}).replace('"\\u0000X\\u0000"', raw)
        assert_answered_in_contract(app, route, body.encode())
    else:
        assert_answered_in_contract(app, route, spliced(route, path_index, raw))
