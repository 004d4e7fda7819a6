"""The `semif-serve` command: serve, demo, demo-model, calibrate, env-template.

The entry point forces HF_HUB_OFFLINE=1 before anything imports transformers: the service
never downloads weights or data.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
from pathlib import Path

EXIT_CONFIG = 2
EXIT_STARTUP = 3

log = logging.getLogger("semif_serve")


def force_offline() -> None:
    """No hub traffic, ever: set before transformers or huggingface_hub is imported."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def demo_directory() -> Path:
    """Where `semif-serve demo` keeps its checkpoint (SEMIF_DEMO_DIR, else the user cache)."""
    configured = os.environ.get("SEMIF_DEMO_DIR")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "semif-serve" / "demo-model"


def ensure_demo_checkpoint(directory: Path) -> Path:
    """Build the demo checkpoint unless a complete one is already there."""
    from .demo import write_checkpoint

    if not (directory / "DEMO.json").exists():
        print(f"building the random-weight demo checkpoint in {directory} ...", flush=True)
        write_checkpoint(directory)
    return directory


def serve(overrides: dict | None = None, announce_token: bool = False) -> int:
    """Validate everything, load and warm up the engine, then bind the port; fail closed."""
    from .app import create_app
    from .calibration import CalibrationFileError
    from .domain import DecisionError
    from .engine import CheckpointError
    from .logs import configure_logging
    from .settings import ConfigurationError, load_settings
    from .startup import Service

    configure_logging()
    try:
        settings = load_settings(**(overrides or {}))
        settings.require_model()
        settings.token()
    except ConfigurationError as exc:
        log.error("invalid configuration: %s", exc)
        return EXIT_CONFIG
    try:
        service = Service.start(settings)
    except (ConfigurationError, CalibrationFileError) as exc:
        log.error("invalid configuration: %s", exc)
        return EXIT_CONFIG
    except (CheckpointError, DecisionError) as exc:
        log.error("startup failed: %s", exc)
        return EXIT_STARTUP
    except Exception as exc:  # noqa: BLE001 - any warm-up failure must stop startup, clearly
        log.error("startup failed during load or warm-up: %s: %s", type(exc).__name__, exc)
        return EXIT_STARTUP
    if announce_token:
        print(
            f"\nsemif-serve demo (random weights) on http://{settings.host}:{settings.port}\n"
            f"token: {settings.token()}\n"
            f"try:   curl -s -H 'Authorization: Bearer {settings.token()}' "
            f"http://{settings.host}:{settings.port}/health\n",
            flush=True,
        )
    from .server import run_server

    log.info(
        "serving",
        extra={
            "host": settings.host,
            "port": settings.port,
            "device": settings.device,
            "demo": service.demo,
        },
    )
    run_server(create_app(service), settings.host, settings.port, settings.shutdown_grace_seconds)
    service.worker.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `semif-serve` console script."""
    force_offline()
    parser = argparse.ArgumentParser(prog="semif-serve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("serve", help="serve the configured model (the default)")
    demo = commands.add_parser("demo", help="serve a random-weight demo model on the CPU")
    demo.add_argument("--port", type=int, default=None)
    model = commands.add_parser("demo-model", help="write the demo checkpoint to DIR")
    model.add_argument("directory", type=Path)
    commands.add_parser("calibrate", help="fit a workload temperature", add_help=False)
    commands.add_parser("env-template", help="print every SEMIF_* variable with its default")
    args, rest = parser.parse_known_args(argv)

    if args.command == "calibrate":
        from .calibration_fit import run_calibrate

        return run_calibrate(rest)
    if rest:
        parser.error(f"unrecognised arguments: {' '.join(rest)}")
    if args.command == "demo-model":
        from .demo import write_checkpoint

        write_checkpoint(args.directory)
        print(f"wrote a random-weight demo checkpoint to {args.directory}")
        return 0
    if args.command == "env-template":
        from .env_template import render_env_template

        sys.stdout.write(render_env_template())
        return 0
    if args.command == "demo":
        from .demo import DEMO_REVISION

        overrides = {
            "model_path": ensure_demo_checkpoint(demo_directory()),
            "model_revision": DEMO_REVISION,
            "device": "cpu",
            "dtype": "float32",
            "demo": True,
        }
        if args.port is not None:
            overrides["port"] = args.port
        if not (os.environ.get("SEMIF_API_TOKEN") or os.environ.get("SEMIF_API_TOKEN_FILE")):
            overrides["api_token"] = "demo-" + secrets.token_urlsafe(18)
        return serve(overrides, announce_token=True)
    return serve()


if __name__ == "__main__":
    sys.exit(main())
