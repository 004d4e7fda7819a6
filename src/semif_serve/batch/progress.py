"""What a person watching a batch sees on stderr: a tqdm bar on a terminal (lines, lines/s, time
left), a plain progress line every few seconds otherwise, and a summary at the end."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, TextIO

PLAIN_EVERY_SECONDS = 5.0


def reason_of(status: int, body: Any) -> str:
    """A refusal's reason, `<status> <code>`, read from either door's error shape."""
    code = None
    if isinstance(body, dict):
        error, detail = body.get("error"), body.get("detail")
        if isinstance(error, dict):
            code = error.get("code")  # the native envelope
        elif isinstance(detail, dict):
            code = detail.get("error_type")  # TypeSafe's error
        elif isinstance(detail, list) and detail and isinstance(detail[0], dict):
            code = detail[0].get("type")  # TypeSafe's (FastAPI's) validation error
    return f"{status} {code}" if code else str(status)


@dataclass
class Summary:
    """The counts of one run: lines in the input, already in the output, answered, refused."""

    lines: int
    skipped: int
    answered: int = 0
    refused: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def done(self) -> int:
        """Lines this run answered or refused."""
        return self.answered + sum(self.refused.values())

    def count(self, result: dict[str, Any]) -> None:
        """Count one output line."""
        response = result["response"]
        if result["error"] is None:
            self.answered += 1
        else:
            self.refused[reason_of(response["status_code"], response["body"])] += 1

    def render(self) -> str:
        """The end-of-run lines."""
        rate = self.done / self.seconds if self.seconds > 0 else 0.0
        refused = sum(self.refused.values())
        reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.refused.items()))
        return (
            f"run-batch: {self.lines} lines, {self.skipped} already in the output, "
            f"{self.answered} answered, {refused} refused{f' ({reasons})' if reasons else ''}; "
            f"{self.seconds:.1f} s ({rate:.2f} lines/s)"
        )


class Progress:
    """Counts each answered line into `summary` and shows it: a bar on a terminal, else a line."""

    def __init__(
        self, summary: Summary, stream: TextIO, every: float = PLAIN_EVERY_SECONDS, bar: bool | None = None
    ) -> None:
        self.summary = summary
        self.stream = stream
        self.every = every
        self.todo = summary.lines - summary.skipped
        self.started = time.monotonic()
        self.shown = self.started
        use_bar = stream.isatty() if bar is None else bar
        self.bar = None
        if use_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=self.todo, unit="line", file=stream, dynamic_ncols=True, smoothing=0.1)

    def __call__(self, result: dict[str, Any]) -> None:
        self.summary.count(result)
        if self.bar is not None:
            self.bar.update(1)
            return
        now = time.monotonic()
        if now - self.shown >= self.every:
            self.shown = now
            print(self.line(now), file=self.stream, flush=True)

    def line(self, now: float) -> str:
        """`run-batch: 120/980 lines (12%), 9.8 lines/s, about 88 s left`."""
        done, elapsed = self.summary.done, now - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        left = f"about {(self.todo - done) / rate:.0f} s left" if rate > 0 else "time left unknown"
        share = 100 * done / self.todo if self.todo else 100.0
        return f"run-batch: {done}/{self.todo} lines ({share:.0f}%), {rate:.2f} lines/s, {left}"

    def close(self) -> Summary:
        """Stop the bar and print the summary; returns it with the seconds filled in."""
        if self.bar is not None:
            self.bar.close()
        self.summary.seconds = time.monotonic() - self.started
        print(self.summary.render(), file=self.stream, flush=True)
        return self.summary
