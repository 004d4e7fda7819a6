"""What a check or a benchmark prints and writes: fixed-width tables, progress on stderr and the
JSON result file."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_NUMERIC = re.compile(r"-|[+-]?[0-9][0-9.,e+-]*(%| ?ms| ?s|x)?")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width table; numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, value in enumerate(row):
            widths[i] = max(widths[i], len(value))
    numeric = [bool(cells) and all(_NUMERIC.fullmatch(row[i]) for row in cells) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)]
        return "  ".join(parts).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    if title:
        print(title)
    print(format_table(headers, rows))
    print()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def write_result(path: Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(payload, indent=2, ensure_ascii=False, default=jsonable) + "\n", encoding="utf-8"
    )
    return path


def jsonable(value: Any) -> Any:
    """`value` as JSON can hold it: paths as strings, containers element by element, the rest by repr."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return repr(value)


def log(message: str) -> None:
    """Progress on stderr, so stdout holds only the tables."""
    print(message, file=sys.stderr, flush=True)
