"""Both doors' replies, pinned: a fixed script of requests (every route, answer type, served
model and method, refusals included) against a fresh service must give the replies recorded in
`reply_snapshot.json`: the same keys in the same order, the same strings, integers and statuses,
and the same floats to 1e-5 (they are reductions the CPU may order differently between builds).
Only what differs run to run is masked: seconds, and the release date (a file's mtime).

Rewrite it (after a change meant to alter the wire format) with
`uv run python -m tests.doors.test_reply_snapshot --write`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from semif_serve.app import create_app
from semif_serve.service.startup import Service
from tests.support import in_process_client, make_settings

SNAPSHOT = Path(__file__).with_name("reply_snapshot.json")
MASKED = "<varies>"
STATE = "Ticket 4411: the payment page times out since Tuesday's release, for every card type."
CALIBRATION = {"tickets": {"single": 1.5, "rotations": 0.8}, "lev-ish": 2.0}


def urgent(decision_id: str, **extra: str) -> dict:
    """A native yes/no decision about STATE."""
    options = [{"id": "yes", "description": "Yes."}, {"id": "no", "description": "No."}]
    return {"state": STATE, "id": decision_id, "question": "Is it urgent?", "options": options, **extra}


TEXT_SCRIPT: list[tuple[str, str, dict | None]] = [
    ("GET", "/v1/models", None),
    ("POST", "/decide", urgent("d1")),
    (
        "POST",
        "/decide",
        {
            "state": STATE,
            "id": "d2",
            "question": "Which team?",
            "orderings": "rotations",
            "workload": "tickets",
            "options": [
                {"id": "pay", "description": "Payments."},
                {"id": "web", "description": "Web."},
                {"id": "ops", "description": "Operations."},
            ],
        },
    ),
    (
        "POST",
        "/decide/shared",
        {
            "state": STATE,
            "decisions": [
                {
                    "id": "a",
                    "question": "Is it a bug?",
                    "options": [{"id": "y", "description": "Yes."}, {"id": "n", "description": "No."}],
                },
                {
                    "id": "b",
                    "question": "Severity?",
                    "orderings": "all",
                    "options": [{"id": "low", "description": "Low."}, {"id": "high", "description": "High."}],
                },
            ],
        },
    ),
    ("POST", "/decide", urgent("d3", model="triage")),
    ("POST", "/decide", urgent("d4", model="lev-tiny")),
    ("POST", "/decide", urgent("d5", model="nope")),
]


def systemone(model: str, questions: dict) -> dict:
    return {"model": model, "state": STATE, "questions": questions}


SEMIF_QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Is it urgent?"},
    "team": {
        "type": "choice",
        "criteria": {"payments": "The payments team.", "web": None},
        "x_orderings": "reversal",
    },
    "severity": {
        "type": "score",
        "criteria": ["low", {"level": "mid"}, "high"],
        "x_workload": "tickets",
        "x_orderings": "reversal",
    },
}
LEV_QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Is it urgent?", "criteria": {"true": "It is."}},
    "team": {"type": "choice", "criteria": {"payments": "The payments team.", "web": None}},
    "severity": {"type": "score", "criteria": ["low", "mid", "high"], "instructions": {"ask": "How bad?"}},
}
TEXT_SCRIPT += [
    ("POST", "/v1/systemone", systemone("jev-latest", SEMIF_QUESTIONS)),
    ("POST", "/v1/systemone", systemone("triage", SEMIF_QUESTIONS)),
    ("POST", "/v1/systemone", systemone("lev-tiny", LEV_QUESTIONS)),
    ("POST", "/v1/systemone", systemone("lev-base", LEV_QUESTIONS)),
    ("POST", "/v1/systemone", systemone("lev-tiny", {"q": {"type": "noul", "x_orderings": "none"}})),
    ("POST", "/v1/systemone", systemone("lev-tiny", {"q": {"type": "box"}})),
    ("POST", "/v1/systemone", systemone("nope", {"q": {"type": "noul"}})),
    ("POST", "/v1/systemone", systemone("jev-latest", {"q": {"type": "box"}})),
]
PHOTO = "<image:0123456789abcdef0123456789abcdef>"


def with_photo(questions: dict) -> dict:
    """A System One body showing the vision tests' noise image before the state."""
    import base64

    from tests.support.vision_reference import noise_png

    image = base64.b64encode(noise_png(29)).decode("ascii")
    body = systemone("jev-latest", questions)
    return {
        **body,
        "state": f"{PHOTO} {STATE}",
        "assets": {PHOTO: {"type": "image", "format": "png", "data_base64": image}},
    }


BOX_SCRIPT: list[tuple[str, str, dict | None]] = [
    ("GET", "/v1/models", None),
    (
        "POST",
        "/v1/systemone",
        with_photo({"where": {"type": "box", "instructions": "the error dialog"}, "ok": {"type": "noul"}}),
    ),
    ("POST", "/v1/systemone", with_photo({"where": {"type": "box", "x_orderings": "reversal"}})),
]


def masked(value: Any, key: str = "") -> Any:
    """`value` with what differs run to run replaced by MASKED."""
    if key.endswith("seconds") or key in ("release_date", "request_id"):
        return MASKED
    if isinstance(value, dict):
        return {k: masked(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v) for v in value]
    return value


def replies(service: Service, script: list[tuple[str, str, dict | None]]) -> list[dict]:
    """Each request of `script` against a fresh app over `service`: its status and masked body."""
    client = in_process_client(create_app(service))
    got = []
    for method, path, body in script:
        reply = client.request(method, path, json=body) if body is not None else client.request(method, path)
        got.append({"request": f"{method} {path}", "status": reply.status_code, "body": masked(reply.json())})
    return got


def calibration_file(root: Path) -> Path:
    path = root / "calibration.json"
    path.write_text(json.dumps(CALIBRATION), encoding="utf-8")
    return path


def recorded(engine, checkpoint, models: Path, vision_engine, vision_checkpoint, root: Path) -> dict:
    """The script's replies on the text checkpoint serving every kind of model, and the box
    script's on the vision checkpoint."""
    calibration = calibration_file(root)
    text = Service.start(make_settings(checkpoint, models=models, calibration=calibration), engine=engine)
    try:
        text_replies = replies(text, TEXT_SCRIPT)
    finally:
        text.engine.adapters.close()
    vision = Service.start(make_settings(vision_checkpoint, calibration=calibration), engine=vision_engine)
    return {"text": text_replies, "vision": replies(vision, BOX_SCRIPT)}


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Where `got` differs from `want`: keys or their order, types, strings, ints, or floats past 1e-5."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            return [
                f"{where}: keys {list(got) if isinstance(got, dict) else type(got).__name__} != {list(want)}"
            ]
        return [d for k in want for d in differences(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{where}: {got!r:.80} != {want!r:.80}"]
        return [
            d
            for i, (g, w) in enumerate(zip(got, want, strict=True))
            for d in differences(g, w, f"{where}[{i}]")
        ]
    if isinstance(want, float) and isinstance(got, float):
        return [] if math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-5) else [f"{where}: {got} != {want}"]
    if type(got) is not type(want) or got != want:
        return [f"{where}: {got!r:.200} != {want!r:.200}"]
    return []


def test_both_doors_answer_the_script_exactly_as_the_snapshot_records(
    engine, checkpoint, vision_engine, vision_checkpoint, tmp_path
):
    from tests.support.served_models import write_models_file

    models = write_models_file(checkpoint, tmp_path / "models", third_method=False)  # the built-in methods
    got = recorded(engine, checkpoint, models, vision_engine, vision_checkpoint, tmp_path)
    want = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    assert differences(got, want) == []


def test_the_comparison_sees_a_changed_key_order_a_string_and_a_float():
    want = {"a": 1.0, "b": "x"}
    assert differences({"b": "x", "a": 1.0}, want)
    assert differences({"a": 1.0, "b": "y"}, want)
    assert differences({"a": 1.001, "b": "x"}, want)
    assert not differences({"a": 1.000001, "b": "x"}, want)


def write() -> None:
    """Record the snapshot with the suite's own fixtures' files, in a temporary directory."""
    import tempfile

    from semif_serve.service.startup import load_engine
    from semif_serve.tools.demo import write_checkpoint
    from tests.support.served_models import write_models_file

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        checkpoint = write_checkpoint(root / "text")
        vision_checkpoint = write_checkpoint(root / "vision", multimodal=True)
        models = write_models_file(checkpoint, root / "models", third_method=False)
        got = recorded(
            load_engine(make_settings(checkpoint)),
            checkpoint,
            models,
            load_engine(make_settings(vision_checkpoint)),
            vision_checkpoint,
            root,
        )
    SNAPSHOT.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        pytest.exit("usage: python -m tests.doors.test_reply_snapshot --write")
    write()
