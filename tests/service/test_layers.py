"""The package's layers are enforced: import-linter's contracts (pyproject.toml) hold on the tree,
and the same contracts fail on a copy with a forbidden import or a cycle; so does the one-way
harness (`bench` and `acceptance` over `harness` over `semif_serve`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
TOOLS = ("harness", "bench", "acceptance")  # the root packages beside src/semif_serve


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the packages under `root/src` and `root` (harness, bench, acceptance), with
    the project's own contracts."""
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def copy_of_the_tree(tmp_path: Path) -> Path:
    for tree in ("src", *TOOLS):
        shutil.copytree(ROOT / tree, tmp_path / tree, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_import(root: Path, module: str, statement: str) -> None:
    """Append `statement` to `module` (dotted, from its root package) in the copy under `root`."""
    base = root if module.split(".")[0] in TOOLS else root / "src"
    path = base / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{statement}  # noqa\n")


def test_every_import_in_the_package_runs_down_the_layers_and_no_module_cycles() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "module,statement,broken",
    [
        ("semif_serve.domain.numerics", "import semif_serve.engine.runner", "runs down the layers"),
        ("semif_serve.engine.memory", "from semif_serve.service import settings", "runs down the layers"),
        ("semif_serve.doors.systemone.api", "import semif_serve.doors.native.api", "two doors know nothing"),
        ("semif_serve.tools.calibration_fit", "import semif_serve.tools.cli", "its way back to itself"),
        ("semif_serve.domain.numerics", "import fastapi", "nothing but the standard library"),
        ("semif_serve.domain.boxes", "import numpy", "nothing but the standard library"),
        ("harness.report", "import bench.run", "over the harness over semif_serve"),
        ("acceptance.cli", "from bench import gateway", "over the harness over semif_serve"),
        ("bench.gateway", "import acceptance.common", "over the harness over semif_serve"),
        # Another root package is no standard library either: the domain's own contract says so too.
        ("semif_serve.domain.numerics", "import harness.stats", "nothing but the standard library"),
    ],
    ids=[
        "domain_imports_engine",
        "engine_imports_service",
        "door_imports_door",
        "cycle_in_tools",
        "domain_imports_fastapi",
        "domain_imports_numpy_outside_images",
        "harness_imports_bench",
        "acceptance_imports_bench",
        "bench_imports_acceptance",
        "domain_imports_harness",
    ],
)
def test_a_forbidden_import_or_a_cycle_breaks_a_contract(copy_of_the_tree, module, statement, broken) -> None:
    add_import(copy_of_the_tree, module, statement)
    result = lint(copy_of_the_tree)
    assert result.returncode == 1
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout


@pytest.mark.parametrize(
    "command",
    [["bench/peers.py", "--help"], ["-m", "bench.threads", "--help"], ["-m", "acceptance", "--help"]],
    ids=["bench_script", "bench_module", "acceptance_module"],
)
def test_the_tools_import_as_packages_with_no_pythonpath(tmp_path: Path, command: list[str]) -> None:
    # From another directory and with PYTHONPATH unset: only the editable install's path finds them.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    argv = [str(ROOT / command[0]), *command[1:]] if command[0].endswith(".py") else command
    done = subprocess.run(
        [sys.executable, *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage:")
