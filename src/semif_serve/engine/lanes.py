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
tokens they compute (the largest chain first, each to the lightest share). Whole chains leave two
shares a chain apart where the count is odd (7 prompts: 4 against 3, the engine thread's 4 setting
the time), so where they stay `HANDOVER_AT` tokens apart the heavier share's longest sequence is
split: its head stays, its tail and the rows continuing it move to the lighter share, and the head
hands its state to the tail layer by layer as it computes it (`packed.Handover`; the head runs
first in its layer, the tail last in its own, so the lighter lane seldom waits). Measured in
process, bf16, ~281-token prompts: 3, 5, 7 and 9 prompts 1.06x, 1.15x, 1.05x and 1.07x faster; 16
clients' server +10% (bench/RESULTS.md). A forward of one chain (a lone request's state and rows)
of `lone_split_tokens` or more splits its sequence the same way, the head in the engine thread's
lane: the tail's layer l waits only for the head's layer l, so the lanes run a layer apart, and
with the head `L / (2L - 1)` of the chain's tokens (L layers) both end together. Measured in
process, one prompt: 1.05-1.25x faster in bf16 from ~220 tokens (level at 176-192, 0.84-0.94x at
96-160), level in float32 at 282 and 1.06-1.07x from 560; the one-client server in bf16 +7%
(docs/packing.md, "Lanes"). A sequence is not split beside a lighter share of under
`MIN_SHARE_TOKENS` of its own work.
A forward splits only where that pays: on the CPU (the engine gives a GPU's forwards one lane),
with two or more intra-op threads chosen for it and no more than the lanes allowed (a lane of two
threads would open an OpenMP team beside the engine thread's, `engine.threads`: a larger machine
raises `SEMIF_FORWARD_LANES` to its cores, or runs whole); with no image in it (its image set computes
each image's features once, on first use, for the whole forward); and with every share at least
`MIN_SHARE_TOKENS` and none over `MOST_SHARE` of the forward's tokens (one thread over most of the
work is slower than two over all of it). Every row still equals its sequence run alone: each share
is a packed forward, with that guarantee, and a handed-over tail continues its head's state as a
stored state's rows do (tests/engine/test_lanes.py). A lane that fails fails every state it hands
over, so the other lane's wait raises rather than hangs. What runs per thread in a
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
from semif_serve.engine.packed import Handover, HandoverFailed, Packed, Segment, packed_forward

# Lanes at most, each on one thread: measured on 2 cores only (the GIL between ops is shared).
MOST_LANES = 2
# Tokens a share computes at least: below it the GIL-held work between ops outweighs the gain.
MIN_SHARE_TOKENS = 192
# The largest share of a forward's tokens one lane may take (two threads scale ~1.5x, so one thread
# over more than ~60% of the work finishes after two threads over all of it).
MOST_SHARE = 0.6
# Whole chains this many tokens apart between two shares: one sequence is split across them (at 16
# clients' ~7 prompts a forward, 4 against 3 whole prompts cost ~8-13% over halving the 7th).
HANDOVER_AT = 64
# Each part of a sequence split across the lanes at least this many tokens.
MIN_PART_TOKENS = 32
# A forward of one chain splits from this many tokens (`lone_split_tokens`): measured on this
# 2-core machine, one prompt in two lanes against whole on two threads, bf16 level at 176 and 192
# tokens, 1.02-1.11x at 208, 1.05-1.25x at 224-282; float32 level at 282, 1.06x at 560.
LONE_SPLIT_TOKENS_BF16 = 192
LONE_SPLIT_TOKENS = 512


@dataclasses.dataclass(frozen=True)
class Share:
    """One lane's packed forward: its `segments` (parents renumbered within it), each one's index in
    the whole forward (`origins`; None for the first part of a sequence split across the lanes,
    which returns nothing), and the states it hands to the other lane (`handovers`)."""

    segments: list[Segment]
    origins: list[int | None]
    handovers: list[Handover]


def lone_split_tokens(dtype: Any) -> int:
    """The fewest tokens a forward of one chain splits across two lanes at, for a model of `dtype`."""
    import torch

    return LONE_SPLIT_TOKENS_BF16 if dtype == torch.bfloat16 else LONE_SPLIT_TOKENS


def shares(
    segments: Sequence[Segment], lanes: int, lone_at: int | None = None, layers: int = 1
) -> list[Share] | None:
    """`segments` in `lanes` shares of whole chains, balanced by tokens, the heaviest first; with two
    lanes still `HANDOVER_AT` tokens apart, the heavier's longest sequence split between them
    (`_handed_over`). A forward of one chain of `lone_at` tokens or more, with two lanes, hands its
    sequence's tail to the second, the head keeping `layers / (2 layers - 1)` of the chain's tokens
    (the module docstring). None where the forward does not split (fewer chains than lanes
    otherwise, a share under `MIN_SHARE_TOKENS`, or one over `MOST_SHARE` of the tokens)."""
    if lanes < 2:
        return None
    chains = _chains(segments)
    if len(chains) == 1 and lanes == 2 and lone_at is not None:
        total = sum(len(s.ids) for s in segments)
        if total < lone_at:
            return None
        head = round(total * layers / (2 * layers - 1))
        return _handed_over(segments, chains, [list(range(len(segments))), []], total - head)
    if len(chains) < lanes:
        return None
    weight = {r: sum(len(segments[i].ids) for i in members) for r, members in chains.items()}
    split: list[list[int]] = [[] for _ in range(lanes)]
    loads = [0] * lanes
    for r in sorted(chains, key=lambda r: -weight[r]):
        lightest = loads.index(min(loads))
        split[lightest].extend(chains[r])
        loads[lightest] += weight[r]
    order = sorted(range(lanes), key=lambda lane: -loads[lane])
    split, loads = [sorted(split[lane]) for lane in order], [loads[lane] for lane in order]
    # The lighter share keeps work of its own to do while its tail waits.
    if lanes == 2 and loads[0] - loads[1] >= HANDOVER_AT and loads[1] >= MIN_SHARE_TOKENS:
        handed = _handed_over(segments, chains, split, (loads[0] - loads[1]) // 2)
        if handed is not None:
            return handed
    if min(loads) < MIN_SHARE_TOKENS or max(loads) > MOST_SHARE * sum(loads):
        return None
    return [Share(_renumbered(segments, share, {}), list(share), []) for share in split]


def _chains(segments: Sequence[Segment]) -> dict[int, list[int]]:
    """Each chain's segments (a segment and every one it continues or that continues it), by root."""
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
    return chains


def _handed_over(
    segments: Sequence[Segment], chains: dict[int, list[int]], split: list[list[int]], move: int
) -> list[Share] | None:
    """Two shares of whole chains (the second may be empty), `move` tokens moved from the first to
    the second by splitting one sequence of the first: the longest chain root there whose tail (at
    least `MIN_PART_TOKENS`) and everything continuing it come to `move` tokens, its head (as long)
    staying and handing its state to the tail layer by layer (`packed.Handover`); None where none
    can. The head's share comes first: the engine thread runs it, so the waiting tail is always on a
    lane's thread and no forward waits on one queued behind it."""
    heavy, light = split
    roots = sorted((r for r in chains if r in heavy), key=lambda r: -len(segments[r].ids))
    for r in roots:
        root = segments[r]
        after = [i for i in chains[r] if i != r]  # every segment continuing the root moves with its tail
        head = len(root.ids) - (move - sum(len(segments[i].ids) for i in after))
        if not MIN_PART_TOKENS <= head <= len(root.ids) - MIN_PART_TOKENS:
            continue
        before = root.start.ids if root.start is not None else ()
        handover = Handover((*before, *root.ids[:head]))
        first = dataclasses.replace(root, ids=root.ids[:head], keep=False, read=False, hand_to=handover)
        tail = dataclasses.replace(root, ids=root.ids[head:], start=handover)
        stays = [i for i in heavy if i not in chains[r]] + [r]
        goes = sorted(light) + [r, *after]
        staying = _renumbered(segments, sorted(stays), {r: first})
        going = _renumbered(segments, goes, {r: tail})
        origins_stay: list[int | None] = [None if i == r else i for i in sorted(stays)]
        return [Share(staying, origins_stay, [handover]), Share(going, list(goes), [])]
    return None


def _renumbered(
    segments: Sequence[Segment], share: Sequence[int], replaced: dict[int, Segment]
) -> list[Segment]:
    """The segments of one share (`replaced` standing in for some), each parent renumbered within it."""
    local = {i: n for n, i in enumerate(share)}
    renumbered = []
    for i in share:
        segment = replaced.get(i, segments[i])
        parent = segment.parent
        renumbered.append(dataclasses.replace(segment, parent=None if parent is None else local[parent]))
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
        layers = len(model.get_decoder().layers)
        split = None if images else shares(segments, lanes, lone_split_tokens(model.dtype), layers)
        if split is None:
            return packed_forward(model, segments, adapters)
        pool = self._lanes()
        torch.set_num_threads(1)
        try:
            # Submitted last: nothing between it and the head's forward can leave a tail waiting.
            others = [pool.submit(_on_one_thread, model, share, adapters) for share in split[1:]]
            try:
                first = _share_forward(model, split[0], adapters)
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


def _on_one_thread(model: Any, share: Share, adapters: AdapterBank | None) -> Packed:
    import torch

    torch.set_num_threads(1)  # this lane's own count (OpenMP's is per thread)
    return _share_forward(model, share, adapters)


def _share_forward(model: Any, share: Share, adapters: AdapterBank | None) -> Packed:
    """A share's packed forward. The states it hands over fail with it, and once it ends a wait
    for a layer it never gave raises rather than hangs."""
    try:
        return packed_forward(model, share.segments, adapters)
    except BaseException as failure:
        for handover in share.handovers:
            handover.fail(failure)
        raise
    finally:
        for handover in share.handovers:
            handover.fail(HandoverFailed("the forward handing this state over has ended"))


def _settle(futures: Sequence[Future[Packed]]) -> None:
    for future in futures:
        try:
            future.result()
        except BaseException:  # noqa: BLE001 - the first lane's failure is the one raised
            pass


def _merged(split: Sequence[Share], results: Sequence[Packed]) -> Packed:
    hidden: dict[int, Any] = {}
    caches: dict[int, Any] = {}
    for share, packed in zip(split, results, strict=True):
        hidden.update({share.origins[n]: h for n, h in packed.hidden.items()})  # type: ignore[misc]
        caches.update({share.origins[n]: c for n, c in packed.caches.items()})  # type: ignore[misc]
    return Packed(hidden, caches, sum(p.tokens for p in results), lanes=len(results))
