"""The `semif-serve` command: serve, demo, demo-model, run-batch, calibrate, env-template, check-model,
manifest, presentation-checks.

The entry point forces HF_HUB_OFFLINE=1 before anything imports transformers: the service
never downloads weights or data.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from semif_serve.service.settings import Settings
    from semif_serve.service.startup import Service

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
    """Build the demo checkpoint unless a complete one of this revision is already there."""
    from semif_serve.tools.demo import DEMO_REVISION, write_checkpoint

    marker = directory / "DEMO.json"
    if not marker.exists() or json.loads(marker.read_text()).get("revision") != DEMO_REVISION:
        # stderr: run-batch may be writing its results to stdout
        print(f"building the random-weight demo checkpoint in {directory} ...", file=sys.stderr, flush=True)
        write_checkpoint(directory, multimodal=True)  # the demo reads images, as Qwen3.5 does
    return directory


def demo_banner(host: str, port: int, made_token: str | None, lev_model: str | None = None) -> str:
    """What the demo prints on start. A token the demo made is shown (it is the only way to learn
    it); a token the operator supplied is never printed (a terminal or its log may be shared):
    the examples read `$SEMIF_API_TOKEN` instead. `lev_model` names the demo's lev release."""
    url = f"http://{host}:{port}"
    shown = made_token or "the one in SEMIF_API_TOKEN or SEMIF_API_TOKEN_FILE (not shown)"
    models = (
        f"models: the base (SemIf's method) and {lev_model!r} (a random lev-format release, alias "
        f"'local'), picked by System One's `model`; {url}/v1/models lists them\n"
        if lev_model
        else ""
    )
    return (
        f"\nsemif-serve demo (random weights) on {url}\n"
        f"token: {shown}\n"
        f"{models}"
        f'try:   curl -s -H "Authorization: Bearer {made_token or "$SEMIF_API_TOKEN"}" {url}/health\n'
        f"page:  {url}/playground (paste the token)\n"
    )


def start_service(settings: Settings) -> Service | int:
    """Load and warm up the service of `settings`, or the exit code of why it cannot start."""
    from semif_serve.domain.calibration import CalibrationFileError
    from semif_serve.domain.types import ConfigurationError, DecisionError
    from semif_serve.engine.loader import CheckpointError
    from semif_serve.service.startup import Service

    try:
        return Service.start(settings)
    except (ConfigurationError, CalibrationFileError) as exc:
        log.error("invalid configuration: %s", exc)
        return EXIT_CONFIG
    except (CheckpointError, DecisionError) as exc:
        log.error("startup failed: %s", exc)
        return EXIT_STARTUP
    except Exception as exc:  # noqa: BLE001 - any warm-up failure must stop startup, clearly
        log.error("startup failed during load or warm-up: %s: %s", type(exc).__name__, exc)
        return EXIT_STARTUP


def checked_settings(overrides: dict | None) -> Settings | int:
    """The settings (environment, then `overrides`) with a model and a token, or EXIT_CONFIG."""
    from semif_serve.domain.types import ConfigurationError
    from semif_serve.service.settings import load_settings

    try:
        settings = load_settings(**(overrides or {}))
        settings.require_model()
        settings.token()
    except ConfigurationError as exc:
        log.error("invalid configuration: %s", exc)
        return EXIT_CONFIG
    return settings


def serve(overrides: dict | None = None, demo: bool = False, made_token: str | None = None) -> int:
    """Validate everything, load and warm up the engine, then bind the port; fail closed."""
    from semif_serve.app import create_app
    from semif_serve.http.logs import configure_logging

    configure_logging()
    settings = checked_settings(overrides)
    if isinstance(settings, int):
        return settings
    service = start_service(settings)
    if isinstance(service, int):
        return service
    if demo:
        from semif_serve.tools.demo import DEMO_LEV_MODEL

        lev = DEMO_LEV_MODEL if service.models.resolve(DEMO_LEV_MODEL) is not None else None
        print(demo_banner(settings.host, settings.port, made_token, lev), flush=True)
    from semif_serve.http.server import run_server

    log.info(
        "serving",
        extra={
            "host": settings.host,
            "port": settings.port,
            "device": settings.device,
            "demo": service.demo,
        },
    )
    run_server(
        create_app(service),
        settings.host,
        settings.port,
        settings.shutdown_grace_seconds,
        settings.header_timeout_seconds,
    )
    service.worker.shutdown()
    return 0


def demo_overrides() -> dict:
    """The settings `semif-serve demo` serves: its checkpoint (built once), on the CPU in float32,
    and its lev release unless SEMIF_MODELS names the operator's own models file."""
    from semif_serve.tools.demo import DEMO_REVISION, ensure_demo_models

    checkpoint = ensure_demo_checkpoint(demo_directory())
    overrides: dict = {
        "model_path": checkpoint,
        "model_revision": DEMO_REVISION,
        "device": "cpu",
        "dtype": "float32",
        "demo": True,
    }
    if not os.environ.get("SEMIF_MODELS"):  # the operator's own models file wins
        overrides["models"] = ensure_demo_models(checkpoint)
    return overrides


def token_configured() -> bool:
    """Whether SEMIF_API_TOKEN or SEMIF_API_TOKEN_FILE is set."""
    return bool(os.environ.get("SEMIF_API_TOKEN") or os.environ.get("SEMIF_API_TOKEN_FILE"))


def run_batch(args: argparse.Namespace) -> int:
    """`semif-serve run-batch`: score a batch file with the service's settings, in this process
    (or on Ray with --ray); 0 when every line has its result, 2 when a file, flag or setting is
    refused (one line on stderr, before anything is written or loaded), 3 when the model cannot
    start, 130 when interrupted (the same command continues)."""
    from semif_serve.batch.job import BatchFiles, BatchRefused, check_report, prepared, score_plan
    from semif_serve.batch.lines import DuplicateCustomId
    from semif_serve.batch.ray_job import RayJobFailed, RayPlan, require_ray, score_on_ray
    from semif_serve.batch.runner import Pacing
    from semif_serve.http.logs import configure_logging

    configure_logging()
    for chatty in ("semif_serve.request", "httpx"):  # a line per request: too many for a batch
        logging.getLogger(chatty).setLevel(logging.WARNING)
    overrides = demo_overrides() if args.demo else {}
    if not token_configured():  # no port is bound: the token only guards the batch's own calls
        overrides["api_token"] = "batch-" + secrets.token_urlsafe(18)
    settings = checked_settings(overrides)
    if isinstance(settings, int):
        return settings
    files = BatchFiles(args.input, args.output)
    pacing = Pacing(window=args.window, concurrency=args.concurrency)
    bar = {"auto": None, "bar": True, "plain": False}[args.progress]
    try:
        if args.ray:
            require_ray()  # an environment refused first, before the files are read
        with prepared(files, settings.max_body_bytes, check_only=args.check) as plan:
            if args.check:
                print(check_report(files, plan), file=sys.stderr)
            elif args.ray:
                ray_plan = RayPlan(args.ray_address, args.num_actors, args.ray_batch_size, args.ray_gpus)
                score_on_ray(settings, plan, pacing, ray_plan, bar=bar)
            else:

                @contextmanager
                def started() -> Iterator[Service]:
                    service = start_service(settings)
                    if isinstance(service, int):
                        raise SystemExit(service)
                    try:
                        yield service
                    finally:
                        service.worker.shutdown()

                score_plan(started, plan, pacing, bar=bar)
    except DuplicateCustomId as exc:
        print(f"run-batch: {args.input}: {exc}; nothing was scored", file=sys.stderr)
        return EXIT_CONFIG
    except BatchRefused as exc:
        print(f"run-batch: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except OSError as exc:
        print(f"run-batch: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        print(
            "run-batch: interrupted; every line written stays, and the same command continues from there",
            file=sys.stderr,
        )
        return 130
    except RayJobFailed as exc:
        print(f"run-batch: {exc}", file=sys.stderr)
        return EXIT_STARTUP
    return 0


def positive(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not at least 1")
    return value


def non_negative(text: str) -> float:
    """An argparse type: a finite number of at least 0."""
    import math

    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of at least 0")
    return value


def add_run_batch_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `semif-serve run-batch` (docs/batch.md); a refused flag is one line (exit 2)."""

    def one_line(message: str) -> None:
        parser.exit(EXIT_CONFIG, f"{parser.prog}: {message} (--help lists the flags)\n")

    parser.error = one_line  # type: ignore[method-assign,assignment]
    parser.add_argument("-i", "--input", required=True, metavar="IN", help="the batch file (- for stdin)")
    parser.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="OUT",
        help="the results file (- for stdout); lines already in it are skipped, so a rerun continues",
    )
    parser.add_argument(
        "--demo", action="store_true", help="score with the demo's model and lev release (as `demo` serves)"
    )
    parser.add_argument(
        "--window", type=positive, default=256, metavar="N", help="lines read ahead, grouped by state [256]"
    )
    parser.add_argument(
        "--concurrency",
        type=positive,
        default=None,
        metavar="N",
        help="lines in flight at once (at most SEMIF_MAX_QUEUE) [SEMIF_MAX_QUEUE]",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the files (the input's custom_ids, the lines already in OUT) and stop: no model "
        "is loaded and nothing is written",
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "bar", "plain"),
        default="auto",
        help="a bar on a terminal, else a line every 5 s (auto); or force one [auto]",
    )
    ray = parser.add_argument_group("Ray (pip install 'semif-serve[ray]')")
    ray.add_argument("--ray", action="store_true", help="score on a Ray cluster through Ray Data")
    ray.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the cluster to join (default: RAY_ADDRESS, else a local one started for the job)",
    )
    ray.add_argument(
        "--num-actors", type=positive, default=1, metavar="N", help="engines (Ray actors), one model each [1]"
    )
    ray.add_argument(
        "--ray-batch-size", type=positive, default=64, metavar="N", help="lines per actor call [64]"
    )
    ray.add_argument(
        "--ray-gpus",
        type=non_negative,
        default=None,
        metavar="G",
        help="GPUs per actor (default: 1 when SEMIF_DEVICE is cuda, else 0)",
    )


ENV_TEMPLATE_POINTER = (
    "Every setting is a SEMIF_* environment variable; `semif-serve env-template` prints them all "
    "with their defaults and meanings."
)


def settings_epilog() -> str:
    """Every SEMIF_* variable with its default, generated from Settings, for `serve --help`."""
    from semif_serve.service.settings import Settings, env_name
    from semif_serve.tools.env_template import _format_value

    lines = ["settings (environment variables, default in brackets):"]
    for field, info in Settings.model_fields.items():
        default = _format_value(info.default) or "unset"
        lines.append(f"  {env_name(field):<30} {info.description} [{default}]")
    lines += ["", ENV_TEMPLATE_POINTER]
    return "\n".join(lines)


def check_model(directory: Path, manifest: Path | None) -> int:
    """`semif-serve check-model`: 0 when the directory is complete (and matches the manifest)."""
    from semif_serve.domain.types import ConfigurationError
    from semif_serve.engine.checkpoint_files import CheckpointFilesError, check_checkpoint, verify_checkpoint
    from semif_serve.engine.memory import GIB

    try:
        report = check_checkpoint(directory)
        print(f"{directory}: complete")
        print(f"  config.json: model_type {report.model_type}")
        print(f"  tokenizer: {', '.join(report.tokenizer)}")
        print(
            f"  weights: {len(report.shards)} safetensors files, {report.tensors} tensors, "
            f"{report.bytes:,} bytes ({report.bytes / GIB:.2f} GiB)"
        )
        if manifest is None:
            print("  manifest: not checked (add --manifest FILE to compare every file's SHA-256)")
        else:
            verification = verify_checkpoint(directory, manifest)
            print(
                f"  manifest: all {verification.files} files match {manifest} ({verification.seconds:.1f} s)"
            )
    except CheckpointFilesError as exc:
        print(f"check-model: {exc}", file=sys.stderr)
        return 1
    except ConfigurationError as exc:
        print(f"check-model: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


def write_manifest(directory: Path, target: Path | None) -> int:
    """`semif-serve manifest`: the SHA-256 manifest of a model directory, to stdout or a file."""
    from semif_serve.engine.checkpoint_files import CheckpointFilesError, render_manifest

    try:
        text = render_manifest(directory, exclude=target)
    except (CheckpointFilesError, OSError) as exc:
        print(f"manifest: {exc}", file=sys.stderr)
        return 1
    if target is None:
        sys.stdout.write(text)
    else:
        target.write_text(text, encoding="utf-8")
        print(f"wrote the SHA-256 of {text.count(chr(10))} files to {target}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `semif-serve` argument parser: one subcommand per task, each pointing to env-template."""
    from semif_serve.tools.calibration_fit import add_calibrate_arguments

    parser = argparse.ArgumentParser(
        prog="semif-serve", description=__doc__.splitlines()[0], epilog=ENV_TEMPLATE_POINTER
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name: str, summary: str, details: str = "", **kw) -> argparse.ArgumentParser:
        description = f"{summary[0].upper()}{summary[1:]}." + (f" {details}" if details else "")
        return commands.add_parser(
            name,
            help=summary,
            description="\n\n".join(textwrap.fill(text, 88) for text in (description, ENV_TEMPLATE_POINTER)),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **kw,
        )

    command(
        "serve",
        "serve the configured model (the default when no command is given)",
        "Validates the settings, verifies the weights against SEMIF_MODEL_MANIFEST when it is set, "
        "loads and warms up the model, then binds SEMIF_HOST:SEMIF_PORT. Exits 2 on invalid "
        "configuration, 3 when the checkpoint or the warm-up fails.",
        epilog=settings_epilog(),
    )
    demo = command(
        "demo",
        "serve a random-weight demo model on the CPU (its answers carry no meaning)",
        "Builds the demo checkpoint once (under SEMIF_DEMO_DIR, else ~/.cache/semif-serve/demo-model), "
        "and beside it (in <dir>-lev) a random lev-format release served as `lev-demo` (alias `local`) "
        "unless SEMIF_MODELS is set, then serves both in the foreground. It reads SEMIF_PORT, "
        "SEMIF_API_TOKEN (fixed, so examples can be pasted; otherwise a new token is printed on every "
        "run) and SEMIF_CALIBRATION.",
    )
    demo.add_argument("--port", type=int, default=None, help="port to bind (default: SEMIF_PORT, else 8032)")
    model = command("demo-model", "write the random-weight demo checkpoint to DIR, without serving it")
    model.add_argument("directory", type=Path, metavar="DIR", help="folder to write (created if missing)")
    calibrate = command(
        "calibrate",
        "fit a workload temperature (SEMIF_CALIBRATION) from labelled rows and the service's predictions",
        "Joins --gold and --predictions by id, finds the T in [0.05, 20] that minimises the gold "
        "options' negative log-likelihood, and prints accuracy, NLL and ECE (10 bins) at T=1 and at "
        "the fitted T, in-sample and out-of-fold (5 folds by group_id), then the calibration.json "
        "entry. It warns below ~150 rows and when T lands on a bound. Exits 0, or 2 on bad input "
        "(--mode rotations/all needs predictions scored with those orderings).",
    )
    add_calibrate_arguments(calibrate)
    batch = command(
        "run-batch",
        "score a file of requests (OpenAI's Batch file format) with the configured model, in this process",
        "Each input line is {custom_id, method, url, body} with url /v1/systemone, /decide or "
        "/decide/shared; each output line is {id, custom_id, response: {status_code, request_id, "
        "body}, error}, the body the route answers. Settings are the service's (SEMIF_*); no port "
        "is bound. A rerun skips the lines already in OUT, once every line of OUT is checked to be "
        "this input's; OUT is never the input, a device or another file, and one run at a time "
        "writes it. Exits 0 when done, 2 when a file, flag or setting is refused (a repeated "
        "custom_id, OUT not this input's output, OUT locked, Ray missing: one line, nothing "
        "written), 3 when the model cannot start, 130 when interrupted.",
    )
    add_run_batch_arguments(batch)
    command("env-template", "print every SEMIF_* variable with its default, as a commented env file")
    check = command(
        "check-model",
        "check that a model directory is complete before serving it",
        "Verifies config.json, the tokenizer files, the safetensors index, and that every shard it "
        "names is present and readable (its header parses and its tensors fill the file). With "
        "--manifest it also compares every file's SHA-256. Exits 0 when complete, 1 otherwise.",
    )
    check.add_argument("directory", type=Path, metavar="DIR", help="the model directory (SEMIF_MODEL_PATH)")
    check.add_argument(
        "--manifest", type=Path, default=None, metavar="FILE", help="a manifest from `semif-serve manifest`"
    )
    manifest = command(
        "manifest",
        "print the SHA-256 manifest of a model directory, for SEMIF_MODEL_MANIFEST",
        "One `<sha256>  <path>` line per file (sha256sum's format; hidden paths skipped). Point "
        "SEMIF_MODEL_MANIFEST at it and startup refuses (exit 3) a directory whose files differ.",
    )
    manifest.add_argument(
        "directory", type=Path, metavar="DIR", help="the model directory (SEMIF_MODEL_PATH)"
    )
    manifest.add_argument(
        "--write",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the manifest to FILE instead of stdout",
    )
    from semif_serve.tools.presentation_checks import add_presentation_arguments

    checks = command(
        "presentation-checks",
        "measure how much the order of the options sways the model on your states, per ordering",
        "lev's label-free position checks (identical options; the first-slot rate over every order "
        "of three options) under each ordering the service offers, calibrated and raw: a JSON report, "
        "a table, --compare against a committed report, --recommend the cheapest ordering per kind "
        "within the gates. Exits 0, 1 when a metric drifted, 2 on bad input or other settings, 3 when "
        "the service cannot start or be reached (docs/presentation-checks.md).",
    )
    add_presentation_arguments(checks)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `semif-serve` console script."""
    force_offline()
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.command == "calibrate":
        from semif_serve.tools.calibration_fit import calibrate

        return calibrate(args)
    if args.command == "demo-model":
        from semif_serve.tools.demo import write_checkpoint

        write_checkpoint(args.directory, multimodal=True)
        print(f"wrote a random-weight demo checkpoint (with a vision tower) to {args.directory}")
        return 0
    if args.command == "env-template":
        from semif_serve.tools.env_template import render_env_template

        sys.stdout.write(render_env_template())
        return 0
    if args.command == "check-model":
        return check_model(args.directory, args.manifest)
    if args.command == "manifest":
        return write_manifest(args.directory, args.write)
    if args.command == "run-batch":
        return run_batch(args)
    if args.command == "presentation-checks":
        from semif_serve.tools.presentation_checks import presentation_checks

        return presentation_checks(args, demo_overrides, checked_settings, start_service)
    if args.command == "demo":
        overrides = demo_overrides()
        if args.port is not None:
            overrides["port"] = args.port
        made_token = None
        if not token_configured():
            made_token = overrides["api_token"] = "demo-" + secrets.token_urlsafe(18)
        return serve(overrides, demo=True, made_token=made_token)
    return serve()


if __name__ == "__main__":
    sys.exit(main())
