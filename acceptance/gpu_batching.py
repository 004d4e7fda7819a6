"""Issue 12's three measurements at the real geometry on a GPU (random Qwen3.5-4B-shaped weights).

    uv run python -m acceptance.gpu_batching [--quick]

Builds a random-weight checkpoint of `demo.QWEN35_4B_SHAPE` (BF16) in a temporary directory,
starts the service's core on `cuda` under the default memory cap, and runs the measurements of
`bench/batching.py` (16 vs 1 clients, second question vs first over a ~2,000-token state, prefills
for 8 clients over one state). Needs one visible CUDA device.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    """Build the checkpoint, start the core on cuda, print the three measurements."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    args = parser.parse_args(argv)
    from bench.batching import measure
    from semif_serve.service.settings import Settings
    from semif_serve.service.startup import Service
    from semif_serve.tools.demo import DEMO_REVISION, QWEN35_4B_SHAPE, write_checkpoint

    path = write_checkpoint(Path(tempfile.mkdtemp()) / "qwen35-4b-random", QWEN35_4B_SHAPE)
    settings = Settings(
        model_path=path, model_revision=DEMO_REVISION, device="cuda", api_token="gpu-bench-token"
    )
    service = Service.start(settings)
    for key, value in asyncio.run(measure(service, args.quick)).items():
        print(f"{key:>24}: {value:.3f}" if isinstance(value, float) else f"{key:>24}: {value}")
    service.worker.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
