"""Rows over one prefix: each row whole vs one prefill of the prefix and the suffixes over it
(engine/sharing.py's rule), in process, one thread, on the peers' bench checkpoint.

    PYTHONPATH=src:. python bench/sharing.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from bench.peers import DEFAULT_MODEL_DIR, ensure_checkpoint
from semif_serve.engine.forwards import logits_over, prefill
from semif_serve.engine.sharing import prefill_pays
from semif_serve.engine.state_cache import StoredState

SHAPES = [(2, 20, 44), (2, 50, 46), (2, 80, 40), (2, 110, 35), (4, 50, 46), (8, 20, 44), (2, 300, 35)]
COLUMNS = [32, 33, 34]


def median_ms(run, repeats: int) -> float:
    seconds = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return round(statistics.median(seconds[1:]) * 1000, 1)  # the first call warms up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path = ensure_checkpoint(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, args.dtype)).eval()
    rng = random.Random(0)
    print("| rows | prefix | suffix | whole ms | shared ms | rule |")
    print("|---|---|---|---|---|---|")
    for rows, prefix_tokens, width in SHAPES:
        prefix = [rng.randrange(1000, 50000) for _ in range(prefix_tokens)]
        suffixes = [[rng.randrange(1000, 50000) for _ in range(width)] for _ in range(rows)]

        def whole(prefix: list[int] = prefix, suffixes: list[list[int]] = suffixes) -> None:
            logits_over(model, None, 0, [prefix + s for s in suffixes], 0, columns=COLUMNS)

        def shared(prefix: list[int] = prefix, suffixes: list[list[int]] = suffixes) -> None:
            state = StoredState(tuple(prefix), prefill(model, prefix))
            logits_over(model, state.fork(len(suffixes)), len(prefix), suffixes, 0, columns=COLUMNS)

        rule = "shared" if prefill_pays(prefix_tokens, prefix_tokens, rows, width) else "whole"
        print(
            f"| {rows} | {prefix_tokens} | {width} | {median_ms(whole, args.repeats)} "
            f"| {median_ms(shared, args.repeats)} | {rule} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
