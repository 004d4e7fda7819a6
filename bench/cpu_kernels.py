"""The engine's CPU linear-attention kernels vs transformers' reference code, in process, one
thread, on the peers' bench checkpoint: the forwards of the peers' two workloads (a new state
then its suffix rows), the same model loaded twice by the production loader
(SEMIF_CPU_KERNELS on and off), rounds alternating the two.

    uv run python bench/cpu_kernels.py
    uv run python bench/cpu_kernels.py --where   # where a short noul's forwards spend their time
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from bench.peers import DEFAULT_MODEL_DIR, ensure_checkpoint
from bench.sharing import median_ms, new_state_then_rows, random_rows, table_row
from semif_serve.engine.loader import load_model
from semif_serve.service.settings import Settings
from semif_serve.service.startup import checkpoint_spec

# (name, dtype, state tokens, rows, suffix tokens): bench/peers.py's workloads as the engine runs them.
WORKLOADS = [
    ("8 choices, new ~1k state", "float32", 1074, 8, 51),
    ("1 short noul, new state (2 orders)", "bfloat16", 77, 2, 34),
    ("1 short noul, new state (1 order)", "float32", 77, 1, 34),
]


def time_by_part(model: Any, run: Any, repeats: int) -> dict[str, float]:
    """Milliseconds per run spent inside each kind of decoder part (a layer's attention, MLP,
    norms and a linear-attention layer's projections; parts nest), from forward hooks."""
    totals: dict[str, float] = defaultdict(float)
    started: dict[int, float] = {}

    def part_of(name: str) -> str | None:
        leaf, parent = name.split(".")[-1], name.split(".")[-2] if "." in name else ""
        if parent == "linear_attn":
            return f"linear_attn.{leaf}"
        return (
            leaf
            if leaf in {"linear_attn", "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
            else None
        )

    def hooked(part: str, module: Any) -> None:
        def entered(*_: Any) -> None:
            started[id(module)] = time.perf_counter()

        def left(*_: Any) -> None:
            totals[part] += time.perf_counter() - started.pop(id(module))

        module.register_forward_pre_hook(entered)
        module.register_forward_hook(left)

    decoder = model.get_decoder()
    hooked("decoder", decoder)
    for name, module in decoder.named_modules():
        if name.startswith("layers.") and (part := part_of(name)) is not None:
            hooked(part, module)
    run()  # warm-up
    totals.clear()
    for _ in range(repeats):
        run()
    return {part: 1000 * seconds / repeats for part, seconds in totals.items()}


def where(path: Path, repeats: int) -> int:
    """The short noul of the lev workload (bf16, two orders) on the own kernels, by part."""
    _, dtype, state_tokens, rows, width = WORKLOADS[1]
    model = load_model(
        checkpoint_spec(Settings(model_path=path, model_revision="bench", device="cpu", dtype=dtype))
    ).model
    rng = random.Random(0)
    prefix, suffixes = random_rows(rng, state_tokens, rows, width)
    parts = time_by_part(model, functools.partial(new_state_then_rows, model, prefix, suffixes), repeats)
    print(f"| part ({WORKLOADS[1][0]}, {dtype}) | ms per request |")
    print("|---|---|")
    for part, ms in sorted(parts.items(), key=lambda item: -item[1]):
        print(f"| {part} | {ms:.2f} |")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--where", action="store_true", help="time by decoder part instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = ensure_checkpoint(args.model)
    if args.where:
        return where(path, 4 * args.repeats)
    rng = random.Random(0)
    print("| workload | dtype | reference ms (by round) | own kernels ms (by round) | reference/own |")
    print("|---|---|---|---|---|")
    for name, dtype, state_tokens, rows, width in WORKLOADS:
        models = {
            kernels: load_model(
                checkpoint_spec(
                    Settings(
                        model_path=path,
                        model_revision="bench",
                        device="cpu",
                        dtype=dtype,
                        cpu_kernels=kernels,
                    )
                )
            ).model
            for kernels in (False, True)
        }
        prefix, suffixes = random_rows(rng, state_tokens, rows, width)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for kernels, model in models.items():
                run = functools.partial(new_state_then_rows, model, prefix, suffixes)
                times[kernels].append(median_ms(run, args.repeats))
        ratio = sum(times[False]) / sum(times[True])
        table_row(
            name,
            dtype,
            " / ".join(map(str, times[False])),
            " / ".join(map(str, times[True])),
            f"{ratio:.2f}x",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
