"""Issue 12's three measurements, side by side in one run, through the real decision core
(`harness.batching`).

    uv run python bench/batching.py                 # the bench checkpoint (cached after the first run)
    uv run python bench/batching.py --tiny --quick  # the test checkpoint, a smoke version

1. 16 concurrent clients of short distinct decisions vs 1 client: requests/s ratio, p50/p99;
2. the second question about a ~2,000-token state vs the first: engine time ratio;
3. 8 concurrent clients asking about the same state: prefills run (state cache misses).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the test checkpoint instead of the bench one")
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    args = parser.parse_args()
    from harness.batching import measure
    from semif_serve.service.settings import Settings
    from semif_serve.service.startup import Service
    from semif_serve.tools.demo import DEMO_REVISION, write_checkpoint

    if args.tiny:
        path = write_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    else:
        from bench.run import bench_checkpoint

        path = bench_checkpoint()
    settings = Settings(
        model_path=path, model_revision=DEMO_REVISION, device="cpu", api_token="bench-token-0123"
    )
    service = Service.start(settings)
    result = asyncio.run(measure(service, args.quick))
    for key, value in result.items():
        print(f"{key:>24}: {value:.3f}" if isinstance(value, float) else f"{key:>24}: {value}")
    service.worker.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
