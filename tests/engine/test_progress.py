"""The engine always makes progress: long prefills that each fit the state cache, but not all
at once, all finish (a prefill in progress is never evicted by another's), and each answers as
a plain whole prefill does."""

from __future__ import annotations

import asyncio

import pytest

from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import PromptRow
from semif_serve.engine.memory import HostMemory, ReleasePolicy
from semif_serve.engine.state_cache import StateCache
from semif_serve.engine.worker import EngineWorker
from tests.support import scoring
from tests.support.polling import wait_until_async

CHUNK = 16
ROW = PromptRow("Did it recover?", ("Yes.", "No."))


def long_state(n: int, words: int) -> str:
    """A state of about `words` words that no other test's state shares a prefix with."""
    return f"Report {n}. " + " ".join(f"zone{n}-{i} recovered" for i in range(words // 2))


def state_bytes(engine, state: str) -> int:
    """What the cache holds for `state`'s prefix, from the engine's own memory estimate."""
    prepared = engine.prepare(RowsRequest.of(state, [ROW, ROW], shared=True, max_input_tokens=8192))
    return engine.estimate.cache_per_token * len(prepared.prefix) + engine.estimate.state_per_row


def ask_together(engine, states: list[str], seconds: float = 120) -> list:
    """Each state's request sent through one worker once the one before it has started its
    steps (so each is a round of its own, and the rounds take turns); their readouts (a hang
    fails the test)."""
    worker = EngineWorker(engine, ReleasePolicy(HostMemory(), 1 << 30))
    started: list[object] = []
    real = engine.run_groups

    def recording(groups):
        started.extend(group.parts[0].job.id for group in groups)
        return real(groups)

    engine.run_groups = recording

    async def main():
        asks = []
        for state in states:
            seen = len(started)
            request = RowsRequest.of(state, [ROW, ROW], shared=True, max_input_tokens=8192)
            asks.append(asyncio.ensure_future(scoring.score(worker, request)))
            await wait_until_async(
                lambda seen=seen: len(started) > seen, seconds, "the engine's next forward", every=0.005
            )
        return await asyncio.wait_for(asyncio.gather(*asks), seconds)

    try:
        return asyncio.run(main())
    finally:
        worker.shutdown()


def groups_of(engine, states: list[str], rows=(ROW, ROW)) -> list:
    """One planned group per state, each its own request (job id = its position)."""
    from semif_serve.engine.batching import Group
    from semif_serve.engine.runner import _whole

    groups = []
    for n, state in enumerate(states):
        job = engine.prepare(RowsRequest.of(state, list(rows), shared=True, max_input_tokens=8192)).job(n)
        groups.append(Group(job.prefix_key, job.prefix_tokens, (_whole(job),)))
    return groups


def take_turns(engine, groups, most: int = 400) -> list:
    """The groups run a turn each, in rotation, as the batcher runs rounds; their results (a
    group that never finishes within `most` rotations fails the test)."""
    from semif_serve.engine.batching import UNFINISHED

    results: list = [None] * len(groups)
    for _ in range(most):
        for i, group in enumerate(groups):
            if results[i] is None and (scored := engine.run_group(group)) is not UNFINISHED:
                results[i] = scored[i][0]
        if all(r is not None for r in results):
            return results
    raise AssertionError(f"{sum(r is None for r in results)} of {len(groups)} prefills never finished")


def assert_equal_to_whole_prefills(engine, states, got_rows) -> None:
    whole = engine.with_options(cache=StateCache(0), prefill_chunk_tokens=None)
    for state, got in zip(states, got_rows, strict=True):
        want = whole.read(RowsRequest.of(state, [ROW, ROW], shared=True, max_input_tokens=8192)).rows[0]
        assert max(abs(x - y) for x, y in zip(got.option_logits, want.option_logits, strict=True)) <= 1e-5


# Two states of nearly one size: before prefills in progress held their place, each step of one
# evicted the other's slice once both had grown, and at a cache of ~1x a state neither finished.
TWINS = [long_state(1, 200), long_state(2, 204)]


@pytest.mark.parametrize("room", [1.02, 1.5, 1.9], ids=["just-one", "one-and-a-half", "nearly-two"])
def test_two_long_prefills_taking_turns_over_a_cache_that_fits_one_at_a_time_both_finish(engine, room):
    budget = int(room * max(state_bytes(engine, s) for s in TWINS))
    assert budget < sum(state_bytes(engine, s) for s in TWINS)  # together they do not fit
    stepping = engine.with_options(cache=StateCache(budget), prefill_chunk_tokens=CHUNK)
    scored = take_turns(stepping, groups_of(stepping, TWINS))
    assert_equal_to_whole_prefills(engine, TWINS, scored)
    assert stepping.cache.stats().bytes <= budget
    assert stepping.stepped.in_progress == 0  # no place held after both finished


def test_two_clients_on_long_states_through_the_batcher_both_get_their_answers(engine):
    budget = int(1.02 * max(state_bytes(engine, s) for s in TWINS))
    stepping = engine.with_options(cache=StateCache(budget), prefill_chunk_tokens=CHUNK)
    readouts = ask_together(stepping, [long_state(3, 200), long_state(4, 204)])
    assert [r.timing.prefill for r in readouts] == ["fresh", "fresh"]
    assert_equal_to_whole_prefills(
        engine, [long_state(3, 200), long_state(4, 204)], [r.rows[0] for r in readouts]
    )


def test_three_long_prefills_over_a_cache_that_holds_one_all_finish(engine):
    states = [long_state(5, 120), long_state(6, 140), long_state(7, 160)]
    budget = int(1.1 * max(state_bytes(engine, s) for s in states))
    stepping = engine.with_options(cache=StateCache(budget), prefill_chunk_tokens=CHUNK)
    assert_equal_to_whole_prefills(engine, states, take_turns(stepping, groups_of(stepping, states)))


def test_a_waiting_prefill_starts_once_the_one_ahead_of_it_is_abandoned(engine):
    from semif_serve.engine.batching import UNFINISHED

    states = [long_state(8, 200), long_state(9, 204)]
    budget = int(1.02 * max(state_bytes(engine, s) for s in states))
    stepping = engine.with_options(cache=StateCache(budget), prefill_chunk_tokens=CHUNK)
    first, second = groups_of(stepping, states)
    assert stepping.run_group(first) is UNFINISHED  # the first starts its steps, then its client leaves
    assert stepping.stepped.in_progress == 1
    turns = 0
    while stepping.run_group(second) is UNFINISHED:
        turns += 1
        assert turns < 200, "the second prefill never finished"
    assert stepping.stepped.in_progress == 0


def test_a_pinned_slice_is_never_evicted_by_a_put_but_memory_pressure_drops_it(engine):
    import torch

    from semif_serve.engine.forwards import prefill

    ids = [list(range(10, 10 + n)) for n in (40, 41)]
    states = [prefill(engine.model, i) for i in ids]
    with torch.inference_mode():
        sizes = [StateCache(1 << 30).put(i, prefill(engine.model, i)).nbytes for i in ids]
    cache = StateCache(int(1.5 * max(sizes)))
    pinned = cache.put(ids[0], states[0])
    cache.pin(pinned.digest)
    assert not cache.has(cache.put(ids[1], states[1]).ids)  # refused: it would need the pinned one gone
    assert cache.has(ids[0]) and cache.stats().refused == 1
    cache.unpin(pinned.digest)
    assert cache.has(cache.put(ids[1], prefill(engine.model, ids[1])).ids) and not cache.has(ids[0])
    cache.pin(cache.put(ids[0], prefill(engine.model, ids[0])).digest)
    assert cache.clear() > 0 and cache.stats().entries == 0


def test_two_lone_questions_in_one_group_over_long_states_that_fit_one_at_a_time_both_finish(engine):
    """Lone rows (one question, no orderings) of several requests share one planned group; each
    of its states takes a turn per call, and the rows that finish go back at once."""
    from semif_serve.engine.batching import Bounds, Unfinished, plan_groups

    states = [long_state(10, 200), long_state(11, 204)]
    budget = int(1.02 * max(state_bytes(engine, s) for s in states))
    lone = engine.with_options(cache=StateCache(budget), prefill_chunk_tokens=CHUNK, keep_state_tokens=64)
    prepared = [lone.prepare(RowsRequest.of(s, [ROW], shared=False, max_input_tokens=8192)) for s in states]
    (group,) = plan_groups([p.job(n) for n, p in enumerate(prepared)], Bounds())
    got: dict = {}
    for _ in range(400):
        scored = lone.run_group(group)
        done = scored.done if isinstance(scored, Unfinished) else scored
        got.update(done)
        group = group.keeping({i for i in group.job_ids if i not in got})  # as the batcher drops them
        if group is None:
            break
    assert sorted(got) == [0, 1], "a lone question over a long state never finished"
    plain = engine.with_options(cache=StateCache(0), prefill_chunk_tokens=None)
    for n, state in enumerate(states):
        want = plain.read(RowsRequest.of(state, [ROW], shared=False, max_input_tokens=8192)).rows[0]
        close = zip(got[n][0].option_logits, want.option_logits, strict=True)
        assert max(abs(x - y) for x, y in close) <= 1e-5


def test_the_batcher_delivers_the_jobs_an_unfinished_group_finished_and_runs_the_rest():
    from semif_serve.engine.batching import Batcher, Bounds, Job, Unfinished

    calls: list[tuple] = []

    def run_group(group):
        calls.append(group.job_ids)
        if len(calls) == 1:
            return Unfinished({"a": ["A"]})  # a finished, b still stepping
        return {job: [job.upper()] for job in group.job_ids}

    batcher: Batcher = Batcher(run_group, Bounds())

    async def main():
        jobs = [Job(name, None, 0, (3,), payload=None) for name in ("a", "b")]
        first = asyncio.ensure_future(batcher.submit(jobs[0]))
        second = asyncio.ensure_future(batcher.submit(jobs[1]))
        answers = await asyncio.gather(first, second)
        await batcher.close()
        return answers

    assert asyncio.run(main()) == [["A"], ["B"]]
    assert calls == [("a", "b"), ("b",)]  # b's next turn ran without a
    assert batcher.stats().forwards == 2
