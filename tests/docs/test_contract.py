"""contract.md is pinned: its routes, limits and error codes match the code's tables, both ways."""

from __future__ import annotations

import re
from pathlib import Path

from semif_serve.domain.lev.types import ModeBUnavailable
from semif_serve.domain.types import DecisionError, NotRead, TooManyRows, Unanswerable
from semif_serve.doors.base import rule_for
from semif_serve.doors.native.api import NATIVE_ERRORS
from semif_serve.doors.native.api import UNKNOWN_MODEL as UNKNOWN_NATIVE_MODEL
from semif_serve.doors.systemone.errors import HTTP_ERROR_TYPES, NO_VISION, SYSTEMONE_ERRORS, UNKNOWN_MODEL
from semif_serve.http.errors import HTTP_ERRORS
from semif_serve.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = (ROOT / "contract.md").read_text()


def table_rows(heading: str) -> list[list[str]]:
    """The body rows of the first table after a heading."""
    section = CONTRACT.split(heading, 1)[1]
    rows = []
    started = False
    for line in section.splitlines():
        if line.startswith("|"):
            started = True
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-: "):
                continue
            rows.append(cells)
        elif started:
            break
    return rows[1:]


def contract_errors() -> set[tuple[int, str]]:
    return {(int(status), code.strip("`")) for status, code, _ in table_rows("## Errors")}


def service_errors() -> set[tuple[int, str]]:
    """Every (status, code) the native door can answer: the HTTP layer's, its own, its domain table."""
    own = {(status, code) for code, status in HTTP_ERRORS.items()}
    own.add((UNKNOWN_NATIVE_MODEL.status, UNKNOWN_NATIVE_MODEL.code))
    return own | {(rule.status, rule.code) for rule in NATIVE_ERRORS.values()}


def domain_errors() -> set[type[DecisionError]]:
    """Every domain error the service raises: each subclass of DecisionError without subclasses
    of its own, wherever the service declares it (lev's ModeBUnavailable too), and Unanswerable,
    which a plug-in method raises itself."""
    import semif_serve.domain.lev.types  # noqa: F401 - lev's errors, declared beside lev's types

    leaves, seen = set(), [DecisionError]
    while seen:
        kind = seen.pop()
        own = [k for k in kind.__subclasses__() if k.__module__.startswith("semif_serve.")]
        seen += own
        if not own and kind is not DecisionError:
            leaves.add(kind)
    return leaves | {Unanswerable}


def test_every_domain_error_has_a_native_answer() -> None:
    errors = domain_errors()
    assert {NotRead, ModeBUnavailable, TooManyRows} <= errors  # the walk reaches every depth and module
    for kind in errors:
        assert rule_for(NATIVE_ERRORS, kind.__new__(kind)) is not None, kind  # the door's own lookup
    # A field the model's method does not read is the caller's mistake, on that field.
    assert (NATIVE_ERRORS[Unanswerable].status, NATIVE_ERRORS[Unanswerable].code) == (422, "validation_error")


def test_every_error_code_the_service_can_answer_is_in_the_contract_and_back():
    assert service_errors() == contract_errors()


def test_every_domain_error_has_a_system_one_answer() -> None:
    for kind in domain_errors():
        assert rule_for(SYSTEMONE_ERRORS, kind.__new__(kind)) is not None, kind  # the door's own lookup
    # What a lev model does not read is the client's mistake: never a 5xx.
    assert (SYSTEMONE_ERRORS[Unanswerable].status, SYSTEMONE_ERRORS[Unanswerable].code) == (
        400,
        "api_usage_error",
    )


def test_every_system_one_error_type_is_in_the_contract_and_back():
    answered = {(rule.status, rule.code) for rule in [*SYSTEMONE_ERRORS.values(), UNKNOWN_MODEL, NO_VISION]}
    answered |= {(HTTP_ERRORS[code], error_type) for code, error_type in HTTP_ERROR_TYPES.items()}
    documented = {
        (int(status), error_type.strip("`")) for status, error_type, _ in table_rows("### System One errors")
    }
    assert answered == documented


def test_every_contract_route_answers_its_method_and_no_other_route_exists(client):
    routes = {(method, path.strip("`")) for method, path, _auth, _purpose in table_rows("## Routes")}
    for method, path in routes:
        assert client.request(method, path, auth=False).status_code not in (404, 405), (method, path)
    assert client.get("/not-a-route").status_code == 404
    published = client.get("/openapi.json").json()["paths"]
    documented = {(m.upper(), p) for p, ops in published.items() for m in ops}
    assert documented <= routes


def test_the_contracts_limit_defaults_are_the_settings_defaults():
    fields = Settings.model_fields
    limits = table_rows("### Limits") + table_rows("### System One limits")
    for _limit, setting, default, _answer in limits:
        name = setting.strip("`")
        if not name.startswith("SEMIF_"):
            continue
        field = fields[name.removeprefix("SEMIF_").lower()]
        assert float(default) == float(field.default), name


def test_the_errors_tested_over_http_answer_with_the_contracts_status():
    tested = (ROOT / "tests").rglob("test_*.py")
    statuses = dict((code, status) for status, code in contract_errors())
    seen = set()
    for path in tested:
        text = path.read_text()
        for status, code in re.findall(r'(\d{3}), "([a-z_]+)"', text):
            if code in statuses:
                assert statuses[code] == int(status), (path.name, code)
        seen |= {code for code in statuses if f'"{code}"' in text}
    # Every code in the contract is exercised by some test.
    assert set(statuses) <= seen, set(statuses) - seen
