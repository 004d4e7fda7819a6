"""Issue 26's adapter speed over a loaded model, for `bench/adapters.py` on the CPU and `gpu_run`'s
adapters phase on a lent GPU: rows of a LoRA adapter vs rows of the base at the same work, and a
forward mixing 4 adapters vs a forward of one, each work's variants interleaved (machine load
falls on all alike), the median reported.

Works: (1) 8 rows of a ~24-token question over a prefilled ~1,000-token state (the suffix
forward of "8 choices over a ~1k-token state"); (2) that state's prefill; (3) one lone
~114-token row (a short noul's plain forward); (4) 8 lone ~114-token rows in one right-padded
forward. Mixed: 2 rows of each of 4 adapters (over each one's own state in (1)) vs 8 rows of one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LEV_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 32


def median_ms(samples: list[float]) -> float:
    return 1000 * statistics.median(samples)


def interleaved(
    variants: dict[str, Callable[[], Any]], reps: int, synchronize: Callable[[], None] = lambda: None
) -> dict[str, float]:
    """Median milliseconds of each variant, run in turn `reps` times after one warm-up each
    (`synchronize`: waits for the device, so a GPU's queued kernels count where they ran)."""
    for run in variants.values():
        run()
    synchronize()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, run in variants.items():
            t0 = time.perf_counter()
            run()
            synchronize()
            samples[name].append(time.perf_counter() - t0)
    return {name: median_ms(values) for name, values in samples.items()}


def random_adapter(model: Any, directory: Path, seed: int, rank: int = RANK, targets=LEV_TARGETS) -> Path:
    """A random LoRA adapter in PEFT's saved format over `model`'s Linear layers named in
    `targets` (A and B drawn, bfloat16 on a GPU build as the base is): for a base too large to
    copy into PEFT (the GPU run's Qwen3.5-4B geometry). `tests/engine/test_adapters.py` holds
    the bank to PEFT's own forward; this only has to cost what an adapter costs."""
    import json

    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    dtype = next(model.parameters()).dtype
    for name, module in model.named_modules():
        if (
            isinstance(module, torch.nn.Linear)
            and name.rsplit(".", 1)[-1] in targets
            and "visual" not in name
        ):
            a = torch.randn(rank, module.in_features, generator=generator) / module.in_features**0.5
            b = torch.randn(module.out_features, rank, generator=generator) * 0.02
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.to(dtype).contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.to(dtype).contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets)}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def measure(
    model: Any,
    adapters: list[Path],
    *,
    reps: int,
    detached: Any = None,
    state_tokens: int = 1000,
    synchronize: Callable[[], None] = lambda: None,
    allocated: Callable[[], int] = lambda: 0,
) -> dict[str, Any]:
    """Every work's median milliseconds per variant (base rows, adapter rows, 4 adapters mixed;
    `detached`: a copy of the base no adapter is attached to), the adapters' bytes and what
    loading them took on the device (`allocated`: the device's allocated bytes). The adapters
    are loaded into a bank over `model` and removed again at the end."""
    import torch

    from semif_serve.domain.requests import BASE
    from semif_serve.engine.adapters import AdapterBank, stacked_fork
    from semif_serve.engine.forwards import logits_over, prefill
    from semif_serve.engine.state_cache import StoredState

    pad = 0
    slots = list(range(32, 48))  # the rows the output head computes, as the engine reads 16 answer slots
    generator = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(10, 100_000, (n,), generator=generator).tolist()

    state, questions = ids(state_tokens), [ids(24) for _ in range(8)]
    lone, lones = ids(114), [ids(114) for _ in range(8)]

    def run_plain(rows: list[list[int]], over: Any = model) -> Any:
        with torch.inference_mode():
            return logits_over(over, None, 0, rows, pad, columns=slots)

    bank = AdapterBank(model)
    try:
        before = allocated()
        for i, directory in enumerate(adapters):
            bank.add(f"a{i}", directory)
        synchronize()
        delta = allocated() - before
        states = {}
        for adapter in (BASE, *range(len(adapters))):
            with bank.rows(adapter):
                states[adapter] = StoredState(state, prefill(model, state))

        def suffix(row_adapters: list[int]) -> Any:
            counts: list[tuple[Any, int]] = []
            for adapter in row_adapters:
                if counts and counts[-1][0] is states[adapter]:
                    counts[-1] = (states[adapter], counts[-1][1] + 1)
                else:
                    counts.append((states[adapter], 1))
            with bank.rows(row_adapters):
                return logits_over(model, stacked_fork(counts), len(state), questions, pad, columns=slots)

        def fill(adapter: int) -> Any:
            with bank.rows(adapter):
                return prefill(model, state)

        def lone_rows(row_adapters: list[int], rows: list[list[int]]) -> Any:
            with bank.rows(row_adapters):
                return run_plain(rows)

        mixed = [i // 2 for i in range(8)]
        works: dict[str, dict[str, Callable[[], Any]]] = {
            f"8 rows x 24 tokens over a {state_tokens:,}-token state (suffix forward)": {
                "base": lambda: suffix([BASE] * 8),
                "adapter": lambda: suffix([0] * 8),
                "4 adapters": lambda: suffix(mixed),
            },
            f"the {state_tokens:,}-token state's prefill": {
                "base": lambda: fill(BASE),
                "adapter": lambda: fill(0),
            },
            "1 lone 114-token row (plain forward)": {
                "base": lambda: lone_rows([BASE], [lone]),
                "adapter": lambda: lone_rows([0], [lone]),
            },
            "8 lone 114-token rows (one right-padded forward)": {
                "base": lambda: lone_rows([BASE] * 8, lones),
                "adapter": lambda: lone_rows([0] * 8, lones),
                "4 adapters": lambda: lone_rows(mixed, lones),
            },
        }
        if detached is not None:
            detached_state = StoredState(state, prefill(detached, state))
            extra = [
                lambda: logits_over(
                    detached, detached_state.fork(8), len(state), questions, pad, columns=slots
                ),
                lambda: prefill(detached, state),
                lambda: run_plain([lone], detached),
                lambda: run_plain(lones, detached),
            ]
            for variants, run in zip(works.values(), extra, strict=True):
                variants["detached"] = run
        measured = {work: interleaved(variants, reps, synchronize) for work, variants in works.items()}
        return {
            "adapter_bytes": bank.nbytes,
            "allocated_delta_bytes": delta,
            "adapters": len(adapters),
            "rank": RANK,
            "works": measured,
        }
    finally:
        bank.close()


def table(measured: dict[str, Any]) -> list[str]:
    """The markdown rows of `measure`'s result (goals: adapter / base <= 1.15x, mixed / one <= 1.3x)."""
    lines = [
        "| work | base, no adapter attached (ms) | base rows (ms) | adapter rows (ms) | adapter / base "
        "| 4 adapters mixed (ms) | mixed / one adapter |",
        "|---|---|---|---|---|---|---|",
    ]
    for work, ms in measured["works"].items():
        mixed_cells = (
            f"{ms['4 adapters']:.1f} | **{ms['4 adapters'] / ms['adapter']:.3f}x**"
            if "4 adapters" in ms
            else "- | -"
        )
        detached = f"{ms['detached']:.1f}" if "detached" in ms else "-"
        ratio = ms["adapter"] / ms["base"]
        cells = f"{detached} | {ms['base']:.1f} | {ms['adapter']:.1f} | **{ratio:.3f}x** | {mixed_cells}"
        lines.append(f"| {work} | {cells} |")
    return lines
