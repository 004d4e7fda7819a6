"""The cost of a box question: four edge rows of 21 positions in the request's one batch.

    uv run python bench/box.py [--runs N]

Through the real app in process (httpx's ASGI transport: admission, the System One door, the
core, the engine), on the demo's tiny random-weight Qwen3.5 with a vision tower, over a state
holding one 224 x 224 image and ~1,000 tokens of text: the tokens of an edge row after the
shared state, and the median engine time (`x_timing.total_seconds`, a new state each run) of one
noul alone, one box alone, and a noul with a box in one request, side by side in one run; plus
the pair-rule readout alone.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from semif_serve.app import create_app
from semif_serve.domain.boxes import POSITIONS, read_box
from semif_serve.service.settings import Settings
from semif_serve.service.startup import Service
from semif_serve.tools.demo import DEMO_REVISION, write_checkpoint

TOKEN = "bench-token-0123456789"
PHOTO = "<image:0123456789abcdef0123456789abcdef>"
STATE = "The customer wrote in about a double charge on the March invoice and a failed refund. " * 60
NOUL = {"type": "noul", "instructions": "Is the customer asking for a refund?"}
BOX = {"type": "box", "instructions": "the invoice's total"}
CASES = {"noul": {"n": NOUL}, "box": {"b": BOX}, "noul + box": {"n": NOUL, "b": BOX}}


def photo(side: int = 224) -> str:
    """A PNG of random pixels, base64."""
    from PIL import Image

    rng = random.Random(side)
    raw = bytes(rng.getrandbits(8) for _ in range(side * side * 3))
    out = io.BytesIO()
    Image.frombytes("RGB", (side, side), raw).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode("ascii")


def ask(app, questions: dict, state: str, image: str) -> dict:
    """One System One request through the app; its JSON reply."""
    import httpx

    body = {
        "model": "jev-latest",
        "state": {"photo": PHOTO, "notes": state},
        "questions": questions,
        "assets": {PHOTO: {"type": "image", "format": "png", "data_base64": image}},
    }

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://bench", timeout=600) as client:
            reply = await client.post(
                "/v1/systemone", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
            )
        reply.raise_for_status()
        return reply.json()

    return asyncio.run(go())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    directory = write_checkpoint(Path(tempfile.mkdtemp(prefix="bench-box-")), multimodal=True)
    settings = Settings(
        model_path=directory,
        model_revision=DEMO_REVISION,
        device="cpu",
        api_token=TOKEN,
        systemone_orderings="none",
    )
    app = create_app(Service.start(settings))
    image = photo()
    reply = ask(app, CASES["box"], STATE, image)
    prefix = reply["x_timing"]["prefix_tokens"]
    edges = reply["answers"]["b"]["x_edges"].values()
    edge_rows = [edge["x_semif"]["input_tokens"] - prefix for edge in edges]
    print(f"state prefix (image included): {prefix} tokens; edge rows after it: {edge_rows} tokens")
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.runs):
        for name, questions in CASES.items():  # interleaved, a new state each time
            state = f"{uuid.uuid4().hex} {STATE}"
            times[name].append(ask(app, questions, state, image)["x_timing"]["total_seconds"])
    for name, seconds in times.items():
        print(f"{name}: median {statistics.median(seconds):.3f} s over {args.runs} ({seconds})")
    base = statistics.median(times["noul"])
    print(
        f"box / noul: {statistics.median(times['box']) / base:.2f}x; "
        f"noul + box / noul: {statistics.median(times['noul + box']) / base:.2f}x"
    )
    uniform = [1 / POSITIONS] * POSITIONS
    t0 = time.perf_counter()
    for _ in range(1000):
        read_box(uniform, uniform, uniform, uniform)
    print(f"pair-rule readout of one box: {(time.perf_counter() - t0) * 1e3:.3f} ms per 1000")


if __name__ == "__main__":
    main()
