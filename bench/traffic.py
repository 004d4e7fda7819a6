"""Issue 29's measurements, side by side in one run: the default (`SEMIF_DIRECT_PATH=reuse`)
against `SEMIF_DIRECT_PATH=plain` (and, given `--before`, the service at another checkout) on
the workloads real traffic brings; clients send the next request as soon as the answer arrives.

    python bench/traffic.py                      # every workload, default vs plain
    python bench/traffic.py --before /work/main  # ... and the service at that checkout beside them
    python bench/traffic.py --only keep          # the keep threshold: plain vs prefill+store+suffix

Workloads (each a ratio default/plain of throughput or latency, measured in one run):
- keep: engine seconds of a lone row on a new state of N tokens, plain forward vs the pass that
  ends at the state, stores it and goes on to the suffix (the threshold `keep_state_tokens`);
- sequential: one short noul per request, each over a new state (~40 and ~1,000 tokens);
- follow-up: a ~2,000-token state, the second question sent as soon as the first answer arrives;
- pause: the same, the second question 0.3 s after the first answer;
- eight: 8 concurrent /decide on one new ~2,000-token state vs one cold call;
- interleaved: 6 states x 4 questions in a random order under a cache of 3 states;
- clients16: 16 clients sending short /decide in a loop;
- stages: where a short request's time goes (parse, plan, encode, wait, forwards, readout, reply).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


SENTENCE = "The service returned errors for ten minutes after release {n}, then recovered in zone {z}. "
OPTIONS = [{"id": "yes", "description": "It succeeded."}, {"id": "no", "description": "It failed."}]
QUESTIONS = [f"Did step {i} of the rollout succeed?" for i in range(32)]


def state_of(tokens: int, tag: str) -> str:
    """A new state (unique by `tag`) of about `tokens` prompt tokens (~22 tokens a sentence)."""
    return f"[{tag}] " + "".join(SENTENCE.format(n=i, z=i % 5) for i in range(max(1, tokens // 22)))


def med_ms(values: list[float]) -> float:
    return round(1000 * statistics.median(values), 1)


# -- keep: the threshold, in process --------------------------------------------------------------


def keep_threshold(path: Path, sizes: list[int], rounds: int) -> dict[str, Any]:
    """Engine ms of one lone row on a new state of each size: plain vs the keeping pass."""
    from semif_serve.domain.types import PromptRow
    from semif_serve.engine.state_cache import StateCache
    from semif_serve.service.settings import Settings
    from semif_serve.service.startup import load_engine
    from semif_serve.tools.demo import DEMO_REVISION

    settings = Settings(model_path=path, model_revision=DEMO_REVISION, device="cpu", api_token="x" * 24)
    base = load_engine(settings)
    plain = base.with_options(cache=StateCache(0), prefill_chunk_tokens=2048, direct_path="plain")
    keep = base.with_options(cache=StateCache(1 << 33), prefill_chunk_tokens=2048, keep_state_tokens=1)
    row = PromptRow("Did the deployment succeed?", ("It succeeded.", "It failed."))
    out: dict[str, Any] = {}
    for size in sizes:
        seconds: dict[str, list[float]] = {"plain": [], "keep": []}
        for r in range(rounds + 1):
            state = state_of(size, f"keep {size} {r}")
            for name, engine in (
                (("plain", plain), ("keep", keep)) if r % 2 else (("keep", keep), ("plain", plain))
            ):
                t0 = time.perf_counter()
                engine.score(state, [row], shared=False, max_input_tokens=8192)
                if r:
                    seconds[name].append(time.perf_counter() - t0)
            keep.cache.clear()
        tokens = len(base.codec.encode(state_of(size, "x")))
        p, k = med_ms(seconds["plain"]), med_ms(seconds["keep"])
        out[str(tokens)] = {"plain_ms": p, "keep_ms": k, "ratio": round(k / p, 3)}
        print("keep", tokens, out[str(tokens)], flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="keep,sequential,follow,pause,eight,interleaved,clients16,stages")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import torch

    from bench.run import bench_checkpoint

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    path = bench_checkpoint()
    only = set(args.only.split(","))
    results: dict[str, Any] = {}
    if "keep" in only:
        results["keep"] = keep_threshold(path, [64, 128, 256, 512, 1024, 2048], args.rounds)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
