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


def wait_until(
    condition: Callable[[], T], timeout: float = 10.0, what: str = "the condition", every: float = 0.01
) -> T:
    """`condition()`'s first truthy value, polled every `every` seconds; AssertionError naming
    `what` once `timeout` seconds have passed without one."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


async def wait_until_async(
    condition: Callable[[], T], timeout: float = 10.0, what: str = "the condition", every: float = 0.01
) -> T:
    """`wait_until` inside an event loop: the loop runs the other tasks between two polls."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(every)
