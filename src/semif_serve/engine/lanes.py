"""Forward lanes: on the CPU, a packed forward's independent sequences split into shares, each
share a packed forward of its own on a thread of its own with one intra-op thread, the shares at
once, as many as the forward's intra-op threads (docs/packing.md, "Lanes").

Why: a forward's ops scale less than linearly with threads (two threads ran a packed forward of 8
prompts 1.5x faster than one, not 2x: every op waits at its barrier for the slower thread, and
small ops split too finely), while two forwards on one thread each share nothing but the GIL
between ops. Measured on this 2-core machine (in process, ~281-token prompts, `bench/packing.py
--only lanes`, two runs): 4, 8, 16 prompts 1.16-1.56x, 1.12-1.23x, 1.08-1.13x faster in two lanes
than whole on two threads in bf16, 1.25-1.27x, 1.08-1.14x, 1.04-1.21x in float32. Under ~190
tokens a share the Python between ops, which holds the GIL, can outweigh it: 2 x 64 tokens
0.82-0.98x in bf16, 2 x 16 0.6x.

A share is whole chains (a segment and every segment of the forward it continues or that continues
it: a new state and its rows); segments over one stored state (the preamble every prompt opens
with, a cached state) are chains of their own, since they only read it. Shares are balanced by the
tokens they compute (the largest chain first, each to the lightest share). A forward splits only
where that pays: on the CPU (the engine gives a GPU's forwards one lane), with two or more intra-op
threads chosen for it and no more than the lanes allowed (a lane of two threads would open an
OpenMP team beside the engine thread's, `engine.threads`: a larger machine raises
`SEMIF_FORWARD_LANES` to its cores, or runs whole); with no image in it (its image set computes
each image's features once, on first use, for the whole forward); and with every share at least
`MIN_SHARE_TOKENS` and none over `MOST_SHARE` of the forward's tokens (one thread over most of the
work is slower than two over all of it). Every row still equals its sequence run alone: each share
is a packed forward, with that guarantee (tests/engine/test_lanes.py). What runs per thread in a
share: torch's intra-op count (OpenMP's is per thread), the adapter rows selected
(`AdapterBank.rows`), the flushing of subnormals (`linear_attention_cpu.accelerated_kernels`);
the weights and stored states are only read.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from semif_serve.engine.adapters import AdapterBank
from semif_serve.engine.packed import Packed, Segment, packed_forward

# Lanes at most, each on one thread: measured on 2 cores only (the GIL between ops is shared).
MOST_LANES = 2
# Tokens a share computes at least: below it the GIL-held work between ops outweighs the gain.
MIN_SHARE_TOKENS = 192
# The largest share of a forward's tokens one lane may take (two threads scale ~1.5x, so one thread
# over more than ~60% of the work finishes after two threads over all of it).
MOST_SHARE = 0.6


def shares(segments: Sequence[Segment], lanes: int) -> list[list[int]] | None:
    """`segments`' indices in `lanes` shares of whole chains, balanced by tokens, the heaviest first,
    each in forward order; None where the forward does not split (fewer chains than lanes, a share under
    `MIN_SHARE_TOKENS`, or one over `MOST_SHARE` of the tokens)."""
    if lanes < 2:
        return None
    root = list(range(len(segments)))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for i, segment in enumerate(segments):
        if segment.parent is not None:
            root[find(i)] = find(segment.parent)
    chains: dict[int, list[int]] = {}
    for i in range(len(segments)):
        chains.setdefault(find(i), []).append(i)
    if len(chains) < lanes:
        return None
    weight = {r: sum(len(segments[i].ids) for i in members) for r, members in chains.items()}
    split: list[list[int]] = [[] for _ in range(lanes)]
    loads = [0] * lanes
    for r in sorted(chains, key=lambda r: -weight[r]):
        lightest = loads.index(min(loads))
        split[lightest].extend(chains[r])
        loads[lightest] += weight[r]
    if min(loads) < MIN_SHARE_TOKENS or max(loads) > MOST_SHARE * sum(loads):
        return None
    heaviest_first = sorted(range(lanes), key=lambda lane: -loads[lane])
    return [sorted(split[lane]) for lane in heaviest_first]


def share_segments(segments: Sequence[Segment], share: Sequence[int]) -> list[Segment]:
    """The segments of one share, each parent renumbered within it (a share holds whole chains)."""
    local = {i: n for n, i in enumerate(share)}
    renumbered = []
    for i in share:
        parent = segments[i].parent
        renumbered.append(dataclasses.replace(segments[i], parent=None if parent is None else local[parent]))
    return renumbered


class ForwardLanes:
    """Runs packed forwards, split into at most `most` lanes where that pays (see the module
    docstring; the engine gives a CPU's forwards `EngineOptions.forward_lanes`, a GPU's one); counts
    the forwards it split (`split_forwards`, by the engine thread only)."""

    def __init__(self, most: int = MOST_LANES) -> None:
        self.most = most
        self.split_forwards = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def forward(self, model: Any, segments: Sequence[Segment], adapters: AdapterBank | None = None) -> Packed:
        """`packed_forward(model, segments, adapters)`, its shares in lanes where it splits."""
        import torch

        threads = torch.get_num_threads()
        # One intra-op thread a lane: a lane of more would open an OpenMP team beside the engine
        # thread's, and with more of their threads than cores OpenMP stops spinning (engine.threads).
        lanes = threads if threads <= self.most else 1
        images = any(s.images is not None for s in segments)
        split = None if images else shares(segments, lanes)
        if split is None:
            return packed_forward(model, segments, adapters)
        parts = [share_segments(segments, share) for share in split]
        pool = self._lanes()
        others = [pool.submit(_on_one_thread, model, part, adapters) for part in parts[1:]]
        torch.set_num_threads(1)
        try:
            first = packed_forward(model, parts[0], adapters)
        except BaseException:
            _settle(others)  # no lane still runs when the failure reaches the engine
            raise
        finally:
            torch.set_num_threads(threads)
        try:
            rest = [other.result() for other in others]
        except BaseException:
            _settle(others)
            raise
        results = [first, *rest]
        self.split_forwards += 1
        return _merged(split, results)

    def _lanes(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():  # a forked child starts its own
                self._pool = ThreadPoolExecutor(max_workers=self.most - 1, thread_name_prefix="semif-lane")
                self._pid = os.getpid()
            return self._pool

    def close(self) -> None:
        """Stop the lanes' threads (after any share running)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _on_one_thread(model: Any, segments: list[Segment], adapters: AdapterBank | None) -> Packed:
    import torch

    torch.set_num_threads(1)  # this lane's own count (OpenMP's is per thread)
    return packed_forward(model, segments, adapters)


def _settle(futures: Sequence[Future[Packed]]) -> None:
    for future in futures:
        try:
            future.result()
        except BaseException:  # noqa: BLE001 - the first lane's failure is the one raised
            pass


def _merged(split: Sequence[Sequence[int]], results: Sequence[Packed]) -> Packed:
    hidden: dict[int, Any] = {}
    caches: dict[int, Any] = {}
    for share, packed in zip(split, results, strict=True):
        hidden.update({share[n]: h for n, h in packed.hidden.items()})
        caches.update({share[n]: c for n, c in packed.caches.items()})
    return Packed(hidden, caches, sum(p.tokens for p in results), lanes=len(results))
