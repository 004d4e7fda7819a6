"""Cross-request batching: the grouping rules (pure, property-checked) and the batcher's loop,
driven through a gated fake engine on a real thread (a model cannot be paused mid-forward)."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from semif_serve.engine.batching import GATHER_SHARE, Batcher, Bounds, Group, Job, Part, Wait, plan_groups
from tests.support.polling import wait_until_async

HANG_GUARD_S = 10


def job(job_id, key=None, prefix=0, rows=(5,), payload=None) -> Job:
    return Job(job_id, key, prefix, tuple(rows), payload)


def shape(groups: list[Group]) -> list[list[tuple]]:
    return [[(p.job.id, p.start, p.stop) for p in g.parts] for g in groups]


# -- planning ------------------------------------------------------------------------------


def test_requests_over_the_same_state_prefix_share_one_group_and_others_pad_together():
    jobs = [
        job("a", "s1", 100, (4, 6)),
        job("b", None, 0, (30,)),
        job("c", "s2", 50, (3,)),
        job("d", "s1", 100, (9,)),
        job("e", None, 0, (12, 20)),
    ]
    groups = plan_groups(jobs, Bounds(max_batch_rows=64, max_batch_tokens=16_384))
    assert shape(groups) == [
        [("a", 0, 2), ("d", 0, 1)],
        [("b", 0, 1), ("e", 0, 2)],
        [("c", 0, 1)],
    ]


def test_padded_tokens_are_rows_times_the_widest_row_the_prefix_not_charged_again():
    (over_state,) = plan_groups([job("a", "s", 100, (4, 6)), job("b", "s", 100, (9,))], Bounds())
    assert (over_state.rows, over_state.width, over_state.true_tokens) == (3, 9, 19)
    assert over_state.padded_tokens == 3 * 9
    (plain,) = plan_groups([job("c", rows=(7, 2))], Bounds())
    assert plain.padded_tokens == 2 * 7


def test_a_job_that_does_not_fit_beside_others_opens_a_new_group_whole():
    bounds = Bounds(max_batch_rows=4, max_batch_tokens=10_000)
    jobs = [job("a", rows=(5, 5, 5)), job("b", rows=(5, 5)), job("c", rows=(5,))]
    assert shape(plan_groups(jobs, bounds)) == [[("a", 0, 3), ("c", 0, 1)], [("b", 0, 2)]]


def test_a_job_too_large_alone_is_cut_into_consecutive_slices_that_each_fit():
    bounds = Bounds(max_batch_rows=64, max_batch_tokens=100)
    big = job("big", "s", 40, (10,) * 13)
    assert shape(plan_groups([big], bounds)) == [[("big", 0, 10)], [("big", 10, 13)]]
    assert all(bounds.fits(g) for g in plan_groups([big], bounds))


def test_rows_over_a_prefix_longer_than_the_budget_are_batched_by_their_own_width():
    bounds = Bounds(max_batch_rows=256, max_batch_tokens=1024)
    questions = job("q", "long state", 29_000, (12,) * 200)
    groups = plan_groups([questions], bounds)
    per_group = 1024 // 12  # rows of width 12 under the budget, whatever the prefix's length
    assert len(groups) == math.ceil(200 / per_group) == 3
    assert [g.rows for g in groups] == [per_group, per_group, 200 - 2 * per_group]


def test_a_single_row_past_the_bounds_still_runs_alone():
    groups = plan_groups([job("huge", rows=(500,)), job("small", rows=(3,))], Bounds(max_batch_tokens=100))
    assert shape(groups) == [[("huge", 0, 1)], [("small", 0, 1)]]


def test_planning_refuses_duplicate_ids_and_disagreeing_prefix_lengths():
    with pytest.raises(ValueError, match="twice"):
        plan_groups([job("a"), job("a")], Bounds())
    with pytest.raises(ValueError, match="length of prefix"):
        plan_groups([job("a", "s", 10), job("b", "s", 11)], Bounds())


jobs_strategy = st.lists(
    st.tuples(
        st.sampled_from([None, "s1", "s2", "s3"]),
        st.lists(st.integers(1, 60), min_size=1, max_size=12),
    ),
    min_size=1,
    max_size=20,
)
prefix_length = {None: 0, "s1": 30, "s2": 200, "s3": 1}


@settings(max_examples=300, deadline=None)
@given(specs=jobs_strategy, max_rows=st.integers(1, 16), max_tokens=st.integers(1, 600))
def test_every_plan_covers_each_row_once_respects_the_bounds_and_splits_only_oversized_jobs(
    specs, max_rows, max_tokens
):
    jobs = [job(i, key, prefix_length[key], rows) for i, (key, rows) in enumerate(specs)]
    bounds = Bounds(max_batch_rows=max_rows, max_batch_tokens=max_tokens)
    groups = plan_groups(jobs, bounds)
    assert groups == plan_groups(jobs, bounds)  # deterministic
    covered = {j.id: [] for j in jobs}
    for group in groups:
        assert all(p.job.prefix_key == group.prefix_key for p in group.parts)
        assert len(set(group.job_ids)) == len(group.job_ids)
        if not bounds.fits(group):
            assert group.rows == 1  # only a single row may exceed the bounds, alone
        for part in group.parts:
            covered[part.job.id].extend(range(part.start, part.stop))
    for j in jobs:
        assert sorted(covered[j.id]) == list(range(len(j.row_tokens)))
        alone = Group(j.prefix_key, j.prefix_tokens, (Part(j, 0, len(j.row_tokens)),))
        pieces = sum(p.job.id == j.id for g in groups for p in g.parts)
        if bounds.fits(alone):
            assert pieces == 1


# -- the batcher ---------------------------------------------------------------------------


class GatedEngine:
    """A fake engine on the batcher's real thread: records each group, can hold the first
    forward until released, and fails any group containing a job id in `bad`."""

    def __init__(self, hold_first: bool = True, bad: frozenset = frozenset()) -> None:
        self.groups: list[Group] = []
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold_first:
            self.release.set()
        self.bad = bad
        self.threads: set[str] = set()

    def __call__(self, group: Group):
        self.threads.add(threading.current_thread().name)
        self.groups.append(group)
        self.started.set()
        self.release.wait(HANG_GUARD_S)
        if self.bad & set(group.job_ids):
            raise RuntimeError("this request cannot run")
        return {p.job.id: [f"{p.job.payload}#{row}" for row in range(p.start, p.stop)] for p in group.parts}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, HANG_GUARD_S))


async def busy(batcher: Batcher, engine: GatedEngine) -> asyncio.Task:
    """Occupy the engine with a first job and return once its forward has started."""
    first = asyncio.create_task(batcher.submit(job("first", payload="F")))
    await asyncio.to_thread(engine.started.wait, HANG_GUARD_S)
    return first


async def settle() -> None:
    """Let queued submissions reach the queue (they append on their first step)."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_lone_job_runs_at_once_alone_and_gets_its_rows_in_order():
    engine = GatedEngine(hold_first=False)

    async def main():
        batcher = Batcher(engine, Bounds())
        result = await batcher.submit(job("a", rows=(3, 4, 5), payload="A"))
        await batcher.close()
        return result, batcher.stats()

    result, stats = run(main())
    assert result == ["A#0", "A#1", "A#2"]
    assert shape(engine.groups) == [[("a", 0, 3)]]
    assert (stats.forwards, stats.rows, stats.merged_forwards) == (1, 3, 0)
    (thread,) = engine.threads
    assert thread.startswith("semif-batch")


def test_jobs_queued_while_the_engine_is_busy_merge_into_one_forward_and_each_gets_its_own_results():
    engine = GatedEngine()

    async def main():
        batcher = Batcher(engine, Bounds())
        first = await busy(batcher, engine)
        tasks = [
            asyncio.create_task(batcher.submit(job(name, "state", 100, (4, 6), payload=name.upper())))
            for name in ("b", "c", "d")
        ]
        await settle()
        assert batcher.queued == 3
        engine.release.set()
        results = await asyncio.gather(first, *tasks)
        await batcher.close()
        return results, batcher.stats()

    results, stats = run(main())
    assert results == [["F#0"], ["B#0", "B#1"], ["C#0", "C#1"], ["D#0", "D#1"]]
    assert shape(engine.groups) == [[("first", 0, 1)], [("b", 0, 2), ("c", 0, 2), ("d", 0, 2)]]
    assert (stats.forwards, stats.merged_forwards, stats.rows) == (2, 1, 7)
    assert stats.padded_tokens == 1 * 5 + 6 * 6 and stats.true_tokens == 5 + 3 * 10


def test_a_job_counts_as_admitted_from_its_submission_to_its_answer_and_as_queued_until_its_turn():
    engine = GatedEngine()

    async def main():
        batcher = Batcher(engine, Bounds())
        first = await busy(batcher, engine)  # in its turn: admitted, no longer queued
        seen = [(batcher.admitted, batcher.queued)]
        second = asyncio.create_task(batcher.submit(job("b", payload="B")))
        await settle()
        seen.append((batcher.admitted, batcher.queued))
        engine.release.set()
        await asyncio.gather(first, second)
        seen.append((batcher.admitted, batcher.queued))
        await batcher.close()
        return seen

    assert run(main()) == [(1, 0), (2, 1), (0, 0)]


def test_a_job_cancelled_by_its_caller_while_queued_is_dropped_before_its_forward():
    engine = GatedEngine()

    async def main():
        batcher = Batcher(engine, Bounds())
        first = await busy(batcher, engine)
        kept = asyncio.create_task(batcher.submit(job("kept", payload="K")))
        gone = asyncio.create_task(batcher.submit(job("gone", payload="G")))
        await settle()
        gone.cancel()
        await settle()
        engine.release.set()
        results = await asyncio.gather(first, kept)
        await batcher.close()
        return results, gone.cancelled(), batcher.stats()

    results, cancelled, stats = run(main())
    assert results == [["F#0"], ["K#0"]] and cancelled
    assert "gone" not in {i for g in engine.groups for i in g.job_ids}
    assert stats.cancelled_dropped == 1


def test_a_failing_request_in_a_merged_forward_fails_alone_and_the_others_succeed():
    engine = GatedEngine(bad=frozenset({"bad"}))

    async def main():
        batcher = Batcher(engine, Bounds())
        first = await busy(batcher, engine)
        tasks = [
            asyncio.create_task(batcher.submit(job(name, "state", 10, (3,), payload=name)))
            for name in ("ok1", "bad", "ok2")
        ]
        await settle()
        engine.release.set()
        results = await asyncio.gather(first, *tasks, return_exceptions=True)
        await batcher.close()
        return results, batcher.stats()

    (first, ok1, bad, ok2), stats = run(main())
    assert (first, ok1, ok2) == (["F#0"], ["ok1#0"], ["ok2#0"])
    assert isinstance(bad, RuntimeError) and "cannot run" in str(bad)
    assert shape(engine.groups)[1:] == [
        [("ok1", 0, 1), ("bad", 0, 1), ("ok2", 0, 1)],
        [("ok1", 0, 1)],
        [("bad", 0, 1)],
        [("ok2", 0, 1)],
    ]
    assert stats.isolated_retries == 3


def test_a_job_split_over_several_forwards_gets_all_its_rows_back_in_order():
    engine = GatedEngine(hold_first=False)

    async def main():
        batcher = Batcher(engine, Bounds(max_batch_rows=2))
        result = await batcher.submit(job("wide", rows=(1, 2, 3, 4, 5), payload="W"))
        await batcher.close()
        return result

    assert run(main()) == [f"W#{i}" for i in range(5)]
    assert shape(engine.groups) == [[("wide", 0, 2)], [("wide", 2, 4)], [("wide", 4, 5)]]


def test_a_caller_cancelled_during_its_forward_is_not_answered_and_the_loop_keeps_serving():
    engine = GatedEngine()

    async def main():
        batcher = Batcher(engine, Bounds())
        first = await busy(batcher, engine)
        first.cancel()
        engine.release.set()
        after = await batcher.submit(job("after", payload="X"))
        await batcher.close()
        return first.cancelled(), after

    assert run(main()) == (True, ["X#0"])


def test_a_job_id_already_queued_is_refused_at_submit():
    engine = GatedEngine()

    async def main():
        batcher = Batcher(engine, Bounds())
        first = await busy(batcher, engine)
        with pytest.raises(ValueError, match="already queued"):
            await batcher.submit(job("first"))
        engine.release.set()
        await first
        await batcher.close()

    run(main())


def test_an_engine_returning_too_few_results_fails_that_job_not_the_loop():
    def short(group: Group):
        return {p.job.id: [] for p in group.parts}

    async def main():
        batcher = Batcher(short, Bounds())
        with pytest.raises(RuntimeError, match="no usable results"):
            await batcher.submit(job("a"))
        await batcher.close()

    run(main())


def test_a_batcher_keeps_serving_when_its_caller_moves_to_a_new_event_loop():
    engine = GatedEngine(hold_first=False)
    batcher = Batcher(engine, Bounds())

    first = run(batcher.submit(job("a", payload="A")))
    second = run(batcher.submit(job("b", payload="B")))

    assert (first, second) == (["A#0"], ["B#0"])
    assert batcher.stats().forwards == 2


def test_a_jobs_wait_is_the_time_it_queued_behind_the_group_running_and_the_drain_ends_when_idle():
    started, release = threading.Event(), threading.Event()

    def run_group(group: Group):
        if "first" in group.job_ids:
            started.set()
            release.wait(30)  # the first group holds the engine until the second job has queued
            time.sleep(0.05)  # the first forward's own work, which the second job queues behind
        return {p.job.id: [p.job.id] for p in group.parts}

    first_wait, second_wait = Wait(), Wait()

    async def go():
        batcher = Batcher(run_group, Bounds())
        first = asyncio.create_task(batcher.submit(Job("first", None, 0, (1,), None), first_wait))
        await asyncio.to_thread(started.wait, 30)
        second = asyncio.create_task(batcher.submit(Job("second", None, 0, (1,), None), second_wait))
        await wait_until_async(lambda: batcher.queued == 1, what="the second job in the batcher's queue")
        release.set()
        got = await first, await second
        # Nothing queued: the drain task ends and the engine thread runs nothing more.
        await wait_until_async(lambda: batcher._task.done(), what="the drain task to end once idle")
        await batcher.close()
        return got

    first, second = asyncio.run(asyncio.wait_for(go(), 60))
    assert (first, second) == (["first"], ["second"])
    assert first_wait.seconds < second_wait.seconds and second_wait.seconds >= 0.04  # it queued ~50 ms


# -- packing a turn: the groups of different states in one call, within the token budget ----


def test_a_turn_packs_the_groups_of_different_states_into_one_call_within_the_token_budget():
    calls: list[list[list[tuple]]] = []
    release = threading.Event()

    def run_groups(groups):
        if groups[0].job_ids == ("gate",):
            release.wait(HANG_GUARD_S)
        calls.append(shape(list(groups)))
        return [{p.job.id: [p.job.id] * (p.stop - p.start) for p in g.parts} for g in groups]

    async def main():
        # Each job costs its rows' tokens (10 a row): three fit a budget of 35, the fourth waits.
        batcher = Batcher(None, Bounds(max_forward_tokens=35), run_groups=run_groups)
        gate = asyncio.create_task(batcher.submit(job("gate")))
        await settle()
        tasks = [asyncio.create_task(batcher.submit(job(n, f"state {n}", 0, (10,)))) for n in "abcd"]
        await settle()
        release.set()
        await asyncio.gather(gate, *tasks)
        await batcher.close()
        return batcher.stats()

    stats = run(main())
    assert calls[1:] == [
        [[("a", 0, 1)], [("b", 0, 1)], [("c", 0, 1)]],  # arrival order, one call
        [[("d", 0, 1)]],
    ]
    assert stats.forwards == 3 and stats.merged_forwards == 1


def test_a_group_past_the_budget_gives_the_parts_that_fit_and_its_first_part_always_runs():
    calls: list[list[list[tuple]]] = []

    def run_groups(groups):
        calls.append(shape(list(groups)))
        return [{p.job.id: [0] * (p.stop - p.start) for p in g.parts} for g in groups]

    async def main():
        batcher = Batcher(None, Bounds(max_forward_tokens=25), run_groups=run_groups)
        big = asyncio.create_task(batcher.submit(job("big", rows=(40,))))  # alone: past the budget
        await settle()
        await big
        # Lone rows without a state plan into one group; the turn takes as many as fit.
        many = [asyncio.create_task(batcher.submit(job(n, rows=(10,)))) for n in "xyz"]
        await asyncio.gather(*many)
        await batcher.close()

    run(main())
    assert calls[0] == [[("big", 0, 1)]]
    assert [len(call[0]) for call in calls[1:]] in ([1, 2], [2, 1], [1, 1, 1])  # never past 25 tokens
    assert sorted(p[0] for call in calls[1:] for g in call for p in g) == ["x", "y", "z"]


class SteppedEngine:
    """A packing fake engine whose every call waits for the test to let it go (`step`), so
    requests can be made to arrive during a chosen forward."""

    def __init__(self) -> None:
        self.calls: list[list[list[tuple]]] = []
        self._running = threading.Semaphore(0)  # one per call started
        self._go = threading.Semaphore(0)  # one per call the test lets finish

    def __call__(self, groups):
        self.calls.append(shape(list(groups)))
        self._running.release()
        assert self._go.acquire(timeout=HANG_GUARD_S), "the test never let this forward finish"
        return [{p.job.id: [p.job.id] * (p.stop - p.start) for p in g.parts} for g in groups]

    async def running(self) -> int:
        """Wait until the next call has started; its index."""
        assert await asyncio.to_thread(self._running.acquire, True, HANG_GUARD_S), "no forward started"
        return len(self.calls) - 1

    def step(self) -> None:
        self._go.release()


def heavy(name: str, steps: int) -> Job:
    """A request over its own state whose rows are `steps` groups of one budget each."""
    return job(name, f"state {name}", 0, (10,) * steps)


def test_a_request_arriving_while_other_rounds_wait_runs_in_the_next_forward_beside_their_step():
    engine = SteppedEngine()
    arrived_during: dict[str, int] = {}

    async def main():
        # One group a forward fits the budget: each heavy request takes turns, one row at a time.
        batcher = Batcher(None, Bounds(max_batch_rows=1, max_forward_tokens=10), run_groups=engine)
        tasks = []
        for name in ("a", "b", "c", "tiny"):
            tasks.append(asyncio.create_task(batcher.submit(heavy(name, 1 if name == "tiny" else 4))))
            await settle()
            arrived_during[name] = await engine.running() if name == "a" else len(engine.calls) - 1
            engine.step()
            if name != "tiny":
                await engine.running()  # the next forward has started: the next request arrives during it
        while not all(t.done() for t in tasks):
            engine.step()
            await asyncio.sleep(0.001)
        await batcher.close()

    run(main())
    after = arrived_during["tiny"] + 1
    assert ("tiny", 0, 1) in [part for group in engine.calls[after] for part in group]
    # Three heavy rounds were waiting; the forward that took the newcomer also took a step of theirs.
    assert len(engine.calls[after]) == 2
    for name in "abc":
        assert sum(part[0] == name for call in engine.calls for g in call for part in g) == 4


def test_new_arrivals_during_every_forward_never_stall_a_round_already_waiting():
    engine = SteppedEngine()

    async def main():
        batcher = Batcher(None, Bounds(max_batch_rows=1, max_forward_tokens=10), run_groups=engine)
        waiting = asyncio.create_task(batcher.submit(heavy("waiting", 4)))
        await engine.running()
        newcomers = []
        while not waiting.done():  # a new request during every forward, each the next to lead
            newcomers.append(asyncio.create_task(batcher.submit(heavy(f"new{len(newcomers)}", 1))))
            await settle()
            engine.step()
            await asyncio.wait(
                [waiting, asyncio.create_task(engine.running())], return_when="FIRST_COMPLETED"
            )
        engine.step()
        while not all(t.done() for t in newcomers):
            engine.step()
            await asyncio.sleep(0.001)
        await batcher.close()

    run(main())
    steps = [i for i, call in enumerate(engine.calls) for g in call for part in g if part[0] == "waiting"]
    assert steps == [0, 1, 2, 3]  # a step in every forward
    assert all(any(part[0].startswith("new") for g in call for part in g) for call in engine.calls[1:4])


def test_a_waiting_requests_step_past_the_budget_is_cut_to_one_budget_of_rows_beside_a_newcomer():
    engine = SteppedEngine()

    async def main():
        batcher = Batcher(None, Bounds(max_batch_rows=8, max_forward_tokens=30), run_groups=engine)
        big = asyncio.create_task(batcher.submit(job("big", "state big", 0, (10,) * 16)))  # two groups of 80
        await engine.running()
        tiny = asyncio.create_task(batcher.submit(job("tiny", "state tiny", 0, (10,))))
        await settle()
        while not (big.done() and tiny.done()):
            engine.step()
            await asyncio.sleep(0.001)
        await batcher.close()
        return await big

    rows = run(main())
    assert engine.calls == [
        [[("big", 0, 8)]],  # a new arrival's first step runs whole
        [[("tiny", 0, 1)], [("big", 8, 11)]],  # the newcomer leads; the waiting request's step is cut
        [[("big", 11, 14)]],  # three rows of ten tokens fit the budget of 30
        [[("big", 14, 16)]],
    ]
    assert rows == ["big"] * 16


# -- gathering: the next turn waits for the clients a forward answered ------------------------

FORWARD_S = 0.4  # each fake forward's own work: a quarter of it bounds the gathering wait


class TimedEngine:
    """A packing fake engine whose forwards each take FORWARD_S; the first waits for `release`
    (so the test can queue requests behind it) before its work."""

    def __init__(self) -> None:
        self.calls: list[list[list[tuple]]] = []
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, groups):
        self.calls.append(shape(list(groups)))
        if len(self.calls) == 1:
            self.started.set()
            assert self.release.wait(HANG_GUARD_S), "the test never released the first forward"
        time.sleep(FORWARD_S)
        return [{p.job.id: [p.job.id] * (p.stop - p.start) for p in g.parts} for g in groups]


def own_state(name: str, tokens: int = 5) -> Job:
    return job(name, f"state {name}", 0, (tokens,))


async def behind_the_first(batcher: Batcher, engine: TimedEngine, waiting: Job, first: Job) -> asyncio.Task:
    """`first`'s forward started, `waiting` queued behind it, then the forward let go."""
    task = asyncio.create_task(batcher.submit(first))
    await asyncio.to_thread(engine.started.wait, HANG_GUARD_S)
    waiter = asyncio.create_task(batcher.submit(waiting))
    await wait_until_async(lambda: batcher.queued == 1, what="the waiting request in the queue")
    engine.release.set()
    await task
    return waiter


@pytest.mark.parametrize("gather", [1.0, 0.0], ids=["gathering", "off"])
def test_an_answered_clients_next_request_joins_the_forward_of_the_request_that_waited(gather):
    engine = TimedEngine()

    async def main():
        batcher = Batcher(None, Bounds(max_gather_seconds=gather), run_groups=engine)
        waiter = await behind_the_first(batcher, engine, own_state("b1"), own_state("a1"))
        await batcher.submit(own_state("a2"))  # client a sends its next request on its answer
        await waiter
        await batcher.close()
        return batcher.stats()

    stats = run(main())
    if gather:
        assert engine.calls == [[[("a1", 0, 1)]], [[("b1", 0, 1)], [("a2", 0, 1)]]]
        assert (stats.gathers, stats.gathered) == (1, 1)
        assert stats.gather_seconds < GATHER_SHARE * FORWARD_S  # it ended when a2 came, not at its limit
    else:  # the two clients alternate, one request a forward
        assert engine.calls == [[[("a1", 0, 1)]], [[("b1", 0, 1)]], [[("a2", 0, 1)]]]
        assert stats.gathers == 0


@pytest.mark.parametrize(("setting", "limit"), [(1.0, GATHER_SHARE * FORWARD_S), (0.02, 0.02)])
def test_a_wait_for_clients_who_do_not_come_back_ends_at_its_setting_or_a_quarter_of_the_forward(
    setting, limit
):
    engine = TimedEngine()

    async def main():
        batcher = Batcher(None, Bounds(max_gather_seconds=setting), run_groups=engine)
        waiter = await behind_the_first(batcher, engine, own_state("b1"), own_state("a1"))
        await waiter
        await batcher.close()
        return batcher.stats()

    stats = run(main())
    assert engine.calls == [[[("a1", 0, 1)]], [[("b1", 0, 1)]]]
    assert (stats.gathers, stats.gathered) == (1, 0)
    assert limit - 0.005 <= stats.gather_seconds < limit + 0.25  # + what a busy machine adds


def test_a_lone_client_never_waits_for_anyone():
    engine = TimedEngine()
    engine.release.set()
    waits = [Wait(), Wait()]

    async def main():
        batcher = Batcher(None, Bounds(max_gather_seconds=1.0), run_groups=engine)
        for n, wait in enumerate(waits):
            await batcher.submit(own_state(f"a{n}"), wait)
        await batcher.close()
        return batcher.stats()

    stats = run(main())
    assert stats.gathers == 0
    assert all(w.seconds < GATHER_SHARE * FORWARD_S / 2 for w in waits)


def test_no_turn_waits_when_the_requests_waiting_leave_no_room_for_another_like_those_answered():
    engine = TimedEngine()

    async def main():
        # The answered request cost 10 of a budget of 20: the waiting one's 15 leave no room for it.
        batcher = Batcher(None, Bounds(max_forward_tokens=20, max_gather_seconds=1.0), run_groups=engine)
        waiter = await behind_the_first(batcher, engine, own_state("b1", 15), own_state("a1", 10))
        await batcher.submit(own_state("a2", 10))
        await waiter
        await batcher.close()
        return batcher.stats()

    stats = run(main())
    assert stats.gathers == 0
    assert engine.calls == [[[("a1", 0, 1)]], [[("b1", 0, 1)]], [[("a2", 0, 1)]]]
