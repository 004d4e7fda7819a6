"""Issue 26's adapter speed, side by side in one run: rows of a LoRA adapter vs rows of the base
at the same work, and a forward mixing 4 adapters vs a forward of one.

    uv run python bench/adapters.py            # the bench checkpoint (cached after the first run)
    uv run python bench/adapters.py --quick    # fewer repetitions

The bench checkpoint (random weights, Qwen3.5's layer mix, hidden 384, 8 layers, the real
248,320-token vocabulary) loaded through the service's loader; 4 random rank-32 adapters
(lora_alpha 64, nonzero B) written by PEFT on the attention and MLP projections (lev's targets:
q/k/v/o of the full-attention layers, gate/up/down of every layer), served by
`engine.adapters.AdapterBank`, measured by `harness.adapters` (its works and variants).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from harness.adapters import LEV_TARGETS, RANK, measure, table

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def write_adapters(checkpoint: Path, root: Path, count: int) -> list[Path]:
    """`count` random rank-32 PEFT adapters over the checkpoint (B drawn nonzero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3_5ForCausalLM

    made = []
    for seed in range(count):
        torch.manual_seed(100 + seed)
        base = Qwen3_5ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=LEV_TARGETS))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.02)
        directory = root / f"adapter-{seed}"
        model.save_pretrained(str(directory))
        made.append(directory)
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: immune to a shared machine's oversubscription)",
    )
    args = parser.parse_args()
    import torch

    from bench.run import bench_checkpoint
    from semif_serve.engine.loader import CheckpointSpec, load_model

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    checkpoint = bench_checkpoint()
    spec = CheckpointSpec(checkpoint, "bench", "bench/base", "float32", "cpu")
    model = load_model(spec).model
    # A second copy of the base that no adapter is ever attached to: what the hooks cost on base rows.
    detached = load_model(spec).model
    reps = 5 if args.quick else 15
    with tempfile.TemporaryDirectory() as tmp:
        measured = measure(model, write_adapters(checkpoint, Path(tmp), 4), reps=reps, detached=detached)
    print(
        f"adapters: {measured['adapters']} x rank {RANK} on {', '.join(LEV_TARGETS)}; "
        f"{measured['adapter_bytes'] / 2**20:.1f} MiB"
    )
    print("\n".join(table(measured)))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {reps} repetitions (median); "
        f"load average {os.getloadavg()[0]:.1f}; {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
