"""contract.md is pinned: its routes, limits and error codes match the code, both ways."""

from __future__ import annotations

import re
from pathlib import Path

from semif_serve.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
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


def source_errors() -> set[tuple[int, str]]:
    """Every (status, code) the source can answer with."""
    found: set[tuple[int, str]] = set()
    for path in (ROOT / "src" / "semif_serve").glob("*.py"):
        text = path.read_text()
        found |= {(int(s), c) for s, c in re.findall(r'ServiceError\(\s*(\d{3}),\s*"([a-z_]+)"', text)}
        found |= {(422, c) for c in re.findall(r'code(?:: str)?\s?=\s?"([a-z_]+)"', text)}
        found |= {(int(s), c) for s, c in re.findall(r'(\d{3}): "([a-z_]+)"', text)}
    return found


def test_every_error_code_the_service_can_answer_is_in_the_contract_and_back():
    assert source_errors() == contract_errors()


def test_every_contract_route_exists_with_its_method(service):
    from semif_serve.app import create_app

    app = create_app(service)
    api = app.admission.app
    served = {(m, r.path) for r in api.routes for m in getattr(r, "methods", set()) or set()}
    for method, path, _auth, _purpose in table_rows("## Routes"):
        assert (method, path.strip("`")) in served


def test_the_contracts_limit_defaults_are_the_settings_defaults():
    fields = Settings.model_fields
    for _limit, setting, default, _answer in table_rows("### Limits"):
        name = setting.strip("`")
        if not name.startswith("SEMIF_"):
            continue
        field = fields[name.removeprefix("SEMIF_").lower()]
        assert float(default) == float(field.default), name


def test_the_errors_tested_over_http_answer_with_the_contracts_status():
    tested = (ROOT / "tests").glob("test_*.py")
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
