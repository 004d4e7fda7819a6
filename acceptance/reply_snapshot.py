"""Record the replies of 6 native and 6 System One requests (timing fields masked), to compare two
commits of a refactor byte for byte on the demo checkpoint (fp32, CPU):

    uv run python acceptance/reply_snapshot.py /tmp/before.txt   # on the old commit
    uv run python acceptance/reply_snapshot.py /tmp/after.txt    # on the new one
    diff /tmp/before.txt /tmp/after.txt
"""

import asyncio
import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import httpx

from semif_serve.app import create_app
from semif_serve.service.settings import Settings
from semif_serve.service.startup import Service
from semif_serve.tools.demo import DEMO_REVISION, write_checkpoint

TIMING = {"forward_seconds", "total_seconds", "timing", "x_timing"}  # measured seconds: never equal


def mask(raw):
    text = raw.decode()
    text = re.sub(r'"timing":\{[^{}]*\}', '"timing":{}', text)
    return re.sub(r'"(\w+_seconds)":[0-9.eE+-]+', r'"\1":0', text)


def strip(v):
    if isinstance(v, dict):
        return {k: strip(x) for k, x in v.items() if k not in TIMING}
    if isinstance(v, list):
        return [strip(x) for x in v]
    return v


opts = [{"id": "yes", "description": "It succeeded."}, {"id": "no", "description": "It failed."}]
state = "Health checks passed in all three zones. Error rate 0.1%."
three = [{"id": k, "description": f"Route to {k}."} for k in ("billing", "auth", "infra")]
NATIVE = [
    ("/decide", {"id": "q1", "state": state, "question": "Did the deployment succeed?", "options": opts}),
    (
        "/decide",
        {"id": "q2", "state": state, "question": "Which queue?", "options": three, "orderings": "rotations"},
    ),
    (
        "/decide",
        {
            "id": "q3",
            "state": state,
            "question": "Did it?",
            "options": opts,
            "orderings": "all",
            "workload": "nonexistent",
        },
    ),
    (
        "/decide/shared",
        {
            "state": state,
            "decisions": [
                {"id": "a", "question": "Did the deployment succeed?", "options": opts},
                {"id": "b", "question": "Which queue?", "options": three, "orderings": "rotations"},
            ],
        },
    ),
    (
        "/decide/shared",
        {
            "state": state,
            "decisions": [
                {
                    "id": "a",
                    "question": "Q?",
                    "options": [{"id": f"o{i}", "description": f"d{i}"} for i in range(17)],
                }
            ],
        },
    ),
    (
        "/decide",
        {"id": "q6", "state": state, "question": "Bad", "options": [{"id": "x", "description": "only one"}]},
    ),
]
S1 = [
    {"model": "M", "state": state, "questions": {"ok": {"type": "noul"}}},
    {
        "model": "M",
        "state": {"log": state, "n": 3},
        "questions": {
            "q": {
                "type": "choice",
                "criteria": {"billing": None, "auth": "Login problems", "infra": "Servers"},
            }
        },
    },
    {
        "model": "M",
        "state": state,
        "questions": {"s": {"type": "score", "criteria": ["bad", "ok", "good"], "instructions": "Rate it."}},
    },
    {
        "model": "M",
        "state": state,
        "questions": {
            "a": {"type": "noul", "x_orderings": "none"},
            "b": {"type": "choice", "criteria": {"x": None, "y": None, "z": None}, "x_orderings": "all"},
            "c": {"type": "score", "criteria": ["1", "2"], "x_orderings": "reversal"},
        },
    },
    {"model": "not-a-model", "state": state, "questions": {"ok": {"type": "noul"}}},
    {"model": "M", "state": state, "questions": {"q": {"type": "choice", "criteria": {"only": None}}}},
]


async def main(out):
    tmp = Path(tempfile.mkdtemp())
    ckpt = write_checkpoint(tmp / "m")
    settings = Settings(
        model_path=ckpt, model_revision=DEMO_REVISION, device="cpu", api_token="snapshot-token-0123456789"
    )
    service = Service.start(settings)
    app = create_app(service)
    h = {"Authorization": "Bearer snapshot-token-0123456789", "X-Request-ID": "fixed-id"}
    lines = []
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        models = (await c.get("/v1/models", headers=h)).json()
        name = models["models"][0]["name"]
        for path, body in NATIVE:
            r = await c.post(path, json=body, headers=h)
            lines.append(f"{path} {r.status_code} {json.dumps(strip(r.json()))}")
            lines.append("RAW " + mask(r.content))
        for body in S1:
            body = {**body, "model": name if body["model"] == "M" else body["model"]}
            r = await c.post("/v1/systemone", json=body, headers=h)
            lines.append(f"/v1/systemone {r.status_code} {json.dumps(strip(r.json()))}")
            lines.append("RAW " + mask(r.content))
    Path(out).write_text("\n".join(lines) + "\n")


asyncio.run(main(sys.argv[1]))
