"""What the batch tests share: the settings both sides read, a batch file with every kind of
line, and the comparison of two results (numbers within 1e-6, timings left out)."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TextIO

from PIL import Image

from semif_serve.batch.job import BatchFiles, prepared, score_plan
from semif_serve.batch.progress import Summary
from semif_serve.batch.runner import Pacing
from semif_serve.service.settings import Settings
from semif_serve.service.startup import Service
from semif_serve.tools.demo import DEMO_LEV_MODEL

VENV_BIN = str(Path(sys.executable).parent)
#: Limits set low so that lines are refused by them, the same way for the service and the batch.
LIMITS = {"max_rows": 6, "max_body_bytes": 12_000}
# Fields that say how long or in which batch a request ran: never equal between two runs.
TIMING_FIELDS = {"x_timing", "timing", "forward_seconds", "total_seconds"}
TOLERANCE = 1e-6
OPTIONS = [{"id": "yes", "description": "It succeeded."}, {"id": "no", "description": "It failed."}]
BASE = "jev-latest"  # one of the base model's System One aliases
IMAGE = "<image:0123456789abcdef0123456789abcdef>"


def score_file(
    start: Callable[[], AbstractContextManager[Service]],
    files: BatchFiles,
    pacing: Pacing,
    stream: TextIO = sys.stderr,
    bar: bool | None = None,
    max_body_bytes: int = Settings.model_fields["max_body_bytes"].default,
) -> Summary:
    """The local job as run-batch runs it (`prepared`, then `score_plan`), over the files as given."""
    with prepared(files, max_body_bytes) as plan:
        return score_plan(start, plan, pacing, stream, bar)


def child_env(**settings: str) -> dict[str, str]:
    """This process's environment without SEMIF_* settings, the venv first on PATH, and `settings`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
    env["PATH"] = VENV_BIN + os.pathsep + env.get("PATH", "")
    env.update(settings)
    return env


def png(color: tuple[int, int, int], size: tuple[int, int] = (32, 32)) -> str:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def decide(state: str, question: str, n: int = 0) -> dict:
    return {"id": f"d{n}", "state": state, "question": question, "options": OPTIONS}


def systemone(model: str, state: str, questions: dict, **extra) -> dict:
    return {"model": model, "state": state, "questions": questions, **extra}


def line(custom_id: str, url: str, body: Any, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


STATES = [
    "Health checks passed in all three zones after release 41.",
    "The canary failed in zone b, then recovered within ten minutes.",
    "Error rates doubled for an hour; the rollback finished at noon.",
]
NOUL = {"ok": {"type": "noul", "instructions": "Did the deployment succeed?"}}
CHOICE = {
    "team": {"type": "choice", "instructions": "Who should look?", "criteria": {"network": None, "db": None}}
}
SCORE = {"sev": {"type": "score", "instructions": "How severe?", "criteria": ["low", "mid", "high"]}}


def answered_lines() -> list[str]:
    """Lines every route answers 200: native and System One, repeated states, images, lev."""
    lines = []
    for i, state in enumerate(STATES):
        lines.append(line(f"native-{i}-a", "/decide", decide(state, "Did the deployment succeed?", i)))
        lines.append(line(f"s1-{i}", "/v1/systemone", systemone(BASE, state, {**NOUL, **CHOICE})))
        lines.append(line(f"native-{i}-b", "/decide", decide(state, "Was a rollback needed?", i)))
        lines.append(line(f"lev-{i}", "/v1/systemone", systemone(DEMO_LEV_MODEL, state, {**NOUL, **SCORE})))
    questions = ("Is it done?", "Was it rolled back?")
    decisions = [{"id": f"d{i}", "question": q, "options": OPTIONS} for i, q in enumerate(questions)]
    shared = {"state": STATES[0], "decisions": decisions}
    lines.append(line("shared-0", "/decide/shared", shared))
    image = {IMAGE: {"type": "image", "format": "png", "data_base64": png((200, 30, 30))}}
    lines.append(
        line(
            "image-0",
            "/v1/systemone",
            systemone(
                BASE,
                f"A photo: {IMAGE}",
                {"red": {"type": "noul", "instructions": "Is it red?"}},
                assets=image,
            ),
        )
    )
    box = {"where": {"type": "box", "instructions": "the red square"}}
    lines.append(line("image-box", "/v1/systemone", systemone(BASE, f"A photo: {IMAGE}", box, assets=image)))
    return lines


def refused_lines() -> list[str]:
    """Lines refused by validation or a limit, as the route refuses them."""
    too_many = {
        "state": STATES[1],
        "decisions": [
            {"id": f"d{i}", "question": "Is it done?", "options": OPTIONS, "orderings": "rotations"}
            for i in range(4)
        ],
    }
    return [
        line("refused-422", "/v1/systemone", {"model": BASE}),
        line("refused-model", "/v1/systemone", systemone("no-such-model", STATES[0], NOUL)),
        # A key twice in the body: json.dumps cannot write it, the line is written by hand.
        '{"custom_id": "refused-dup-key", "method": "POST", "url": "/decide", '
        '"body": {"id": "a", "id": "b"}}',
        line("refused-rows", "/decide/shared", too_many),
        line("refused-size", "/decide", decide("x" * 13_000, "Is it long?")),
        line("refused-nan", "/decide", decide(STATES[0], "Q?") | {"state": float("nan")}),
    ]


#: Lines that never reach a route: (line, the path and body whose answer the service gives).
UNROUTED = [
    ("this is not JSON", "/decide", b"this is not JSON"),
    (line("unknown-url", "/v1/elsewhere", {}), "/v1/elsewhere", b"{}"),
    (line("wrong-method", "/decide", {}, method="GET"), "/decide", None),
]


def batch_file(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(f"{text}\n" for text in lines), encoding="utf-8")
    return path


def results(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]


def comparable(value: Any) -> Any:
    """`value` without its timing fields."""
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items() if k not in TIMING_FIELDS}
    if isinstance(value, list):
        return [comparable(v) for v in value]
    return value


def assert_close(got: Any, want: Any, where: str = "") -> None:
    """Equal structures, every number within TOLERANCE."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, got, want)
        for key in want:
            assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert isinstance(got, (int, float)) and math.isclose(got, want, rel_tol=0, abs_tol=TOLERANCE), (
            where,
            got,
            want,
        )
    else:
        assert got == want, (where, got, want)


def assert_same_results(got: list[dict], want: list[dict]) -> None:
    """Two runs' output lines: the same ids in the same order, each line equal but for timings."""
    assert [r["custom_id"] for r in got] == [r["custom_id"] for r in want]
    for g, w in zip(got, want, strict=True):
        assert_close(comparable(g), comparable(w), str(w["custom_id"]))


def run_batch(env: dict[str, str], *args: str, **kw) -> subprocess.CompletedProcess:
    """`semif-serve run-batch ARGS` in a child process with `env`."""
    return subprocess.run(
        ["semif-serve", "run-batch", *args], env=env, capture_output=True, text=True, timeout=300, **kw
    )
