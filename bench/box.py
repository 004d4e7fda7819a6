"""The cost of a box question: four edge rows of 21 positions in the request's one batch.

    uv run python bench/box.py [--runs N]

In-process, on the bench checkpoint (bench/run.py), over a ~1,000-token text state (the engine
reads no images yet, so the edges are asked over text through the door's own mapping,
`core_questions` and `answers_of`): the tokens of an edge row after the shared state, and the
median engine time (`total_seconds`, new state each run) of one noul alone, one box alone, and
a noul with a box in one request, side by side in one run; plus the pair-rule readout alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.run import bench_checkpoint  # noqa: E402
from semif_serve.domain.boxes import POSITIONS, read_box  # noqa: E402
from semif_serve.doors.systemone.api import SystemOneDoor, answers_of, core_questions  # noqa: E402
from semif_serve.doors.systemone.schemas import parse_request  # noqa: E402
from semif_serve.service.settings import Settings  # noqa: E402
from semif_serve.service.startup import Service  # noqa: E402
from semif_serve.tools.demo import DEMO_REVISION  # noqa: E402

STATE = "The customer wrote in about a double charge on the March invoice and a failed refund. " * 60
NOUL = {"type": "noul", "instructions": "Is the customer asking for a refund?"}
BOX = {"type": "box", "instructions": "the invoice's total"}
CASES = {"noul": {"n": NOUL}, "box": {"b": BOX}, "noul + box": {"n": NOUL, "b": BOX}}


def ask(service: Service, door: SystemOneDoor, questions: dict, state: str):
    body = json.dumps({"model": "jev-latest", "state": state, "questions": questions}).encode()
    parsed = parse_request(body, door.max_options)
    asked = [core_questions(qid, q, door.policy) for qid, q in parsed.questions.items()]
    limits = door.limits
    outcome = asyncio.run(
        service.core.decide(
            state,
            [q for own in asked for q in own],
            shared=False,
            max_input_tokens=limits.max_input_tokens,
            max_options=limits.max_options,
            max_rows=limits.max_rows,
            max_request_tokens=limits.max_request_tokens,
        )
    )
    answers_of(parsed.questions, asked, outcome.questions)
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    settings = Settings(
        model_path=bench_checkpoint(),
        model_revision=DEMO_REVISION,
        device="cpu",
        api_token="bench-token-0123456789",
        systemone_orderings="none",
    )
    service = Service.start(settings)
    door = SystemOneDoor(service)
    outcome = ask(service, door, CASES["box"], STATE)
    assert outcome.timing is not None
    prefix = outcome.timing.prefix_tokens
    edge_rows = [r.input_tokens - prefix for q in outcome.questions for r in q.readouts]
    print(f"state prefix: {prefix} tokens; edge rows after it: {edge_rows} tokens")
    times: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.runs):
        for name, questions in CASES.items():  # interleaved, a new state each time
            state = f"{uuid.uuid4().hex} {STATE}"
            times[name].append(ask(service, door, questions, state).total_seconds)
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
