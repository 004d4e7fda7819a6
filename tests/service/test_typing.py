"""The type checker runs with the tests, so `uv run pytest` stays the one CI command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_finds_no_type_errors_in_the_service_source():
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-color-output", "src"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
