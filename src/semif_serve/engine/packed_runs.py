"""One engine turn: the rows of every group the batcher took, whatever their states, in one packed
forward (`engine.packed`; docs/packing.md).

Each group is planned into the forward's segments: its state as the state cache has it (a hit is
continued as it is; a miss is computed in the same forward, from the longest cached prefix, and
kept at its own end), the question prefix its orderings share, then one segment per row, read at
its last token. A lone row over a short state the lone-row policy does not keep runs whole from
position 0 (SemIf's plain forward). A long state's prefill step is a segment of the same forward
as everyone else's rows (its slice kept; the group runs again next turn). After the forward the
kept states go into the cache, the read rows through the output head (only the token ids read),
and each group gets its rows' readouts, in order.

What cannot be packed runs on its own, as before: a group whose rows the memory headroom splits
across forwards (`GroupRunner.run_planned`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from semif_serve.engine.batching import UNFINISHED, Group, Part, Unfinished
from semif_serve.engine.forwards import head_logits, read_slots
from semif_serve.engine.group_runs import GroupRunner, _over_state, _picked, state_start
from semif_serve.engine.lanes import ForwardLanes
from semif_serve.engine.packed import Packed, Segment
from semif_serve.engine.rows import PREFILL_KINDS, GroupRun, PreparedRows, Results, ScoredRow
from semif_serve.engine.state_cache import QUESTION, STATE, StoredState
from semif_serve.engine.stepped import Step
from semif_serve.engine.vision import ImageSet

Outcome = Results | Unfinished
# A shorter preamble saves less compute than its stored state costs the cache (a linear-attention
# layer's state is the same size whatever the tokens behind it): lev's plain style opens with one.
PREAMBLE_MIN_TOKENS = 16


@dataclass(frozen=True)
class Ref:
    """What a segment continues: an earlier segment of the forward, a stored state, or nothing;
    `covers` is how many tokens of the sequence that is."""

    parent: int | None = None
    start: StoredState | None = None
    covers: int = 0


@dataclass(frozen=True)
class RowRead:
    """How one row is read: its segment, SemIf's slots (`own` None) over `n_options`, a method's
    own token ids, or its hidden state."""

    segment: int
    n_options: int
    own: tuple[int, ...] | None
    hidden: bool


@dataclass
class ForwardPlan:
    """The segments of one packed forward and what happens after it."""

    segments: list[Segment] = field(default_factory=list)
    stores: list[Callable[[Packed], object]] = field(default_factory=list)  # kept states into the cache
    reads: list[RowRead] = field(default_factory=list)
    kept: dict[tuple[int, tuple[int, ...]], Ref] = field(
        default_factory=dict
    )  # states planned, by adapter and ids

    def add(
        self,
        ids: Sequence[int],
        ref: Ref,
        adapter: int,
        images: ImageSet | None,
        keep: bool = False,
        read: bool = False,
    ) -> int:
        """Add a segment continuing `ref`; its index."""
        self.segments.append(Segment(tuple(ids), ref.parent, ref.start, adapter, keep, read, images=images))
        return len(self.segments) - 1

    def keep(
        self,
        ids: Sequence[int],
        ref: Ref,
        adapter: int,
        images: ImageSet | None,
        store: Callable[[Any], StoredState],
    ) -> Ref:
        """A segment over `ids[ref.covers:]` kept at its end (`store` puts its cache); the ref
        that continues it. A state another group of the forward computes already is shared."""
        known = self.kept.get((adapter, tuple(ids)))
        if known is not None:
            return known
        index = self.add(ids[ref.covers :], ref, adapter, images, keep=True)
        self.stores.append(lambda packed: store(packed.caches[index]))
        self.kept[(adapter, tuple(ids))] = continued = Ref(parent=index, covers=len(ids))
        return continued

    def read(self, ids: Sequence[int], ref: Ref, adapter: int, images: ImageSet | None, how: RowRead) -> int:
        """A row's segment after `ref`, read at its last token; its position among the reads."""
        index = self.add(ids[ref.covers :], ref, adapter, images, read=True)
        self.reads.append(replace(how, segment=index))
        return len(self.reads) - 1


@dataclass
class _Planned:
    """One group's part of the forward: its rows' reads (per part, in order), its state's
    prefill kind and tokens, and what to do when the forward is done."""

    group: Group[PreparedRows]
    reads: list[int]
    how: str = "none"
    state_tokens: int = 0
    row_tokens: int = 0
    width: int = 0
    prefix_tokens: int = 0
    stepped_seconds: float = 0.0
    unfinished: bool = False  # a prefill step ran: the group runs again next turn
    direct: bool = False
    after: list[Callable[[], object]] = field(default_factory=list)
    earlier: Results = field(default_factory=dict)  # results a step let through already


class PackedRunner:
    """Plans the groups of one turn into one packed forward and runs it (see the module docstring)."""

    def __init__(self, groups: GroupRunner, lanes: ForwardLanes) -> None:
        self.runner = groups
        self.lanes = lanes
        self.torch = groups.torch
        self.cache = groups.cache
        self.stepped = groups.stepped
        self.lone = groups.lone
        self.shapes = groups.shapes
        self.unkept_preambles: set[int] = set()  # adapters whose preamble outgrows the cache's budget

    def run(self, groups: Sequence[Group[PreparedRows]], direct_reuse: bool) -> list[Outcome]:
        """The outcome of each group (its rows' results, or UNFINISHED), from one packed forward."""
        plan = ForwardPlan()
        self.stepped.next_turn()
        outcomes: list[Outcome | None] = [None] * len(groups)
        planned: list[tuple[int, _Planned]] = []
        for n, group in enumerate(groups):
            parts = self._split_direct(group) if direct_reuse and _is_direct(group) else [group]
            for sub in parts:
                entry = (
                    None if sub.prefix_key is not None and self._needs_split(sub) else self._plan(sub, plan)
                )
                if entry is None:  # past the headroom or one chunk's activations: forwards of its own
                    outcomes[n] = _merge(outcomes[n], self.runner.run_planned(sub))
                    continue
                planned.append((n, entry))
        if plan.segments:
            t0 = time.perf_counter()
            packed = self.lanes.forward(self.runner.model, plan.segments, self.runner.adapters)
            scored = self._read(plan, packed)
            self.runner.memory.synchronize()
            seconds = time.perf_counter() - t0
            for store in plan.stores:
                store(packed)
            requests = len({i for _, p in planned for i in p.group.job_ids})
            sequences = sum(1 for s in plan.segments if s.parent is None)
            self.shapes.observe(
                len(plan.reads), requests, sequences, packed.tokens, packed.tokens, packed.lanes
            )
            for n, entry in planned:
                outcomes[n] = _merge(outcomes[n], self._outcome(entry, scored, seconds, requests))
        for _, entry in planned:
            for after in entry.after:
                after()
        return [o if o is not None else UNFINISHED for o in outcomes]

    def _split_direct(self, group: Group[PreparedRows]) -> list[Group[PreparedRows]]:
        """Lone rows by their state: over it where the lone-row policy says so (a planned group per
        state), else each as SemIf's plain forward (its whole prompt, one segment)."""
        by_state: dict[tuple[tuple[int, ...], int], list[Part[PreparedRows]]] = {}
        for part in group.parts:
            by_state.setdefault((part.job.payload.state_ids, part.job.payload.adapter), []).append(part)
        groups: list[Group[PreparedRows]] = []
        for (ids, adapter), parts in by_state.items():
            if ids and self.lone.reuses(ids, [p.job.payload.demand_key for p in parts], adapter):
                groups.append(_over_state(ids, parts))
            else:
                groups.extend(Group(None, 0, (part,)) for part in parts)
        return groups

    def _needs_split(self, group: Group[PreparedRows]) -> bool:
        """Whether the headroom fits this group's rows in one forward only in several."""
        headroom = self.runner.headroom_bytes
        if headroom is None:
            return False
        prefix = group.parts[0].job.payload.prefix
        width = group.width
        rows = self.runner.estimate.rows_under(headroom, len(prefix), width, self.runner.prefill_chunk_tokens)
        return rows is not None and 0 < rows < group.rows

    def _plan(self, group: Group[PreparedRows], plan: ForwardPlan) -> _Planned | None:
        """Add one group's segments to `plan`; None where the group computes more than one prefill
        chunk in one sequence (a row wider than a chunk, or a state the cache cannot take in
        steps): `run_planned` runs it in chunks, so its activations stay one chunk's."""
        parts = sorted(group.parts, key=lambda p: p.job.payload.adapter)
        images = ImageSet.union([p.job.payload.images for p in parts])
        first = parts[0].job.payload
        entry = _Planned(group, [])
        if len(parts) == 1 and first.direct:
            ids = first.prompts[0].ids
            ref = self._preamble(first.preamble, ids, first.adapter, plan)
            how = RowRead(0, first.n_options[0], None, False)
            entry.reads.append(plan.read(ids, ref, first.adapter, images, how))
            computed = len(ids) - (ref.covers if ref.start is not None else 0)
            entry.direct, entry.row_tokens, entry.width = True, computed, computed
            return entry
        prefix = first.prefix if group.prefix_key is not None else []
        adapters = sorted({p.job.payload.adapter for p in parts})
        for adapter in adapters:
            step = self.stepped.plan(prefix, first.state_tokens, adapter, (group.job_ids, adapter))
            if step is not False:
                if isinstance(step, Step):
                    self._step(step, images, adapter, plan, entry)
                entry.unfinished = True
                return entry
        if self._past_one_chunk(group, prefix, adapters):
            return None
        state_tokens, preamble = first.state_tokens, first.preamble
        refs = {a: self._state(prefix, state_tokens, images, a, plan, entry, preamble) for a in adapters}
        entry.prefix_tokens = len(prefix)
        for part in parts:
            prepared = part.job.payload
            for i in range(part.start, part.stop):
                ids = prepared.prompts[i].ids
                # A row computed whole (no prefix) continues its method's preamble like a lone row.
                ref = (
                    refs[prepared.adapter]
                    if prefix
                    else self._preamble(prepared.preamble, ids, prepared.adapter, plan)
                )
                own = prepared.columns[i] if prepared.columns is not None else None
                how = RowRead(0, prepared.n_options[i], own, prepared.hidden)
                entry.reads.append(plan.read(ids, ref, prepared.adapter, images, how))
                entry.row_tokens += len(ids) - ref.covers
                entry.width = max(entry.width, len(ids) - len(prefix))
        return entry

    def _past_one_chunk(self, group: Group[PreparedRows], prefix: list[int], adapters: list[int]) -> bool:
        chunk = self.runner.prefill_chunk_tokens
        if chunk is None:
            return False
        if group.width > chunk:
            return True
        cached = (self.cache.longest_prefix(prefix, a) for a in adapters)
        return any(len(prefix) - (len(c) if c is not None else 0) > chunk for c in cached)

    def _step(
        self, step: Step, images: ImageSet | None, adapter: int, plan: ForwardPlan, entry: _Planned
    ) -> None:
        """A long state's next step as a segment of this forward; its slice kept and recorded after."""
        ref = Ref(start=step.start, covers=len(step.start) if step.start is not None else 0)
        kept: list[StoredState] = []

        def store(cache: Any) -> StoredState:
            if step.superseded and step.start is not None:
                self.cache.discard(step.start.ids, step.start.adapter)  # costs no eviction
            stored = self.cache.put(step.ids, cache, step.kind, adapter)
            kept.append(stored)
            return stored

        plan.keep(step.ids, ref, adapter, images, store)
        entry.state_tokens += len(step.ids) - ref.covers
        t0 = time.perf_counter()
        entry.after.append(
            lambda: self.stepped.finish(step, kept[0], time.perf_counter() - t0) if kept else None
        )

    def _state(
        self,
        prefix: list[int],
        state_tokens: int,
        images: ImageSet | None,
        adapter: int,
        plan: ForwardPlan,
        entry: _Planned,
        preamble: tuple[int, ...] = (),
    ) -> Ref:
        """`GroupRunner._state` planned into the forward: the ref the rows continue (a cached state,
        or segments computing it from the longest cached prefix, else from the preamble, kept in
        their tiers)."""
        if not prefix:
            return Ref()
        kind = QUESTION if len(prefix) > state_tokens else STATE
        stored = self.cache.get(prefix, kind, adapter)
        if stored is not None:
            entry.how = _costlier(entry.how, "cached")
            return Ref(start=stored, covers=len(stored))
        stepped = self.stepped.take(prefix, adapter)  # prefilled in steps: still fresh
        entry.stepped_seconds += stepped or 0.0
        start, how, state_first, superseded = state_start(self.cache, prefix, state_tokens, adapter, stepped)
        ref = _ref_of(start)
        if start is None and superseded is None:  # nothing of it stored: from the preamble
            ref = self._preamble(preamble, prefix, adapter, plan)
            entry.state_tokens += ref.covers if ref.parent is not None else 0
        if state_first:
            ref = self._kept(
                prefix[:state_tokens], ref if superseded is None else _ref_of(superseded), STATE, images,
                adapter, plan=plan, entry=entry,
            )  # fmt: skip
        if stepped is not None:  # continue from the last step's slice where it is the longer start
            longer = self.cache.longest_prefix(prefix, adapter)
            if longer is not None and len(longer) > ref.covers:
                superseded, start, ref = start, longer, _ref_of(longer)
        entry.how = _costlier(entry.how, how)
        if ref.covers < len(prefix):
            ref = self._kept(prefix, ref, kind, images, adapter, plan=plan, entry=entry)
        for slice_ in (superseded, start if stepped is not None else None):
            entry.after.append(functools.partial(self.stepped.drop_slice, slice_, state_tokens))
        return ref

    def _kept(
        self,
        ids: list[int],
        ref: Ref,
        kind: str,
        images: ImageSet | None,
        adapter: int,
        *,
        plan: ForwardPlan,
        entry: _Planned,
    ) -> Ref:
        entry.state_tokens += len(ids) - ref.covers
        return plan.keep(ids, ref, adapter, images, lambda cache: self.cache.put(ids, cache, kind, adapter))

    def _preamble(
        self, preamble: tuple[int, ...], ids: Sequence[int], adapter: int, plan: ForwardPlan
    ) -> Ref:
        """What a sequence computed from position 0 continues: the stored state of the preamble
        every prompt starts with, else the preamble as a segment of this forward, kept for every
        later prompt; nothing where `ids` do not go past it, it is shorter than
        `PREAMBLE_MIN_TOKENS`, or it is larger than the cache's whole budget. `ids` start with it
        (`TorchEngine.prepare` and `prepare_ids` set it only where they do)."""
        n = len(preamble)
        if n < PREAMBLE_MIN_TOKENS or len(ids) <= n or adapter in self.unkept_preambles:
            return Ref()
        stored = self.cache.peek(preamble, STATE, adapter)
        if stored is not None:
            return _ref_of(stored)

        def store(cache: Any) -> StoredState:
            stored = self.cache.put(preamble, cache, STATE, adapter, is_preamble=True)
            if stored.nbytes > self.cache.budget_bytes:
                self.unkept_preambles.add(adapter)  # the cache can never keep it: never planned again
            return stored

        return plan.keep(preamble, Ref(), adapter, None, store)

    def _read(
        self, plan: ForwardPlan, packed: Packed
    ) -> list[ScoredRow | tuple[list[float], list[float], Any]]:
        """Every read row's readout: the output head over their last hidden states at the token
        ids read (SemIf's slots first, then methods' own ids), or the hidden state itself."""
        reads = plan.reads
        if not reads:
            return []
        hidden = self.torch.stack([packed.hidden[r.segment] for r in reads])
        readouts: list[Any] = [None] * len(reads)
        logit_rows = [k for k, r in enumerate(reads) if not r.hidden]
        if logit_rows:
            columns, placed = self.runner._columns_of([reads[k].own for k in logit_rows])
            row_adapters = [plan.segments[reads[k].segment].adapter for k in logit_rows]
            with self.torch.inference_mode(), self.runner.adapters.rows(row_adapters):
                logits = head_logits(self.runner.model, hidden[logit_rows], columns)
            for at, k in enumerate(logit_rows):
                own = reads[k].own
                if own is None:
                    readouts[k] = (*read_slots(logits[at], reads[k].n_options), None)
                else:
                    readouts[k] = (_picked(logits[at], own, placed), [], None)
        for k, r in enumerate(reads):
            if r.hidden:
                readouts[k] = ([], [], hidden[k].float())
        return readouts

    def _outcome(self, entry: _Planned, readouts: list[Any], seconds: float, requests: int) -> Outcome:
        """One group's results from the forward (UNFINISHED where it ran a prefill step)."""
        if entry.unfinished:
            return UNFINISHED
        tokens = max(1, entry.state_tokens + entry.row_tokens)
        run = GroupRun(
            suffix_forward_seconds=seconds * entry.row_tokens / tokens,
            width=entry.width,
            prefix_tokens=entry.prefix_tokens,
            prefill=entry.how,
            prefill_seconds=seconds * entry.state_tokens / tokens + entry.stepped_seconds,
            requests=len(set(entry.group.job_ids)),
            rows=entry.group.rows,
            direct=entry.direct,
            forward_requests=requests,
            packed=True,
        )
        results: Results = {}
        at = 0
        for part in sorted(entry.group.parts, key=lambda p: p.job.payload.adapter):
            count = part.stop - part.start
            rows = [readouts[k] for k in entry.reads[at : at + count]]
            results.setdefault(part.job.id, []).extend(ScoredRow(lg, pr, run, h) for lg, pr, h in rows)
            at += count
        return results


def _is_direct(group: Group[PreparedRows]) -> bool:
    return group.prefix_key is None and group.parts[0].job.payload.direct


def _ref_of(state: StoredState | None) -> Ref:
    return Ref(start=state, covers=len(state)) if state is not None else Ref()


def _costlier(a: str, b: str) -> str:
    """The costlier of two prefill kinds (fresh > extended > cached > none)."""
    return next((k for k in PREFILL_KINDS if k in (a, b)), "none")


def _merge(earlier: Outcome | None, outcome: Outcome) -> Outcome:
    """Two outcomes of one group's sub-groups as one: unfinished while either is (the finished
    rows delivered now)."""
    if earlier is None:
        return outcome
    done: dict[Any, Any] = {**(earlier.done if isinstance(earlier, Unfinished) else earlier)}
    done.update(outcome.done if isinstance(outcome, Unfinished) else outcome)
    if isinstance(earlier, Unfinished) or isinstance(outcome, Unfinished):
        return Unfinished(done) if done else UNFINISHED
    return done
