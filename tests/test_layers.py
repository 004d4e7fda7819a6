"""The package's layers are enforced: import-linter's contracts (pyproject.toml) hold on the tree,
and the same contracts fail on a copy with a forbidden import or a cycle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` over the package under `root/src`, with the project's own contracts."""
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
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def add_import(root: Path, module: str, statement: str) -> None:
    path = root / "src" / "semif_serve" / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{statement}  # noqa\n")


def test_every_import_in_the_package_runs_down_the_layers_and_no_module_cycles() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "module,statement,broken",
    [
        ("domain.numerics", "import semif_serve.engine.runner", "every import runs down the layers"),
        ("engine.memory", "from semif_serve.service import settings", "every import runs down the layers"),
        ("doors.systemone.api", "import semif_serve.doors.native.api", "The two doors know nothing"),
        ("tools.calibration_fit", "import semif_serve.tools.cli", "imports its way back to itself"),
        ("domain.numerics", "import fastapi", "nothing but the standard library and pydantic"),
        ("domain.boxes", "import numpy", "nothing but the standard library and pydantic"),
    ],
    ids=[
        "domain_imports_engine",
        "engine_imports_service",
        "door_imports_door",
        "cycle_in_tools",
        "domain_imports_fastapi",
        "domain_imports_numpy_outside_images",
    ],
)
def test_a_forbidden_import_or_a_cycle_breaks_a_contract(copy_of_the_tree, module, statement, broken) -> None:
    add_import(copy_of_the_tree, module, statement)
    result = lint(copy_of_the_tree)
    assert result.returncode == 1
    assert f"{broken}" in result.stdout and "BROKEN" in result.stdout
