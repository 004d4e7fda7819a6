"""Rows over one prefix: each row whole vs one prefill of the prefix and the suffixes over it
(engine/sharing.py's rule), in process, one thread, on the peers' bench checkpoint.

    uv run python bench/sharing.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
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


def random_rows(
    rng: random.Random, prefix_tokens: int, rows: int, width: int
) -> tuple[list[int], list[list[int]]]:
    """A random prefix and `rows` random suffixes of `width` tokens (ids the tokenizer has)."""
    prefix = [rng.randrange(1000, 50000) for _ in range(prefix_tokens)]
    return prefix, [[rng.randrange(1000, 50000) for _ in range(width)] for _ in range(rows)]


def new_state_then_rows(model, prefix: list[int], suffixes: list[list[int]]) -> None:
    """A new state's prefill, then its suffix rows in one right-padded forward."""
    state = StoredState(tuple(prefix), prefill(model, prefix))
    logits_over(model, state.fork(len(suffixes)), len(prefix), suffixes, 0, columns=COLUMNS)


def table_row(*cells: object) -> None:
    """One markdown table row, printed at once (a long bench shows its rows as they come)."""
    print("| " + " | ".join(map(str, cells)) + " |", flush=True)


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
        prefix, suffixes = random_rows(rng, prefix_tokens, rows, width)

        def whole(prefix: list[int] = prefix, suffixes: list[list[int]] = suffixes) -> None:
            logits_over(model, None, 0, [prefix + s for s in suffixes], 0, columns=COLUMNS)

        shared = functools.partial(new_state_then_rows, model, prefix, suffixes)

        rule = "shared" if prefill_pays(prefix_tokens, prefix_tokens, rows, width) else "whole"
        table_row(
            rows, prefix_tokens, width, median_ms(whole, args.repeats), median_ms(shared, args.repeats), rule
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
