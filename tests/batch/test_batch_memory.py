"""run-batch streams: up to where the model would load (`--check` stops there), its peak resident
memory stays under 256 MiB on an input and an output that each hold a 1 GiB line, and on a
1M-line input beside its 1M-line output. Measured as the ru_maxrss of a child whose only child is
`semif-serve run-batch`; the files are written here (the long lines sparse) and removed after."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import TOKEN
from tests.support.batch import child_env

pytestmark = pytest.mark.slow

LIMIT_MIB = 256
GIB = 1 << 30
# Runs the command it is given and prints that child's peak resident memory (KiB on Linux).
MEASURE = (
    "import resource, subprocess, sys\n"
    "done = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "raise SystemExit(done.returncode)"
)


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, str]:
    """Settings whose model directory is empty: nothing but the checks can run."""
    empty = tmp_path_factory.mktemp("no-model")
    return child_env(SEMIF_MODEL_PATH=str(empty), SEMIF_MODEL_REVISION="r", SEMIF_API_TOKEN=TOKEN)


def checked_peak(env: dict[str, str], source: Path, out: Path) -> tuple[subprocess.CompletedProcess, float]:
    """`run-batch --check -i source -o out` and its peak resident memory in MiB."""
    command = [sys.executable, "-c", MEASURE, "semif-serve", "run-batch", "-i", str(source), "-o", str(out)]
    done = subprocess.run([*command, "--check"], env=env, capture_output=True, text=True, timeout=300)
    return done, int(done.stdout.split()[-1]) / 1024


def result_id(custom_id: str) -> str:
    return "batch_req_" + hashlib.sha256(f"id:{custom_id}".encode()).hexdigest()[:24]


def write_sparse_line(path: Path, head: bytes, tail: bytes, more: bytes = b"") -> None:
    """`head`, a GiB of zero bytes (a hole: nothing is written), `tail`, then `more`."""
    with path.open("wb") as out:
        out.write(head)
        out.seek(GIB, os.SEEK_CUR)
        out.write(tail + more)


def test_a_gib_long_line_in_the_input_and_in_the_output_is_never_held(env, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    try:
        write_sparse_line(
            source,
            b'{"custom_id": "huge", "method": "POST", "url": "/decide", "body": {"state": "',
            b'"}}\n',
            b'{"custom_id": "small", "method": "POST", "url": "/decide", "body": {}}\n',
        )
        write_sparse_line(
            out,
            b'{"id":"' + result_id("huge").encode() + b'","custom_id":"huge","response":{"body":"',
            b'"}}\n',
        )
        done, peak = checked_peak(env, source, out)
        assert done.returncode == 0, done.stderr
        assert f"{source}: 2 lines, 1 already in {out}; the files are fine" in done.stderr
        assert peak < LIMIT_MIB, f"{peak:.0f} MiB"
    finally:
        source.unlink(missing_ok=True)
        out.unlink(missing_ok=True)


def test_a_million_line_input_and_its_million_line_output_are_streamed(env, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = 1_000_000
    try:
        with source.open("w") as inputs, out.open("w") as outputs:
            for start in range(0, lines, 10_000):
                names = [f"c{i}" for i in range(start, start + 10_000)]
                inputs.write("".join(f'{{"custom_id":"{name}"}}\n' for name in names))
                outputs.write("".join(f'{{"id":"{result_id(name)}"}}\n' for name in names))
        done, peak = checked_peak(env, source, out)
        assert done.returncode == 0, done.stderr
        assert f"{source}: {lines} lines, {lines} already in {out}; the files are fine" in done.stderr
        assert peak < LIMIT_MIB, f"{peak:.0f} MiB"
    finally:
        source.unlink(missing_ok=True)
        out.unlink(missing_ok=True)
