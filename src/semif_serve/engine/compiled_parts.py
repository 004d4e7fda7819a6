"""What the engine's compiled CPU kernels (numba) share: how they are compiled, and how a call's
work is split across the forward's threads (the calling thread and worker threads of their own,
taking its parts in turn).

Worker threads flush subnormals to zero for their whole life (they run only these kernels); a
forked child starts its own (a fork copies none of the parent's threads). Numba is imported
only by the modules that define kernels, which only the CPU path imports.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("semif_serve.engine")

# Parts per thread: small enough that a late thread's share is soon taken by the others.
_PARTS_PER_THREAD = 4
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def compiled(function: Any) -> Any:
    """`function` compiled by numba at first use (nogil, fastmath, numpy's error model: a division
    by zero gives inf or NaN rather than raising, so a loop that divides still vectorises), and
    cached on disk where numba finds a writable place (beside its file, else NUMBA_CACHE_DIR or
    ~/.cache/numba); else compiled anew at each start."""
    import numba

    # numba keys a cached kernel on its own file: a change here reaches it once that file changes.
    options = {"nogil": True, "fastmath": True, "boundscheck": False, "error_model": "numpy"}
    try:
        return numba.njit(cache=True, **options)(function)
    except RuntimeError:  # numba found no writable cache directory
        log.warning("a compiled CPU kernel is not cached: no writable cache directory")
        return numba.njit(cache=False, **options)(function)


def run_split(work: Callable[[int, int], None], items: int, threads: int, min_items: int) -> None:
    """`work(lo, hi)` over `0:items` in contiguous parts, each at least `min_items` long (handing a
    smaller part to another thread costs more than it saves), taken in turn by the calling thread
    and up to `threads - 1` workers: a thread the OS has not scheduled yet leaves its parts to the
    others, so no call waits for one late thread's fixed half (docs/packing.md)."""
    parts = max(1, min(threads * _PARTS_PER_THREAD, items // max(1, min_items)))
    if parts == 1 or threads == 1:
        work(0, items)
        return
    cuts = [items * p // parts for p in range(parts + 1)]
    claims = itertools.count()  # next() is atomic: each part is taken once

    def take_parts() -> None:
        while (part := next(claims)) < parts:
            work(cuts[part], cuts[part + 1])

    pool = _threads_pool()
    others = [pool.submit(take_parts) for _ in range(min(threads, parts) - 1)]
    take_parts()
    for other in others:
        if not other.cancel():  # one not started yet has nothing left to take
            other.result()


def _threads_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=max(1, (os.cpu_count() or 1) - 1),
                thread_name_prefix="semif-kernel",
                initializer=_flush_subnormals,
            )
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's worker threads do not exist here, so start new ones."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _flush_subnormals() -> None:
    import torch

    torch.set_flush_denormal(True)
