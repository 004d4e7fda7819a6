"""Which input lines the output already answers, found in bounded memory for any size of either
file: the input's ids (a repeated custom_id refuses the job), the output's lines checked one by
one as they stream past (each a run-batch line of this input, none twice), and the finished
input lines as a bitmap (one bit a line).

An id is kept as 96 bits (the 24 hex digits of `batch_req_...`) with its line number: 24 bytes a
line, in memory up to SPILL_ROWS lines a file, then partitioned into BUCKETS temporary files by
the id's first byte and matched one bucket at a time.
"""

from __future__ import annotations

import json
import re
import tempfile
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from semif_serve.batch.lines import LongLine, line_digest, parse_line, pieces, read_lines

SPILL_ROWS = 1 << 18
BUCKETS = 256
#: Output lines held whole to be checked as JSON; a longer one is checked by how it begins.
OUTPUT_HOLD = 16 << 20
#: How every output line begins (the writer puts `id` first, compact).
LINE_START = b'{"id":"batch_req_'
_ID = re.compile(r"batch_req_([0-9a-f]{24})")
_LONG_LINE_START = re.compile(rb'\{"id":"batch_req_([0-9a-f]{24})"')
_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def id_key(digest: bytes) -> tuple[int, int]:
    """A 96-bit id (12 bytes) as two integers: its first 64 bits and its last 32."""
    return int.from_bytes(digest[:8], "big"), int.from_bytes(digest[8:12], "big")


class OutputMismatch(Exception):
    """An output line that is not a run-batch line of this input: its number and why."""

    def __init__(self, line: int, why: str) -> None:
        super().__init__(f"its line {line} {why}")
        self.line = line
        self.why = why


class KeyTable:
    """Rows (id's first 64 bits, id's last 32 bits, line number) as unsigned 64-bit integers:
    in memory up to SPILL_ROWS, then appended to BUCKETS files by the id's first byte."""

    def __init__(self, directory: Callable[[], Path], name: str) -> None:
        self._directory = directory
        self._name = name
        self._rows = array("Q")
        self.spilled = False
        self.count = 0

    def add(self, high: int, low: int, number: int) -> None:
        """One row."""
        self._rows.extend((high, low, number))
        self.count += 1
        if len(self._rows) >= 3 * SPILL_ROWS:
            self.spill()

    def spill(self) -> None:
        """The rows in memory, appended to their buckets' files."""
        if not self._rows:
            self.spilled = True
            return
        rows = np.frombuffer(self._rows, dtype=np.uint64).reshape(-1, 3)
        buckets = rows[:, 0] >> np.uint64(56)
        order = np.argsort(buckets, kind="stable")
        ordered = rows[order]
        bounds = np.searchsorted(buckets[order], np.arange(BUCKETS + 1, dtype=np.uint64))
        directory = self._directory()
        for bucket in range(BUCKETS):
            start, end = int(bounds[bucket]), int(bounds[bucket + 1])
            if start < end:
                with (directory / f"{self._name}-{bucket}").open("ab") as out:
                    out.write(ordered[start:end].tobytes())
        del rows, ordered
        self._rows = array("Q")
        self.spilled = True

    def rows(self) -> np.ndarray:
        """The rows in memory (the whole table when it never spilled)."""
        return np.frombuffer(self._rows, dtype=np.uint64).reshape(-1, 3).copy()

    def bucket(self, bucket: int) -> np.ndarray:
        """One bucket's rows, read back from its file."""
        path = self._directory() / f"{self._name}-{bucket}"
        if not path.exists():
            return np.empty((0, 3), dtype=np.uint64)
        return np.fromfile(path, dtype=np.uint64).reshape(-1, 3)


def partitions(*tables: KeyTable) -> Iterator[tuple[np.ndarray, ...]]:
    """The tables' rows in parts that hold every row of an id together (one part when no table
    spilled, else one per bucket, each read back in turn)."""
    if not any(table.spilled for table in tables):
        yield tuple(table.rows() for table in tables)
        return
    for table in tables:
        table.spill()
    for bucket in range(BUCKETS):
        yield tuple(table.bucket(bucket) for table in tables)


@dataclass(frozen=True)
class Finished:
    """The input lines (by number) whose result the output holds: one bit a line."""

    bits: bytes
    count: int

    def __contains__(self, number: object) -> bool:
        if not isinstance(number, int):
            return False
        index = number >> 3
        return index < len(self.bits) and bool(self.bits[index] >> (number & 7) & 1)


class Ledger:
    """The ids of the input's lines and of the output's, and what they say together. A context
    manager: spilled buckets live in a temporary directory removed at the end."""

    def __init__(self) -> None:
        self._temp: tempfile.TemporaryDirectory[str] | None = None
        self.inputs = KeyTable(self._directory, "in")
        self.outputs = KeyTable(self._directory, "out")
        self.last_line = 0

    def _directory(self) -> Path:
        if self._temp is None:
            self._temp = tempfile.TemporaryDirectory(prefix="semif-batch-ids-")
        return Path(self._temp.name)

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._temp is not None:
            self._temp.cleanup()
            self._temp = None

    @property
    def lines(self) -> int:
        """Non-blank input lines."""
        return self.inputs.count

    def add_input(self, digest: bytes, number: int) -> None:
        """One input line's output id (`result_digest`) and number."""
        self.inputs.add(*id_key(digest), number)
        self.last_line = number

    def first_repeat(self) -> tuple[int, int] | None:
        """The first input line whose id an earlier line has (file order), with that earlier line."""
        best: tuple[int, int] | None = None
        for (rows,) in partitions(self.inputs):
            pair = _first_repeat(rows)
            if pair is not None and (best is None or pair[1] < best[1]):
                best = pair
        return best

    def finished(self) -> Finished:
        """The input lines the output's lines answer; OutputMismatch naming the first output line
        that holds an id no input line has, or one an earlier output line holds."""
        bits = np.zeros((self.last_line >> 3) + 1, dtype=np.uint8)
        problem: OutputMismatch | None = None
        for inputs, outputs in partitions(self.inputs, self.outputs):
            lines, found = _match(inputs, outputs)
            if found is not None and (problem is None or found.line < problem.line):
                problem = found
            np.bitwise_or.at(bits, lines >> np.uint64(3), (1 << (lines & np.uint64(7))).astype(np.uint8))
        if problem is not None:
            raise problem
        return Finished(bits.tobytes(), self.outputs.count)


def _first_repeat(rows: np.ndarray) -> tuple[int, int] | None:
    if len(rows) < 2:
        return None
    ordered = rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]
    same = (ordered[1:, 0] == ordered[:-1, 0]) & (ordered[1:, 1] == ordered[:-1, 1])
    if not same.any():
        return None
    firsts, seconds = ordered[:-1, 2][same], ordered[1:, 2][same]
    at = int(np.argmin(seconds))
    return int(firsts[at]), int(seconds[at])


def _match(inputs: np.ndarray, outputs: np.ndarray) -> tuple[np.ndarray, OutputMismatch | None]:
    """The input line numbers the output rows answer, and the first output row that is foreign
    or repeated (ids unique among `inputs`: the repeat check ran first)."""
    if len(outputs) == 0:
        return np.empty(0, dtype=np.uint64), None
    tag = np.concatenate([np.zeros(len(inputs), np.uint8), np.ones(len(outputs), np.uint8)])
    rows = np.concatenate([inputs, outputs])
    order = np.lexsort((rows[:, 2], tag, rows[:, 1], rows[:, 0]))  # an id's input row first
    rows, tag = rows[order], tag[order]
    starts = np.ones(len(rows), dtype=bool)
    starts[1:] = (rows[1:, 0] != rows[:-1, 0]) | (rows[1:, 1] != rows[:-1, 1])
    group = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)[group]  # each row's group's first row
    output = tag == 1
    answered = output & (tag[first] == 0)
    problems: list[OutputMismatch] = []
    foreign = rows[output & (tag[first] == 1), 2]
    if len(foreign):
        problems.append(OutputMismatch(int(foreign.min()), "holds an id that no line of the input has"))
    again = np.flatnonzero(output[1:] & output[:-1] & ~starts[1:]) + 1  # an output row after one of its id
    if len(again):
        at = again[np.argmin(rows[again, 2])]
        line, earlier = int(rows[at, 2]), int(rows[at - 1, 2])
        problems.append(OutputMismatch(line, f"repeats the id of its line {earlier}"))
    return rows[first[answered], 2], min(problems, key=lambda p: p.line, default=None)


def scan_input(path: Path, max_body_bytes: int, ledger: Ledger) -> tuple[int, int] | None:
    """Every input line's id into `ledger`; the first repeated custom_id's two line numbers, if any."""
    with path.open("rb") as source:
        for number, raw in read_lines(source, max_body_bytes):
            ledger.add_input(line_digest(number, raw), number)
    return ledger.first_repeat()


def custom_id_at(path: Path, max_body_bytes: int, number: int) -> str | None:
    """The custom_id of input line `number` (read again, for a message)."""
    with path.open("rb") as source:
        for at, raw in read_lines(source, max_body_bytes):
            if at == number:
                return parse_line(at, raw).custom_id
    return None


def read_output(path: Path, ledger: Ledger) -> int:
    """Check each whole line of the output, streamed, and put its id in `ledger`; returns the
    bytes of whole lines (a half-written last line after them is for the caller to cut).
    OutputMismatch names the first line that is not a run-batch line."""
    whole = 0
    with path.open("rb") as out:
        for number, piece in enumerate(pieces(out, OUTPUT_HOLD), start=1):
            if not piece.ended:
                head = piece.line.head if isinstance(piece.line, LongLine) else piece.line
                if head[: len(LINE_START)] != LINE_START[: len(head)]:
                    raise OutputMismatch(number, "has no newline and does not begin as a run-batch line does")
                break
            ledger.outputs.add(*id_key(bytes.fromhex(_output_id(piece.line, number, piece.blank))), number)
            whole += piece.size
    return whole


def _output_id(raw: bytes | LongLine, number: int, blank: bool) -> str:
    """The id hex digits of a whole output line; OutputMismatch when it is not a run-batch line."""
    if isinstance(raw, LongLine):
        start = _LONG_LINE_START.match(raw.head)
        if start is None:
            raise OutputMismatch(
                number, f"is over {OUTPUT_HOLD} bytes and does not begin as a run-batch line"
            )
        return start.group(1).decode("ascii")
    if blank:
        raise OutputMismatch(number, "is blank")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise OutputMismatch(number, f"is not UTF-8 (byte {exc.start + 1})") from None
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        raise OutputMismatch(number, "is not JSON") from None
    if not isinstance(document, dict):
        kind = _TYPES.get(type(document), "null")
        raise OutputMismatch(number, f"is {kind} in JSON, not an object")
    found = _ID.fullmatch(document["id"]) if isinstance(document.get("id"), str) else None
    if found is None:
        raise OutputMismatch(number, 'has no run-batch "id" (batch_req_ and 24 hex digits)')
    return found.group(1)
