"""The state cache's payoff, engine-side: a question over a ~2,000-token state with a cold state
(prefill + suffix forward) vs a cached one (cache hit + suffix forward), and one state's bytes.

    uv run python bench/state_cache.py                 # tiny and bench checkpoints
    uv run python bench/state_cache.py --only tiny     # the test checkpoint only

Builds real prompts through the engine's codec (the state prefix the engine would prefill),
loads the checkpoints through the production loader, fp32 on CPU; reports medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SENTENCE = "The service returned errors for ten minutes after the release, then recovered. "
QUESTION = "Did the deployment succeed?"
OPTIONS = ("It succeeded.", "It failed.", "Unclear.")


def load(directory: Path):
    from semif_serve.service.settings import Settings
    from semif_serve.service.startup import load_engine
    from semif_serve.tools.demo import DEMO_REVISION

    return load_engine(
        Settings(
            model_path=directory,
            model_revision=DEMO_REVISION,
            device="cpu",
            api_token="bench-token-0123456789",
            max_input_tokens=8192,
        )
    )


def prompt_over_state(engine, target_tokens: int) -> tuple[list[int], list[int]]:
    """(state prefix ids, suffix ids) of one real prompt whose state is ~target_tokens long."""
    from semif_serve.engine.runner import shared_token_prefix

    state = SENTENCE * max(1, target_tokens // len(engine.codec.encode(SENTENCE)))
    prompt = engine.codec.encode_prompt(state, QUESTION, OPTIONS, "question")
    prefix = shared_token_prefix(engine.codec.state_prefix(state, prompt), [prompt])
    return prefix, prompt.ids[len(prefix) :]


def measure(engine, target_tokens: int, runs: int) -> dict:
    """Median engine seconds of a cold and a cached question, their ratio, and the state's bytes."""
    import torch

    from semif_serve.engine.forwards import prefill, suffix_logits
    from semif_serve.engine.state_cache import StateCache, StoredState

    prefix, suffix = prompt_over_state(engine, target_tokens)
    cache = StateCache(budget_bytes=1 << 34)
    cold_s, hit_s = [], []
    for _ in range(runs):
        cache.clear()
        t0 = time.perf_counter()
        state = cache.put(prefix, prefill(engine.model, prefix))
        cold = suffix_logits(engine.model, state, [suffix], engine.pad_id)
        cold_s.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        hit = cache.get(prefix)
        warm = suffix_logits(engine.model, hit, [suffix], engine.pad_id)
        hit_s.append(time.perf_counter() - t1)
        assert torch.allclose(cold, warm, atol=1e-5, rtol=0), "a cached state must score like a cold one"
    chunked = StoredState(prefix, prefill(engine.model, prefix, chunk_tokens=512))
    chunk_diff = (suffix_logits(engine.model, chunked, [suffix], engine.pad_id) - cold).abs().max().item()
    cold_med, hit_med = statistics.median(cold_s), statistics.median(hit_s)
    return {
        "prefix_tokens": len(prefix),
        "suffix_tokens": len(suffix),
        "cold_ms": cold_med * 1e3,
        "cached_ms": hit_med * 1e3,
        "ratio": cold_med / hit_med,
        # The fastest run of each is the least disturbed by other processes on a shared CPU.
        "ratio_of_fastest": min(cold_s) / min(hit_s),
        "state_bytes": state.nbytes,
        "chunked_512_max_abs_diff": chunk_diff,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("tiny", "bench"))
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    import torch

    from semif_serve.tools.demo import write_checkpoint

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    checkpoints = {}
    if args.only in (None, "tiny"):
        checkpoints["tiny"] = write_checkpoint(Path(tempfile.mkdtemp(prefix="semif-tiny-")))
    if args.only in (None, "bench"):
        from bench.run import bench_checkpoint

        checkpoints["bench"] = bench_checkpoint()
    print(f"state cache, cold vs cached question over a ~{args.tokens}-token state (median of {args.runs})")
    for name, directory in checkpoints.items():
        row = measure(load(directory), args.tokens, args.runs)
        print(
            f"{name:6s} prefix {row['prefix_tokens']} + suffix {row['suffix_tokens']} tokens: "
            f"cold {row['cold_ms']:.1f} ms, cached {row['cached_ms']:.1f} ms, ratio {row['ratio']:.1f}x "
            f"(fastest runs {row['ratio_of_fastest']:.1f}x), "
            f"state {row['state_bytes'] / 2**20:.2f} MiB, chunked(512) max|diff| "
            f"{row['chunked_512_max_abs_diff']:.1e}"
        )


if __name__ == "__main__":
    main()
