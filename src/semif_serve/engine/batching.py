"""Cross-request batching: plan the forwards for what is queued, and the loop that runs them.

`plan_groups` is pure (no torch, no asyncio): requests over the same state prefix share one
group (one prefill, or one cache hit); rows go into right-padded groups bounded by
`max_batch_rows` and `max_batch_tokens` (padded tokens = rows x widest suffix: what the group's
forward runs over the prefilled state; the prefix is prefilled once for all its groups, in its
own chunks, and is not charged to each group); a request's rows are split only when the
request alone exceeds the bounds. `Batcher` is the asyncio side: when the engine is free it
takes everything queued (waiting on purpose only to gather, below), drops cancelled requests
before their forward, runs each group on the engine thread through `run_group`, and when a
merged group fails, retries each request alone so that one bad request fails alone.

Fairness: what is taken together is one round of groups; rounds take turns a group at a time,
and requests that arrive while a group runs form a new round that leads the next turn, its
cheapest groups first. So a small request waits for at most the one step running when it
arrives, never for every forward of a heavy request taken before it, nor for the other rounds
waiting their turn. Packing, the turn a new round leads also takes a step of the round whose
turn it was (past the token budget if need be), so new arrivals never stall the rounds already
waiting. A step is one group (packing, at most one budget of one request's rows: a group past
the budget alone is cut by rows), or one slice of a long prefill: `run_group` may return
`UNFINISHED` (it did part of the group's work and keeps it), and the group runs again at its
round's next turn.

Gathering: a forward's answers go back to clients that often send their next request at once,
while the requests queued behind that forward wait for the engine. Started at once, the next
forward carries only those; the answered clients' requests then wait through it and form the
forward after, and the two cohorts alternate in forwards half as full as they could be (two
closed-loop clients each get one-request forwards, and less than one client alone). So when a
turn answered requests and other work waits, the next turn waits for the answered clients'
requests: until as many have arrived as were answered, or the waiting work leaves no room in the
token budget for another like them, or `max_gather_seconds` passes, and never longer than
`GATHER_SHARE` of the forward just run. An engine that finds nothing waiting never waits: a
lone request runs at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

P = TypeVar("P")  # what the engine needs of a job (its payload)
R = TypeVar("R")  # one row's result


@dataclass(frozen=True)
class Job(Generic[P]):
    """One request to score: `row_tokens[i]` is row i's token count after the state prefix
    (the whole prompt when `prefix_key` is None); `payload` is what the engine needs of it."""

    id: Hashable
    prefix_key: Hashable | None
    prefix_tokens: int
    row_tokens: tuple[int, ...]
    payload: P = field(compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.row_tokens or min(self.row_tokens) < 1:
            raise ValueError("a job needs at least one row of at least one token")
        if self.prefix_key is None and self.prefix_tokens:
            raise ValueError("a job without a prefix key has no prefix tokens")


@dataclass(frozen=True)
class Part(Generic[P]):
    """Rows `start:stop` of one job, as they run in one group."""

    job: Job[P]
    start: int
    stop: int

    @property
    def row_tokens(self) -> tuple[int, ...]:
        return self.job.row_tokens[self.start : self.stop]


@dataclass(frozen=True)
class Group(Generic[P]):
    """One forward: parts of jobs over the same state prefix (or none), right-padded together."""

    prefix_key: Hashable | None
    prefix_tokens: int
    parts: tuple[Part[P], ...]

    @property
    def rows(self) -> int:
        return sum(p.stop - p.start for p in self.parts)

    @property
    def width(self) -> int:
        return max(max(p.row_tokens) for p in self.parts)

    @property
    def true_tokens(self) -> int:
        return sum(sum(p.row_tokens) for p in self.parts)

    @property
    def padded_tokens(self) -> int:
        """What the bounds limit: rows x widest row (the suffix forward over the prefilled state)."""
        return self.rows * self.width

    @property
    def job_ids(self) -> tuple[Hashable, ...]:
        return tuple(p.job.id for p in self.parts)

    def keeping(self, job_ids: set[Hashable]) -> Group[P] | None:
        """This group with only the parts of `job_ids`; None when nothing is left."""
        parts = tuple(p for p in self.parts if p.job.id in job_ids)
        return Group(self.prefix_key, self.prefix_tokens, parts) if parts else None


# Tokens one packed forward computes (new states' tokens and rows, every group's), vLLM's
# `max_num_batched_tokens`: on this CPU a sequence costs least packed 1-4k tokens deep (bf16 best
# by 2k; docs/packing.md), and at one prefill chunk's worth the memory estimate stays exact.
FORWARD_TOKENS = 2048

# The longest the next turn waits for the requests of clients a forward just answered (the
# setting's default), and the share of that forward it may add: 2 closed-loop clients gained
# 22-43%, 4 17-26%, 8 7-12%, 1 and 16 level (docs/packing.md, "Gathering").
GATHER_SECONDS = 0.025
GATHER_SHARE = 0.25


@dataclass(frozen=True)
class Bounds:
    """Limits on one forward; a single row past them still runs alone (the engine judges it).
    `max_batch_rows` and `max_batch_tokens` bound one group (rows over one state);
    `max_forward_tokens` the tokens a packed forward of several groups computes (the first group
    of a turn always runs); `max_gather_seconds` the longest a turn waits for the requests of the
    clients the turn before answered (0: never; the module's "Gathering")."""

    max_batch_rows: int = 64
    max_batch_tokens: int = 16_384
    max_forward_tokens: int = FORWARD_TOKENS
    max_gather_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.max_batch_rows < 1 or self.max_batch_tokens < 1 or self.max_forward_tokens < 1:
            raise ValueError("batch bounds must be >= 1")
        if not 0 <= self.max_gather_seconds <= 1:
            raise ValueError("max_gather_seconds must be within 0..1")

    def fits(self, group: Group[Any]) -> bool:
        return group.rows <= self.max_batch_rows and group.padded_tokens <= self.max_batch_tokens


def plan_groups(jobs: Sequence[Job[P]], bounds: Bounds) -> list[Group[P]]:
    """The forwards to run for `jobs`, deterministic in their order.

    Jobs are bucketed by prefix key (first appearance first); within a bucket each job goes
    whole into the first group it fits, else opens a new one; a job that fits no group even
    alone is cut into consecutive row slices, each as large as fits (at least one row).
    """
    buckets: dict[Hashable, list[Group[P]]] = {}
    ids: set[Hashable] = set()
    for job in jobs:
        if job.id in ids:
            raise ValueError(f"job id {job.id!r} appears twice")
        ids.add(job.id)
        key = ("prefix", job.prefix_key) if job.prefix_key is not None else ("none",)
        groups = buckets.setdefault(key, [])
        if groups and groups[0].prefix_tokens != job.prefix_tokens:
            raise ValueError(f"job {job.id!r} disagrees on the length of prefix {job.prefix_key!r}")
        whole = Part(job, 0, len(job.row_tokens))
        for i, group in enumerate(groups):
            merged = Group(group.prefix_key, group.prefix_tokens, (*group.parts, whole))
            if bounds.fits(merged):
                groups[i] = merged
                break
        else:
            alone = Group(job.prefix_key, job.prefix_tokens, (whole,))
            groups.extend([alone] if bounds.fits(alone) else _slices(job, bounds))
    return [group for groups in buckets.values() for group in groups]


def _slices(job: Job[P], bounds: Bounds) -> list[Group[P]]:
    groups: list[Group[P]] = []
    start = 0
    while start < len(job.row_tokens):
        stop = start + 1
        while stop < len(job.row_tokens) and bounds.fits(
            Group(job.prefix_key, job.prefix_tokens, (Part(job, start, stop + 1),))
        ):
            stop += 1
        groups.append(Group(job.prefix_key, job.prefix_tokens, (Part(job, start, stop),)))
        start = stop
    return groups


def _rest(group: Group[P], head: Group[P]) -> Group[P]:
    """`group` without what `head` took: its leading parts, the last of them maybe only its
    leading rows (the rest of that part then leads)."""
    taken, last = len(head.parts), head.parts[-1]
    whole = group.parts[taken - 1]
    tail = (Part(whole.job, last.stop, whole.stop),) if last.stop < whole.stop else ()
    return Group(group.prefix_key, group.prefix_tokens, tail + group.parts[taken:])


class Unfinished:
    """What `run_group` returns when it did one slice of a group's work: run it again later.
    `done` holds the results of the jobs it finished meanwhile: they are delivered now and left
    out of the group's next turn."""

    def __init__(self, done: Mapping[Hashable, Sequence[Any]] | None = None) -> None:
        self.done: dict[Hashable, Sequence[Any]] = dict(done or {})

    def __repr__(self) -> str:
        return f"UNFINISHED({len(self.done)} done)" if self.done else "UNFINISHED"


UNFINISHED = Unfinished()


@dataclass
class BatchStats:
    """Counters of the batcher's forwards (a snapshot is a copy)."""

    forwards: int = 0
    rows: int = 0
    true_tokens: int = 0
    padded_tokens: int = 0
    merged_forwards: int = 0  # forwards that carried more than one request
    isolated_retries: int = 0  # requests rerun alone after their merged forward failed
    cancelled_dropped: int = 0
    gathers: int = 0  # turns that waited for answered clients' requests
    gather_seconds: float = 0.0  # how long those waits took, in all
    gathered: int = 0  # requests that arrived during those waits


@dataclass
class Wait:
    """How long a job waited for the engine, from its submission to the start of its first
    forward (behind other requests' work: the engine runs nothing else)."""

    seconds: float = 0.0


class _Pending(Generic[P]):
    def __init__(self, job: Job[P], future: asyncio.Future, wait: Wait) -> None:
        self.job = job
        self.future = future
        self.wait = wait
        self.queued_at = time.perf_counter()
        self.started = False
        self.rows: dict[int, list[Any]] = {}

    def deliver(self, part: Part[P], results: Sequence[Any]) -> None:
        if len(results) != part.stop - part.start:
            raise RuntimeError(f"run_group returned {len(results)} results for {part.stop - part.start} rows")
        self.rows[part.start] = list(results)
        if sum(len(r) for r in self.rows.values()) == len(self.job.row_tokens) and not self.future.done():
            self.future.set_result([r for start in sorted(self.rows) for r in self.rows[start]])

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


Outcome = Mapping[Hashable, Sequence[Any]] | Unfinished  # what running one group returns


class Batcher(Generic[P, R]):
    """Queues jobs with futures and runs them, merged, on the engine thread.

    `run_group(group)` runs on `executor` (one thread: the engine's) and returns, for every job
    in the group, the results of that job's rows in the group, in order; it raises to fail
    the group. With `run_groups` (groups -> one outcome each, in order) every turn packs the
    groups waiting into one call, up to `bounds.max_forward_tokens` by `cost` (the tokens a
    group computes; the first group always runs), taken a group per round in turn. `submit(job)`
    resolves to the job's row results in row order. It runs nothing but jobs: with none queued
    the engine thread is free.
    """

    def __init__(
        self,
        run_group: Callable[[Group[P]], Outcome] | None,
        bounds: Bounds,
        executor: Executor | None = None,
        *,
        run_groups: Callable[[Sequence[Group[P]]], Sequence[Outcome]] | None = None,
        cost: Callable[[Group[P]], int] | None = None,
    ) -> None:
        if run_groups is None:
            if run_group is None:
                raise ValueError("a batcher needs run_group or run_groups")
            one = run_group
            run_groups = lambda groups: [one(g) for g in groups]  # noqa: E731 - one group per turn
        self.run_groups = run_groups
        self.packs = run_group is None  # several groups per turn
        self._cost = cost
        self.bounds = bounds
        self._own_executor = executor is None
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="semif-batch")
        self._queue: list[_Pending[P]] = []
        self._arrived: asyncio.Event | None = None  # set at each submit, for a gathering turn
        self._forward_seconds = 0.0  # the last call's
        self._ids: set[Hashable] = set()  # jobs queued or running: ids must be unique among them
        self._task: asyncio.Task | None = None
        self._stats = BatchStats()
        self._stats_lock = threading.Lock()

    @property
    def queued(self) -> int:
        """Jobs waiting for the engine (not counting the group running now)."""
        return len(self._queue)

    @property
    def admitted(self) -> int:
        """Jobs submitted and not yet answered: queued, or in a turn (running or about to)."""
        return len(self._ids)

    def stats(self) -> BatchStats:
        """A copy of the counters, readable from any thread."""
        with self._stats_lock:
            return BatchStats(**vars(self._stats))

    async def submit(self, job: Job[P], wait: Wait | None = None) -> list[R]:
        """Queue `job` and wait for its rows' results; cancelling the caller drops the job
        if its forward has not started. `wait`, when given, is filled with how long the job
        waited for the engine before its first forward started."""
        if job.id in self._ids:
            raise ValueError(f"job id {job.id!r} is already queued or running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._ids.add(job.id)
        future.add_done_callback(lambda _: self._ids.discard(job.id))
        self._queue.append(_Pending(job, future, wait or Wait()))
        if self._arrived is not None:
            self._arrived.set()
        # One drain task at a time; it ends when the queue is empty, so no task outlives its loop.
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._queue = [p for p in self._queue if p.future.get_loop() is loop]
            self._task = loop.create_task(self._drain())
        return await future

    async def close(self) -> None:
        """Stop the loop (queued jobs are cancelled) and the batcher's own executor."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for pending in self._queue:
            pending.future.cancel()
        self._queue.clear()
        if self._own_executor:
            self.executor.shutdown(wait=False)

    async def _drain(self) -> None:
        """Run the queued rounds a turn at a time until nothing is left. What arrives while a turn
        runs becomes a round of its own that leads the next turn; otherwise the rounds lead in
        turn order, and a round that led goes to the back. A turn takes groups a round at a time
        up to the forward's token budget (`_turn`)."""
        rounds: deque[deque[Group[P]]] = deque()
        live: dict[Hashable, _Pending[P]] = {}
        self._arrived = asyncio.Event()
        while True:
            newcomers: deque[Group[P]] | None = None
            if self._queue:
                taken, self._queue = self._queue, []
                fresh = {p.job.id: p for p in taken if not self._dropped(p)}
                live.update(fresh)
                newcomers = deque(self._cheapest_first(self._plan(fresh))) or None
            if newcomers:
                rounds.appendleft(newcomers)
            if not rounds:
                return
            turn, led = self._turn(rounds, newcomers is not None)
            finished = await self._run([group for _, group in turn], live)
            for (round_, group), done in zip(reversed(turn), reversed(finished), strict=True):
                if not done:
                    round_.appendleft(group)  # a step done; the rest at its round's next turn
            for round_ in [rounds.popleft() for _ in range(led)][::-1]:
                rounds.append(round_)  # the rounds that led go to the back, the older first
            answered = [p.job for p in live.values() if p.future.done()]
            for answered_job in answered:
                del live[answered_job.id]
            rounds = deque(r for r in rounds if r)
            if answered and (self._queue or rounds):
                await self._gather(answered, rounds)

    async def _gather(self, answered: Sequence[Job[P]], rounds: deque[deque[Group[P]]]) -> None:
        """Wait for the requests of the clients just `answered` while work waits (the module's
        "Gathering"): until as many arrived, the waiting work leaves no room in the budget for
        another like the cheapest answered, or the wait's limit passes."""
        limit = min(self.bounds.max_gather_seconds, GATHER_SHARE * self._forward_seconds)
        if limit <= 0 or self._arrived is None:
            return
        room = self.bounds.max_forward_tokens - min(self.cost(_alone(j)) for j in answered)
        waiting = sum(self.cost(g) for round_ in rounds for g in round_)
        before, counted = len(self._queue), 0
        start = time.perf_counter()
        deadline, waited = start + limit, False
        while len(self._queue) < before + len(answered):
            waiting += sum(self.cost(_alone(p.job)) for p in self._queue[counted:])
            counted = len(self._queue)
            left = deadline - time.perf_counter()
            if waiting > room or left <= 0:
                break
            waited = True
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                break
        if waited:
            with self._stats_lock:
                self._stats.gathers += 1
                self._stats.gather_seconds += time.perf_counter() - start
                self._stats.gathered += len(self._queue) - before

    def _cheapest_first(self, groups: list[Group[P]]) -> list[Group[P]]:
        """A new round's groups, the cheapest requests' first (by the cost of each request's first
        group); a request split over several groups keeps their order."""
        first_cost: dict[Hashable, int] = {}
        for group in groups:
            cost = self.cost(group)
            for job_id in group.job_ids:
                first_cost.setdefault(job_id, cost)
        return sorted(groups, key=lambda g: min(first_cost[j] for j in g.job_ids))

    def _turn(
        self, rounds: deque[deque[Group[P]]], newcomers_lead: bool = False
    ) -> tuple[list[tuple[deque[Group[P]], Group[P]]], int]:
        """The groups of one turn, taken off their rounds, and how many rounds led it (from the
        front): a group per round in turn order, again and again, while they fit the token
        budget; a group past what is left gives the parts that fit and keeps the rest at its
        round's head (a leader's first part always runs). Where new arrivals lead, the round whose
        turn it was also takes its next group, even past the budget. A waiting round's step past
        the budget is cut to one budget of rows; a new arrival's runs whole (it is the cheapest
        that came, and its rest would wait behind every round)."""
        if not self.packs:
            return [(rounds[0], rounds[0].popleft())], 1
        budget = self.bounds.max_forward_tokens
        taken: list[tuple[deque[Group[P]], Group[P]]] = []
        full: set[int] = set()
        leaders = [rounds[0], rounds[1]] if newcomers_lead and len(rounds) > 1 else [rounds[0]]
        for round_ in leaders:  # each leader's next group runs, past the budget if need be
            cut = round_ is not rounds[0] or not newcomers_lead
            part, budget = self._take(round_, budget, at_least_one=True, full=full, cut=cut)
            taken.append((round_, part))
        while len(full) < len(rounds):
            for round_ in rounds:
                if id(round_) in full:
                    continue
                if not round_:
                    full.add(id(round_))
                    continue
                part, budget = self._take(round_, budget, at_least_one=False, full=full)
                if part is not None:
                    taken.append((round_, part))
        return taken, len(leaders)

    def _take(
        self, round_: deque[Group[P]], budget: int, at_least_one: bool, full: set[int], cut: bool = False
    ) -> tuple[Any, int]:
        """The most of `round_`'s next group that fits `budget` (`_fitting`), taken off it, and the
        budget left; what does not fit stays at the round's head, and the round is then `full`
        for this turn (the order within a round holds)."""
        group = round_.popleft()
        part, budget = self._fitting(group, budget, at_least_one, cut)
        if part is not group:
            round_.appendleft(group if part is None else _rest(group, part))
            full.add(id(round_))
        return part, budget

    def _fitting(self, group: Group[P], budget: int, at_least_one: bool, cut: bool) -> tuple[Any, int]:
        """The most of `group` (its leading parts) whose cost fits `budget`, and the budget left;
        None where not even its first part fits (unless `at_least_one`: then its first part, whole
        or, where `cut`, its rows up to a forward's budget)."""
        cost = self.cost(group)
        if cost <= budget:
            return group, budget - cost
        fitted: Group[P] | None = None
        for n in range(1, len(group.parts) + 1):
            head = Group(group.prefix_key, group.prefix_tokens, group.parts[:n])
            cost = self.cost(head)
            if cost > budget:
                break
            fitted, left = head, budget - cost
        if fitted is not None:
            return fitted, left
        if at_least_one:
            head = self._rows_fitting(group, max(budget, self.bounds.max_forward_tokens) if cut else None)
            return head, budget - self.cost(head)
        return None, budget

    def _rows_fitting(self, group: Group[P], limit: int | None) -> Group[P]:
        """The most leading rows of `group`'s first part that cost at most `limit`, so one heavy
        request's step never holds a forward past the budget; the part whole (the group, where
        that is all) with no limit, or when not even one row fits: then what is past it is the
        state's prefill, which runs in steps of its own first, and the rows are cut when it is done."""
        first = group.parts[0]
        whole = group if len(group.parts) == 1 else Group(group.prefix_key, group.prefix_tokens, (first,))

        def head(stop: int) -> Group[P]:
            return Group(group.prefix_key, group.prefix_tokens, (Part(first.job, first.start, stop),))

        if limit is None or self.cost(whole) <= limit:
            return whole
        low, high = first.start, first.stop  # the cut's stop: head(high) does not fit, head(low) does
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if self.cost(head(middle)) <= limit else (low, middle)
        return head(low) if low > first.start else whole

    def cost(self, group: Group[P]) -> int:
        """The tokens `group` adds to a turn: the engine's count, else its rows and prefix."""
        if self._cost is not None:
            try:
                return self._cost(group)
            except Exception:  # noqa: BLE001 - a job the engine cannot count still runs
                pass
        return group.true_tokens + group.prefix_tokens

    def _started(self, group: Group[P], live: dict[Hashable, _Pending[P]]) -> None:
        """Record the wait of every job whose first forward starts now."""
        now = time.perf_counter()
        for job_id in group.job_ids:
            pending = live[job_id]
            if not pending.started:
                pending.started = True
                pending.wait.seconds = max(0.0, now - pending.queued_at)

    def _plan(self, live: dict[Hashable, _Pending[P]]) -> list[Group[P]]:
        try:
            return plan_groups([p.job for p in live.values()], self.bounds)
        except ValueError:
            pass  # jobs that disagree with each other: plan each alone, fail only the invalid
        groups: list[Group[P]] = []
        for pending in live.values():
            try:
                groups.extend(plan_groups([pending.job], self.bounds))
            except ValueError as exc:
                pending.fail(exc)
        return groups

    def _dropped(self, pending: _Pending[P]) -> bool:
        if pending.future.done():
            with self._stats_lock:
                self._stats.cancelled_dropped += pending.future.cancelled()
            return True
        return False

    async def _run(self, planned: Sequence[Group[P]], live: dict[Hashable, _Pending[P]]) -> list[bool]:
        """Run one turn of `planned` (one call); for each group, False when it has work left."""
        kept = [g.keeping({i for i in g.job_ids if i in live and not live[i].future.done()}) for g in planned]
        running = [g for g in kept if g is not None]
        if not running:
            return [True] * len(planned)
        for group in running:
            self._started(group, live)
        try:
            outcomes = await self._forward(running)
        except Exception as exc:  # noqa: BLE001 - routed to the callers, never raised here
            await self._isolate(running, exc, live)
            return [True] * len(planned)
        finished: dict[int, bool] = {}
        for group, outcome in zip(running, outcomes, strict=True):
            if isinstance(outcome, Unfinished):
                self._deliver([p for p in group.parts if p.job.id in outcome.done], outcome.done, live)
                finished[id(group)] = False
            else:
                self._deliver(group.parts, outcome, live)
                finished[id(group)] = True
        return [True if g is None else finished[id(g)] for g in kept]

    async def _isolate(
        self, groups: Sequence[Group[P]], exc: Exception, live: dict[Hashable, _Pending[P]]
    ) -> None:
        """After a failed call: a lone request fails; otherwise each group, then each request,
        runs again alone, so that only the failing request fails."""
        parts = [part for group in groups for part in group.parts]
        if len({p.job.id for p in parts}) == 1:
            live[parts[0].job.id].fail(exc)
            return
        alone = [Group(g.prefix_key, g.prefix_tokens, (p,)) for g in groups for p in g.parts]
        for group in alone:
            with self._stats_lock:
                self._stats.isolated_retries += 1
            while not (await self._run([group], live))[0]:
                pass

    @staticmethod
    def _deliver(
        parts: Sequence[Part[P]], results: Mapping[Hashable, Sequence[R]], live: dict[Hashable, _Pending[P]]
    ) -> None:
        for part in parts:
            pending = live[part.job.id]
            try:
                pending.deliver(part, results[part.job.id])
            except (KeyError, RuntimeError) as exc:
                pending.fail(RuntimeError(f"run_group gave no usable results for job {part.job.id!r}: {exc}"))

    async def _forward(self, groups: Sequence[Group[P]]) -> Sequence[Outcome]:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        outcomes = await loop.run_in_executor(self.executor, self.run_groups, list(groups))
        self._forward_seconds = time.perf_counter() - start
        if len(outcomes) != len(groups):
            raise RuntimeError(f"run_groups returned {len(outcomes)} outcomes for {len(groups)} groups")
        finished = []
        for group, outcome in zip(groups, outcomes, strict=True):
            done = group.keeping(set(outcome.done)) if isinstance(outcome, Unfinished) else group
            if done is not None:
                finished.append(done)  # the forward of the jobs it finished
        if finished:
            self._count(finished)
        return outcomes

    def _count(self, groups: Sequence[Group[P]]) -> None:
        with self._stats_lock:
            s = self._stats
            s.forwards += 1
            s.rows += sum(g.rows for g in groups)
            s.true_tokens += sum(g.true_tokens for g in groups)
            s.padded_tokens += sum(g.padded_tokens for g in groups)
            s.merged_forwards += len({i for g in groups for i in g.job_ids}) > 1


def _alone(job: Job[P]) -> Group[P]:
    """`job`'s rows as one group, for its cost on its own."""
    return Group(job.prefix_key, job.prefix_tokens, (Part(job, 0, len(job.row_tokens)),))
