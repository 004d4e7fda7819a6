"""`python -m acceptance <command> ...`: the acceptance commands behind one parser."""

from __future__ import annotations

import argparse
import sys

import httpx

from .averaging import add_averaging
from .common import EXIT_ERROR, CheckError
from .latency import add_latency
from .noise_floor import add_noise_floor
from .parity import add_negative_control, add_parity, add_score
from .shared_vs_direct import add_shared_vs_direct

REGISTER = (
    add_score,
    add_parity,
    add_noise_floor,
    add_negative_control,
    add_shared_vs_direct,
    add_averaging,
    add_latency,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m acceptance",
        description="Acceptance checks against a live semif-serve. Exit 0: every gate passed; "
        "1: a gate failed; 2: the check could not run.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in REGISTER:
        register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except CheckError as exc:
        print(f"error: {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except httpx.HTTPError as exc:
        print(f"error: {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except (OSError, ValueError) as exc:
        print(f"error: {args.command}: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
