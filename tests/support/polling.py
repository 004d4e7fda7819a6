"""Waiting for something the test can observe, with a deadline: never a fixed sleep (issue 49).

A fixed sleep is too short on a busy machine (a flaky failure) and too long on an idle one; a poll
on the condition itself waits exactly as long as it takes and, past its deadline, fails naming
what it waited for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Deadline:
    """`timeout` seconds from now; `check` raises AssertionError naming `what` once they pass."""

    def __init__(self, timeout: float, what: str) -> None:
        self.timeout, self.what = timeout, what
        self.at = time.monotonic() + timeout

    def check(self) -> None:
        if time.monotonic() >= self.at:
            raise AssertionError(f"timed out after {self.timeout:g} s waiting for {self.what}")


def wait_until(
    condition: Callable[[], T], timeout: float = 60.0, what: str = "the condition", every: float = 0.01
) -> T:
    """`condition()`'s first truthy value, polled every `every` seconds; AssertionError naming
    `what` once `timeout` seconds have passed without one."""
    deadline = Deadline(timeout, what)
    while not (value := condition()):
        deadline.check()
        time.sleep(every)
    return value


async def wait_until_async(
    condition: Callable[[], T], timeout: float = 60.0, what: str = "the condition", every: float = 0.01
) -> T:
    """`wait_until` inside an event loop: the loop runs the other tasks between two polls."""
    deadline = Deadline(timeout, what)
    while not (value := condition()):
        deadline.check()
        await asyncio.sleep(every)
    return value
