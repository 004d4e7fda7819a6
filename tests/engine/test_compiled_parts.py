"""How the compiled CPU kernels' work is split across threads (`engine.compiled_parts.run_split`):
every item once, in parts no smaller than asked, and no call held by a worker thread that is late."""

from __future__ import annotations

import threading

import pytest

from semif_serve.engine import compiled_parts


def _recorded(items: int, threads: int, min_items: int) -> list[tuple[int, int, int]]:
    """The parts `run_split` hands out: (lo, hi, thread id)."""
    parts: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def work(lo: int, hi: int) -> None:
        with lock:
            parts.append((lo, hi, threading.get_ident()))

    compiled_parts.run_split(work, items, threads, min_items)
    return parts


SPLITS = [(1, 2, 1), (10, 2, 3), (1000, 2, 7), (64, 4, 1), (5, 1, 1)]  # (items, threads, min_items)


@pytest.mark.parametrize(("items", "threads", "min_items"), SPLITS)
def test_every_item_is_worked_once_in_contiguous_parts_no_smaller_than_asked(items, threads, min_items):
    parts = sorted(_recorded(items, threads, min_items))
    covered = [i for lo, hi, _ in parts for i in range(lo, hi)]
    assert covered == list(range(items))
    assert all(hi - lo >= min(min_items, items) for lo, hi, _ in parts)


def test_one_thread_or_one_part_runs_on_the_calling_thread_alone() -> None:
    me = threading.get_ident()
    assert {who for *_, who in _recorded(100, 1, 1)} == {me}
    assert {who for *_, who in _recorded(10, 2, 10)} == {me}


def test_a_call_whose_worker_threads_are_all_busy_finishes_on_the_calling_thread() -> None:
    # A worker the OS has not scheduled yet must not hold the call: its parts go to the caller.
    pool = compiled_parts._threads_pool()
    release = threading.Event()
    blockers = [pool.submit(release.wait, 30) for _ in range(pool._max_workers)]
    finished = threading.Event()
    recorded: list[list[tuple[int, int, int]]] = []

    def call() -> None:
        recorded.append(_recorded(64, 2, 1))
        finished.set()

    caller = threading.Thread(target=call)
    try:
        caller.start()
        assert finished.wait(10), "the call waited for a busy worker thread"
        assert {who for *_, who in recorded[0]} == {caller.ident}
        assert sorted(i for lo, hi, _ in recorded[0] for i in range(lo, hi)) == list(range(64))
    finally:
        release.set()
        caller.join(30)
        for blocker in blockers:
            blocker.result(30)
