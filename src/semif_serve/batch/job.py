"""One batch job, from its files: the input checked (a repeated custom_id refuses the job before
any work), the output's finished lines skipped (its half-written last line cut), the remaining
lines scored, and the counts."""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TextIO

from semif_serve.batch.lines import BatchLine, done_ids, parse_line, read_lines, scan_input
from semif_serve.batch.progress import Progress, Summary
from semif_serve.batch.runner import BatchScorer, Pacing, ResultWriter, windows_of
from semif_serve.service.startup import Service

STDIO = "-"


@dataclass(frozen=True)
class BatchFiles:
    """Where a job reads (`-`: stdin) and writes (`-`: stdout, which cannot be resumed)."""

    input: str
    output: str

    @contextmanager
    def readable_input(self) -> Iterator[Path]:
        """The input as a file: stdin is spooled to a temporary file first (read twice: the
        custom_id check, then the scoring)."""
        if self.input != STDIO:
            yield Path(self.input)
            return
        with tempfile.NamedTemporaryFile(prefix="semif-batch-", suffix=".jsonl") as spool:
            shutil.copyfileobj(sys.stdin.buffer, spool)
            spool.flush()
            yield Path(spool.name)

    def finished(self) -> set[str]:
        """The ids the output already holds (a half-written last line is cut off first)."""
        return set() if self.output == STDIO else done_ids(Path(self.output))

    @contextmanager
    def appendable_output(self) -> Iterator[BinaryIO]:
        """The output, opened to append (stdout as it is)."""
        if self.output == STDIO:
            yield sys.stdout.buffer
            return
        with open(self.output, "ab") as out:
            yield out


def pending_lines(path: Path, finished: set[str]) -> Iterator[BatchLine]:
    """The input's lines, in order, without those whose result the output already holds."""
    with path.open("rb") as source:
        for number, raw in read_lines(source):
            line = parse_line(number, raw)
            if line.id not in finished:
                yield line


@dataclass(frozen=True)
class Plan:
    """A checked input: its lines, and the ids of those the output already holds."""

    path: Path
    finished: set[str]
    lines: int
    skipped: int

    def summary(self) -> Summary:
        """The counts to fill as the run goes."""
        return Summary(lines=self.lines, skipped=self.skipped)


def plan(path: Path, files: BatchFiles) -> Plan:
    """Check the input (DuplicateCustomId before any work) and read what the output holds."""
    ids = scan_input(path)
    finished = files.finished()
    return Plan(path, finished, len(ids), sum(id_ in finished for id_ in ids))


def score_file(
    start: Callable[[], AbstractContextManager[Service]],
    files: BatchFiles,
    pacing: Pacing,
    stream: TextIO = sys.stderr,
    bar: bool | None = None,
) -> Summary:
    """The whole local job: check, start the service (`start`, held while the job runs), score
    what is left, count.

    Raises DuplicateCustomId (before the service starts) or KeyboardInterrupt (what was
    written stays written: the same command continues from there).
    """
    with files.readable_input() as path:
        checked = plan(path, files)
        if checked.lines == checked.skipped:  # a finished job run again: nothing to load
            return Progress(checked.summary(), stream, bar=False).close()
        with start() as service, files.appendable_output() as out:
            progress = Progress(checked.summary(), stream, bar=bar)
            try:
                scorer = BatchScorer(service)
                windows = windows_of(pending_lines(path, checked.finished), pacing.window)
                asyncio.run(scorer.score(windows, ResultWriter(out), pacing, progress))
            finally:
                progress.close()
    return progress.summary
