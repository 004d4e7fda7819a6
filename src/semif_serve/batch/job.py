"""One batch job, from its files: the files checked before anything is written (the input is
not the output, the output is a run-batch output of this input or new, one run at a time), the
input's custom_ids checked (a repeated one refuses the job before any work), the output's
finished lines skipped (its half-written last line cut), the remaining lines scored, and the
counts. Nothing here holds a whole file: lines stream, ids are kept compactly (ledger.py).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

from semif_serve.batch.files import STDIO, BatchRefused, OutputLock, checked_input, checked_output
from semif_serve.batch.ledger import Finished, Ledger, OutputMismatch, custom_id_at, read_output, scan_input
from semif_serve.batch.lines import DuplicateCustomId, RawLine, parse_line, read_lines
from semif_serve.batch.progress import Progress, Summary
from semif_serve.batch.runner import BatchScorer, Pacing, ResultWriter, windows_of
from semif_serve.service.startup import Service


@dataclass(frozen=True)
class BatchFiles:
    """Where a job reads (`-`: stdin) and writes (`-`: stdout, which cannot be resumed)."""

    input: str
    output: str


@dataclass(frozen=True)
class Plan:
    """Checked files: the input (stdin spooled), the output's real path (None: stdout), the body
    limit lines are read under, and which lines the output already holds."""

    path: Path
    output: Path | None
    max_body_bytes: int
    finished: Finished
    lines: int

    @property
    def skipped(self) -> int:
        """Lines whose result the output already holds."""
        return self.finished.count

    def summary(self) -> Summary:
        """The counts to fill as the run goes."""
        return Summary(lines=self.lines, skipped=self.skipped)

    def pending(self) -> Iterator[tuple[int, RawLine]]:
        """The input's lines whose result the output does not hold, in order, streamed."""
        with self.path.open("rb") as source:
            for number, raw in read_lines(source, self.max_body_bytes):
                if number not in self.finished:
                    yield number, raw

    @contextmanager
    def appendable_output(self) -> Iterator[BinaryIO]:
        """The output, opened to append (stdout as it is)."""
        if self.output is None:
            yield sys.stdout.buffer
            return
        with open(self.output, "ab") as out:
            yield out


@contextmanager
def _spooled(name: str) -> Iterator[Path]:
    """The input as a file: stdin is spooled to a temporary file first (read twice: the
    custom_id check, then the scoring)."""
    if name != STDIO:
        yield Path(name)
        return
    with tempfile.NamedTemporaryFile(prefix="semif-batch-", suffix=".jsonl") as spool:
        shutil.copyfileobj(sys.stdin.buffer, spool)
        spool.flush()
        yield Path(spool.name)


@contextmanager
def prepared(files: BatchFiles, max_body_bytes: int, check_only: bool = False) -> Iterator[Plan]:
    """The job's files checked, the output locked (held while the plan is in use), its lines
    validated and a half-written last line cut (not with `check_only`: nothing is written).

    Raises BatchRefused (a file refused: nothing was written) or DuplicateCustomId.
    """
    source = checked_input(files.input)
    output = None if files.output == STDIO else checked_output(files.output, files.input, source)
    with ExitStack() as stack:
        if output is not None:
            stack.enter_context(OutputLock(output, files.output))
        path = stack.enter_context(_spooled(files.input))
        ledger = stack.enter_context(Ledger())
        repeat = scan_input(path, max_body_bytes, ledger)
        if repeat is not None:
            custom_id = custom_id_at(path, max_body_bytes, repeat[1])
            raise DuplicateCustomId(custom_id or "", *repeat)
        whole = None
        if output is not None and output.exists():
            try:
                whole = read_output(output, ledger)
                finished = ledger.finished()
            except OutputMismatch as exc:
                shown = "stdin" if files.input == STDIO else files.input
                raise BatchRefused(
                    f"-o {files.output} is not a run-batch output of {shown}: {exc}; it was left as it is"
                ) from None
        else:
            finished = ledger.finished()
        if whole is not None and not check_only:
            _cut(output, whole)
        yield Plan(path, output, max_body_bytes, finished, ledger.lines)


def _cut(output: Path | None, whole: int) -> None:
    """Cut a half-written last line off the output (a kill can leave only the last line partial:
    each window is written whole, then flushed and synced)."""
    if output is None or os.path.getsize(output) == whole:
        return
    with output.open("r+b") as out:
        out.truncate(whole)
        out.flush()
        os.fsync(out.fileno())


def check_report(files: BatchFiles, plan: Plan) -> str:
    """What `--check` says of files that pass."""
    return (
        f"run-batch: {files.input}: {plan.lines} lines, {plan.skipped} already in {files.output}; "
        "the files are fine, nothing was scored (--check)"
    )


def score_plan(
    start: Callable[[], AbstractContextManager[Service]],
    plan: Plan,
    pacing: Pacing,
    stream: TextIO = sys.stderr,
    bar: bool | None = None,
) -> Summary:
    """Start the service (`start`, held while the job runs), score what is left, count.

    Raises KeyboardInterrupt (what was written stays written: the same command continues)."""
    if plan.lines == plan.skipped:  # a finished job run again: nothing to load
        return Progress(plan.summary(), stream, bar=False).close()
    with start() as service, plan.appendable_output() as out:
        progress = Progress(plan.summary(), stream, bar=bar)
        try:
            scorer = BatchScorer(service)
            lines = (parse_line(number, raw) for number, raw in plan.pending())
            windows = windows_of(lines, pacing.window)
            asyncio.run(scorer.score(windows, ResultWriter(out), pacing, progress))
        finally:
            progress.close()
    return progress.summary
