"""Issue 21's measurements, side by side in one run: a lone question at the plain forward's cost,
follow-ups from the cache on every door, what the cache keeps, and where the time goes.

    uv run python bench/reuse.py            # the bench checkpoint (hidden 384, 8 layers, 248k vocab)
    uv run python bench/reuse.py --quick    # fewer rounds
    uv run python bench/reuse.py --tiny     # the test checkpoint (a smoke run)

1. a lone question on a new ~2,000-token state (and on a short one), engine time: the reuse
   path (`SEMIF_DIRECT_PATH=reuse`, the default) vs SemIf's plain forward (`plain`), and the
   shared path's two forwards (prefill + suffix) on the same prompt, interleaved (goal <= 1.05x
   the plain forward);
2. the second question about a ~2,000-token state vs the first, end to end over HTTP (real
   uvicorn on loopback), `/decide` and System One (goal >= 5x);
3. 8 concurrent `/decide` clients about one new state vs one cold call (goal < 2x, one prefill);
4. S states x Q questions (with orderings) in a random interleaving under a budget of S/2 states:
   state hits vs an ideal LRU of states over the same sequence (goal >= 0.9 of it);
5. the per-stage breakdown of a short noul and of 8 choices over a ~1,000-token state;
6. (`--only back`, issue 39) three lone questions in a row about a new ~1,100-word state (under
   `SEMIF_KEEP_STATE_TOKENS`): the first runs the plain forward and remembers the state's key, the
   second keeps it, the third reads it from the cache (goal: third >= 3x cheaper than the first);
   and a state asked about once against `SEMIF_DIRECT_PATH=plain` (goal: no dearer), interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx

from harness.server import LoopbackServer
from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.engine.batching import Bounds, plan_groups
from semif_serve.engine.state_cache import STATE, StateCache

TOKEN = "bench-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SENTENCE = "The service returned errors for ten minutes after release {n}, then recovered in zone {z}. "
OPTIONS = ({"id": "yes", "description": "It succeeded."}, {"id": "no", "description": "It failed."})


def state_of(engine, tokens: int, tag: str) -> str:
    """A new state (unique by `tag`) of about `tokens` prompt tokens."""
    per = len(engine.codec.encode(SENTENCE.format(n=0, z=0)))
    return f"[{tag}] " + "".join(SENTENCE.format(n=i, z=i % 5) for i in range(max(1, tokens // per)))


def med_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


# -- 1. a lone question -------------------------------------------------------------------------


def lone_question(engine, tokens: int, rounds: int) -> dict[str, Any]:
    """Engine seconds of one row on a new state: reuse vs plain vs the shared path's two forwards."""
    import torch

    reuse = engine.with_options(cache=StateCache(1 << 34), prefill_chunk_tokens=2048, direct_path="reuse")
    plain = engine.with_options(cache=StateCache(0), prefill_chunk_tokens=2048, direct_path="plain")
    shared = engine.with_options(cache=StateCache(0), prefill_chunk_tokens=2048)
    row = PromptRow("Did the deployment succeed?", ("It succeeded.", "It failed."))
    seconds: dict[str, list[float]] = {"reuse": [], "plain": [], "shared": []}
    diffs = []
    for r in range(rounds + 1):
        state = state_of(engine, tokens, f"lone {r}")
        out = {}
        for name, eng in (("plain", plain), ("reuse", reuse), ("shared", shared)):
            readout = eng.read(RowsRequest.of(state, [row], shared=name == "shared", max_input_tokens=8192))
            out[name] = readout
            if r:  # the first round warms up
                seconds[name].append(readout.total_seconds)
        a = torch.tensor(out["reuse"].rows[0].option_logits)
        b = torch.tensor(out["plain"].rows[0].option_logits)
        c = torch.tensor(out["shared"].rows[0].option_logits)
        diffs.append(max((a - b).abs().max().item(), (c - b).abs().max().item()))
        assert out["reuse"].rows[0].prompt_sha256 == out["plain"].rows[0].prompt_sha256
    prompt_tokens = out["plain"].rows[0].input_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "reuse_ms": med_ms(seconds["reuse"]),
        "plain_ms": med_ms(seconds["plain"]),
        "shared_ms": med_ms(seconds["shared"]),
        "reuse_vs_plain": statistics.median(seconds["reuse"]) / statistics.median(seconds["plain"]),
        "shared_vs_plain": statistics.median(seconds["shared"]) / statistics.median(seconds["plain"]),
        # The fastest run of each is the least disturbed by other processes on a shared CPU.
        "fastest_reuse_vs_plain": min(seconds["reuse"]) / min(seconds["plain"]),
        "fastest_shared_vs_plain": min(seconds["shared"]) / min(seconds["plain"]),
        "max_abs_diff_vs_plain": max(diffs),
    }


# -- 6. a client that comes back ---------------------------------------------------------------


def words_state(words: int, tag: str) -> str:
    """A new state (unique by `tag`) of `words` words."""
    sentence = SENTENCE.format(n=0, z=0)
    per = len(sentence.split())
    return f"[{tag}] " + "".join(SENTENCE.format(n=i, z=i % 5) for i in range(max(1, words // per)))


def comes_back(engine, words: int, rounds: int) -> dict[str, Any]:
    """Engine seconds of three lone questions in a row about one new state, and of a one-off
    state on the default path against the plain forward (each round a new state, interleaved)."""
    kept = engine.with_options(cache=StateCache(1 << 32), prefill_chunk_tokens=2048)
    plain = engine.with_options(cache=StateCache(0), prefill_chunk_tokens=2048, direct_path="plain")
    questions = [
        PromptRow(q, ("It succeeded.", "It failed."))
        for q in ("Did the deployment succeed?", "Was it rolled back?", "Did it page anyone?")
    ]
    visits: list[list[float]] = [[], [], []]
    one_off: dict[str, list[float]] = {"default": [], "plain": []}
    prefills: list[str] = []
    tokens = 0
    for r in range(rounds + 1):
        state = words_state(words, f"back {r}")
        for i, row in enumerate(questions):
            readout = kept.read(RowsRequest.of(state, [row], shared=False, max_input_tokens=8192))
            tokens = readout.rows[0].input_tokens
            if r:
                visits[i].append(readout.total_seconds)
                prefills.append(readout.timing.prefill)
        other = words_state(words, f"once {r}")
        for name, eng in (
            (("plain", plain), ("default", kept)) if r % 2 else (("default", kept), ("plain", plain))
        ):
            readout = eng.read(RowsRequest.of(other, [questions[0]], shared=False, max_input_tokens=8192))
            if r:
                one_off[name].append(readout.total_seconds)
    first, second, third = (statistics.median(v) for v in visits)
    return {
        "words": words,
        "prompt_tokens": tokens,
        "first_ms": 1000 * first,
        "second_ms": 1000 * second,
        "third_ms": 1000 * third,
        "first_over_third": first / third,
        "per_round_first_over_third": [a / b for a, b in zip(visits[0], visits[2], strict=True)],
        "prefills": prefills[:3],
        "one_off_default_ms": med_ms(one_off["default"]),
        "one_off_plain_ms": med_ms(one_off["plain"]),
        "one_off_default_over_plain": statistics.median(one_off["default"])
        / statistics.median(one_off["plain"]),
    }


# -- 2. and 3. over HTTP ------------------------------------------------------------------------


def settle(client: httpx.Client) -> dict[str, Any]:
    for _ in range(3000):
        cache = client.get("/health").json()["state_cache"]
        if cache.get("deferred_prefills", 0) == 0:  # a tree before #29 queued idle prefills
            return cache
        time.sleep(0.01)
    raise RuntimeError("the idle prefill never finished")


def timed_post(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    response = client.post(path, json=body, headers=AUTH)
    elapsed = time.perf_counter() - t0
    response.raise_for_status()
    return response.json(), elapsed


def decide(state: str, question: str) -> dict[str, Any]:
    return {"id": "d", "state": state, "question": question, "options": list(OPTIONS)}


def systemone(state: str, question: str) -> dict[str, Any]:
    noul = {"type": "noul", "instructions": question, "x_orderings": "none"}
    return {"model": "jev-latest", "state": state, "questions": {"q": noul}}


def follow_ups(client: httpx.Client, engine, tokens: int, rounds: int) -> dict[str, Any]:
    """First vs second question about a new state, end to end, on both doors."""
    out: dict[str, Any] = {}
    doors = {"/decide": ("/decide", decide), "System One": ("/v1/systemone", systemone)}
    for name, (path, body) in doors.items():
        first, second = [], []
        for r in range(rounds):
            state = state_of(engine, tokens, f"{name} follow-up {r}")
            _, t1 = timed_post(client, path, body(state, "Did the deployment succeed?"))
            settle(client)
            before = client.get("/health").json()["state_cache"]["by_kind"][STATE]["hits"]
            _, t2 = timed_post(client, path, body(state, "Was the release rolled back?"))
            after = client.get("/health").json()["state_cache"]["by_kind"][STATE]["hits"]
            assert after == before + 1, "the follow-up must find its state"
            first.append(t1)
            second.append(t2)
        out[name] = {
            "first_ms": med_ms(first),
            "second_ms": med_ms(second),
            "ratio": statistics.median(first) / statistics.median(second),
        }
    return out


def concurrent_eight(client: httpx.Client, url: str, engine, tokens: int, rounds: int) -> dict[str, Any]:
    """8 concurrent /decide about one new state vs one cold /decide on another new state."""
    cold, together, prefills = [], [], []
    for r in range(rounds):
        settle(client)
        _, t = timed_post(client, "/decide", decide(state_of(engine, tokens, f"cold {r}"), "Did it succeed?"))
        cold.append(t)
        settle(client)
        state = state_of(engine, tokens, f"eight {r}")
        misses = client.get("/health").json()["state_cache"]["by_kind"][STATE]["misses"]
        barrier = threading.Barrier(8)
        errors: list[BaseException] = []

        def one(
            i: int, state: str = state, barrier: threading.Barrier = barrier, errors: list = errors
        ) -> None:
            with httpx.Client(base_url=url, timeout=600) as c:
                barrier.wait()
                try:
                    timed_post(c, "/decide", decide(state, f"Did step {i} of the rollout succeed?"))
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        t0 = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        together.append(time.perf_counter() - t0)
        if errors:
            raise errors[0]
        settle(client)
        prefills.append(client.get("/health").json()["state_cache"]["by_kind"][STATE]["misses"] - misses)
    return {
        "cold_ms": med_ms(cold),
        "eight_ms": med_ms(together),
        "ratio": statistics.median(together) / statistics.median(cold),
        "prefills": prefills,
    }


# -- 4. what the cache keeps --------------------------------------------------------------------


def ideal_lru_hits(sequence: list[int], capacity: int) -> int:
    """Hits of an LRU that holds `capacity` states and nothing else, over the same sequence."""
    held: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for s in sequence:
        if s in held:
            hits += 1
            held.move_to_end(s)
        else:
            held[s] = None
            if len(held) > capacity:
                held.popitem(last=False)
    return hits


def interleaved(engine, n_states: int, n_questions: int, tokens: int, seed: int = 21) -> dict[str, Any]:
    """S states x Q questions (rotations of 3 options), seeded random order, a budget of S/2 states."""
    states = [state_of(engine, tokens, f"interleaved {s}") for s in range(n_states)]

    def rows(q: int) -> list[PromptRow]:
        opts = [f"Option {k} for question {q}." for k in range(3)]
        return [PromptRow(f"Which option fits question {q}?", tuple(opts[k:] + opts[:k])) for k in range(3)]

    probe = engine.with_options(cache=StateCache(1 << 34), prefill_chunk_tokens=2048)
    sizes = []
    for state in states:
        probe.cache.clear()
        probe.read(RowsRequest.of(state, rows(0)[:1], shared=True, max_input_tokens=8192))
        sizes.append(probe.cache.stats().bytes)
    capacity = n_states // 2
    budget = capacity * max(sizes) + max(sizes) // 2
    sequence = [s for s in range(n_states) for _ in range(n_questions)]
    random.Random(seed).shuffle(sequence)
    asked = [0] * n_states
    cached = engine.with_options(cache=StateCache(budget), prefill_chunk_tokens=2048)
    for s in sequence:
        cached.read(RowsRequest.of(states[s], rows(asked[s]), shared=False, max_input_tokens=8192))
        asked[s] += 1
    stats = cached.cache.stats()
    ideal = ideal_lru_hits(sequence, capacity)
    return {
        "requests": len(sequence),
        "budget_states": capacity,
        "state_hits": stats.by_kind[STATE].hits,
        "ideal_lru_hits": ideal,
        "ratio": stats.by_kind[STATE].hits / ideal if ideal else float("nan"),
        "question_entries": stats.by_kind["question"].entries,
        "evictions": stats.evictions,
    }


# -- 5. where the time goes ---------------------------------------------------------------------


def stages(service, body: dict[str, Any], rounds: int, tag: str) -> dict[str, float]:
    """Median milliseconds per stage of one System One request on a new state, on this thread:
    the door's parse, the method's plan, its job's encoding, the batch plan, the forwards, the
    method's outcome and the reply."""
    from semif_serve.doors.systemone import api as s1
    from semif_serve.doors.systemone.mapping import answers_of, asked_questions, timing_block, usage_of
    from semif_serve.doors.systemone.schemas import SystemOneResponse, parse_request
    from semif_serve.service.methods import Ask

    door = s1.SystemOneDoor(service)
    engine = service.engine
    per: dict[str, list[float]] = {}
    for r in range(rounds + 1):
        raw = json.dumps({**body, "state": f"[{tag} {r}] " + body["state"]}).encode()
        marks = [("start", time.perf_counter())]
        parsed = parse_request(raw, door.max_options)
        served = door.served(parsed.model)
        assert served is not None, parsed.model
        method = served.method
        asked = asked_questions(parsed.questions)
        ask = Ask(served, parsed.state, asked, door.limits, defaults=door.defaults, named=served.name)
        marks.append(("parse", time.perf_counter()))
        plan = method.plan(ask)
        marks.append(("plan", time.perf_counter()))
        (rows_job,) = method.jobs(plan, engine)  # SemIf's method: one job, every row over the state
        prepared = rows_job.prepare()
        marks.append(("encode", time.perf_counter()))
        job = prepared.job(r)
        groups = plan_groups([job], Bounds())
        marks.append(("batch plan", time.perf_counter()))
        scored = []
        runs = []
        for group in groups:
            result = engine.run_group(group)[job.id]
            scored.extend(result)
            runs.append(result[0].run)
        marks.append(("forward", time.perf_counter()))
        decided = method.outcome(plan, [engine.readout(prepared, scored)])
        marks.append(("readout", time.perf_counter()))
        assert decided.answers is not None
        reply = SystemOneResponse(
            model=served.name,
            answers=answers_of(list(parsed.questions), decided.answers, method),
            usage=usage_of(decided),
            x_timing=timing_block(decided),
        )
        json.dumps(reply.model_dump(mode="json", exclude_unset=True))
        marks.append(("reply", time.perf_counter()))
        if not r:
            continue
        for (_, a), (name, b) in zip(marks, marks[1:], strict=False):
            per.setdefault(name, []).append(b - a)
        run = runs[0]
        split = {
            "  prefill": run.prefill_seconds,
            "  fork": run.replicate_seconds,
            "  suffix forward" if not run.direct else "  plain forward": run.suffix_forward_seconds,
        }
        for name, value in split.items():
            per.setdefault(name, []).append(value)
    return {name: med_ms(values) for name, values in per.items()} | {
        "rows": len(prepared.prompts),
        "prompt_tokens": max(len(p.ids) for p in prepared.prompts),
    }


def breakdown(service, engine, rounds: int) -> dict[str, Any]:
    noul = {
        "model": "jev-latest",
        "state": "Health checks passed in all three zones after the deploy.",
        "questions": {
            "ok": {"type": "noul", "instructions": "Did the deployment succeed?", "x_orderings": "none"}
        },
    }
    eight = {
        "model": "jev-latest",
        "state": state_of(engine, 1000, "eight choices"),
        "questions": {
            f"c{i}": {
                "type": "choice",
                "instructions": f"Which team owns follow-up {i}?",
                "criteria": {"platform": None, "payments": None, "search": None},
                "x_orderings": "none",
            }
            for i in range(8)
        },
    }
    return {
        "short noul": stages(service, noul, rounds, "noul"),
        "8 choices, ~1k-token state": stages(service, eight, rounds, "eight"),
    }


# -- the run ------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the test checkpoint instead of the bench one")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--only", default="lone,short,follow,eight,interleaved,stages")
    args = parser.parse_args()
    import torch

    from semif_serve.app import create_app
    from semif_serve.service.settings import Settings
    from semif_serve.service.startup import Service
    from semif_serve.tools.demo import DEMO_REVISION, write_checkpoint

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if args.tiny:
        path = write_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    else:
        from bench.run import bench_checkpoint

        path = bench_checkpoint()
    rounds = 2 if args.quick else 5
    only = set(args.only.split(","))
    settings = Settings(
        model_path=path,
        model_revision=DEMO_REVISION,
        device="cpu",
        api_token=TOKEN,
        max_input_tokens=8192,
    )
    started = time.perf_counter()
    load = os.getloadavg()[0]
    service = Service.start(settings)
    engine = service.engine
    results: dict[str, Any] = {}
    if "lone" in only:
        results["lone"] = lone_question(engine, 2000, rounds)
        print("lone", results["lone"], flush=True)
    if "short" in only:
        results["lone_short"] = lone_question(engine, 40, 3 * rounds)
        print("lone short", results["lone_short"], flush=True)
    if only & {"follow", "eight"}:
        with (
            LoopbackServer(create_app(service)) as server,
            httpx.Client(base_url=server.url, timeout=600) as client,
        ):
            if "follow" in only:
                results["follow"] = follow_ups(client, engine, 2000, max(2, rounds // 2 + 1))
                print("follow", results["follow"], flush=True)
            if "eight" in only:
                results["eight"] = concurrent_eight(client, server.url, engine, 2000, max(2, rounds // 2 + 1))
                print("eight", results["eight"], flush=True)
    if "back" in only:
        results["back"] = comes_back(engine, 1100, rounds)
        print("back", results["back"], flush=True)
    if "interleaved" in only:
        results["interleaved"] = interleaved(engine, 6, 4, 300)
        print("interleaved", results["interleaved"], flush=True)
    if "stages" in only:
        results["stages"] = breakdown(service, engine, rounds)
        print("stages", json.dumps(results["stages"], indent=1), flush=True)
    service.worker.shutdown()
    print(
        f"\nissue 21 bench: {'tiny' if args.tiny else 'bench'} checkpoint, fp32 CPU, torch "
        f"{torch.__version__} ({torch.get_num_threads()} threads); {time.perf_counter() - started:.0f} s; "
        f"load average before/after {load:.2f}/{os.getloadavg()[0]:.2f}"
    )
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
