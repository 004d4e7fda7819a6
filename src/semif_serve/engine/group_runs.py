"""The engine's state over one model (its state cache, stepped prefill, lone-row policy and forward
shapes) and the right-padded row loop for a group whose rows the memory headroom splits across
forwards (`run_planned`; every other group runs packed: `engine.packed_runs`).

A group's rows share one state (cached, extended from a shorter cached one, or prefilled once, in
steps where it is long: `SteppedPrefill`), forked over right-padded forwards split by the memory
headroom; rows of several adapters sit side by side, each adapter reading its contiguous run of
the batch. Each row is read at its last real position: SemIf's answer slots, a method's own token
ids (lev's label codes) or its last hidden state (lev's head), one forward for all of them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from semif_serve.domain.requests import BASE
from semif_serve.engine.adapters import AdapterBank, stacked_fork
from semif_serve.engine.batching import UNFINISHED, Group, Job, Part, Unfinished
from semif_serve.engine.forward_shapes import ForwardShapes
from semif_serve.engine.forwards import head_logits, logits_over, prefill, read_slots
from semif_serve.engine.lone import LoneRowPolicy
from semif_serve.engine.memory import MemoryEstimate
from semif_serve.engine.options import EngineOptions
from semif_serve.engine.rows import PREFILL_KINDS, GroupRun, PreparedRows, Results, ScoredRow
from semif_serve.engine.state_cache import QUESTION, STATE, StoredState, prefix_digest
from semif_serve.engine.stepped import SteppedPrefill
from semif_serve.engine.vision import ImageSet


class GroupRunner:
    """Runs planned groups over one model and its adapters under the engine's options."""

    def __init__(
        self,
        model: Any,
        adapters: AdapterBank,
        options: EngineOptions,
        estimate: MemoryEstimate,
        slot_ids: Any,
        pad_id: int,
    ) -> None:
        import torch

        self.torch, self.model, self.adapters, self.estimate = torch, model, adapters, estimate
        self.slot_ids, self.pad_id, self.device = slot_ids, pad_id, slot_ids.device  # SemIf's answer slots
        self.slots = [int(t) for t in slot_ids.tolist()]  # read once: a forward never syncs for them
        self.memory, self.cache, self.headroom_bytes = options.memory, options.cache, options.headroom_bytes
        self.prefill_chunk_tokens = chunk = options.prefill_chunk_tokens
        self.stepped = SteppedPrefill(self.cache, estimate, self.memory, chunk, self._prefill)
        self.lone = LoneRowPolicy(self.cache, options.keep_state_tokens)
        self.shapes = ForwardShapes()  # every forward's rows, requests, sequences and padding

    def run_planned(self, group: Group[PreparedRows]) -> Results | Unfinished:
        """Score one planned group on this thread: one state (cached or prefilled once) for
        every part, the rows in right-padded forwards split by the memory headroom; the
        results of each job's rows in the group, in order.

        A state longer than one prefill step is prefilled a step at a time (`SteppedPrefill`):
        this call prefills one step, keeps it in the state cache and returns UNFINISHED, so the
        batcher can run other requests' groups before the next step (the cache must be on)."""
        # Rows of one adapter side by side: each adapter's rows are a contiguous run of the batch.
        parts = sorted(group.parts, key=lambda p: p.job.payload.adapter)
        images = ImageSet.union([p.job.payload.images for p in parts])
        first = parts[0].job.payload
        prefix = first.prefix if group.prefix_key is not None else []
        adapters = sorted({p.job.payload.adapter for p in parts})
        caller = group.job_ids
        if any(self.stepped.step(prefix, first.state_tokens, images, a, (caller, a)) for a in adapters):
            return UNFINISHED
        states = {a: self._state(prefix, first.state_tokens, images, a) for a in adapters}
        hows = {how for _, how, _ in states.values()}
        how = next((k for k in PREFILL_KINDS if k in hows), "none")
        prefill_seconds = sum(seconds for _, _, seconds in states.values())
        rows = [
            (p.job.payload.prompts[i].ids[len(prefix) :], p.job.payload.n_options[i], p.job.payload.adapter)
            for p in parts
            for i in range(p.start, p.stop)
        ]
        width = max(len(suffix) for suffix, _, _ in rows)
        chunk = self.prefill_chunk_tokens
        step = self.estimate.rows_under(self.headroom_bytes, len(prefix), width, chunk) or len(rows)
        reads = _row_reads(parts)
        hidden_rows = [p.job.payload.hidden for p in parts for _ in range(p.start, p.stop)]
        columns, placed = self._columns_of([r for r, h in zip(reads, hidden_rows, strict=True) if not h])
        readouts: list[tuple[list[float], list[float], Any]] = []
        replicate_seconds = suffix_seconds = 0.0
        forwards = 0
        with self.torch.inference_mode():
            for start in range(0, len(rows), step):
                batch = rows[start : start + step]
                row_adapters = [a for _, _, a in batch]
                t0 = time.perf_counter()
                cache = _fork({a: stored for a, (stored, _, _) in states.items()}, row_adapters)
                self.memory.synchronize()
                t1 = time.perf_counter()
                suffixes = [s for s, _, _ in batch]
                any_hidden = any(hidden_rows[start : start + len(batch)])
                with self.adapters.rows(row_adapters):
                    last = logits_over(
                        self.model,
                        cache,
                        len(prefix),
                        suffixes,
                        pad_id=self.pad_id,
                        chunk_tokens=chunk,
                        images=images,
                        prefix=prefix,
                        hidden_out=any_hidden,
                        columns=columns,
                    )
                    # Hidden rows beside logit rows: one forward, the head over the others' states.
                    every_hidden = all(hidden_rows[start : start + len(batch)])
                    logits = (
                        head_logits(self.model, last, columns) if any_hidden and not every_hidden else last
                    )
                del cache
                for i, (_, n, _) in enumerate(batch):
                    own = reads[start + i]
                    if hidden_rows[start + i]:
                        readouts.append(([], [], last[i].float()))
                    elif own is None:
                        readouts.append((*read_slots(logits[i], n), None))
                    else:
                        readouts.append((_picked(logits[i], own, placed), [], None))
                del logits, last
                self.memory.synchronize()
                true = sum(len(s) for s in suffixes)
                self.shapes.observe(
                    len(batch), len({p.job.id for p in parts}), 1, true, len(batch) * max(map(len, suffixes))
                )
                replicate_seconds += t1 - t0
                suffix_seconds += time.perf_counter() - t1
                forwards += 1
        run = GroupRun(
            suffix_forward_seconds=suffix_seconds,
            width=width,
            prefix_tokens=len(prefix),
            prefill=how,
            prefill_seconds=prefill_seconds,
            replicate_seconds=replicate_seconds,
            requests=len({p.job.id for p in parts}),
            rows=len(rows),
            forwards=forwards,
        )
        results: Results = {}
        at = 0
        for p in parts:
            count = p.stop - p.start
            results[p.job.id] = [ScoredRow(lg, pr, run, h) for lg, pr, h in readouts[at : at + count]]
            at += count
        return results

    def _columns_of(self, reads: Sequence[tuple[int, ...] | None]) -> tuple[Any, dict[int, int]]:
        """The token ids one forward reads for its rows: SemIf's answer slots first (where a row
        reads them: `read_slots` takes the leading ones), then every other row's own ids once;
        and where each id sits among them."""
        if all(r is None for r in reads):
            return self.slot_ids, {}
        ids = list(self.slots) if any(r is None for r in reads) else []
        at = {t: i for i, t in enumerate(ids)}
        for own in reads:
            for token in own or ():
                if token not in at:
                    at[token] = len(ids)
                    ids.append(token)
        return self.torch.tensor(ids, device=self.device), at

    def _state(
        self, prefix: list[int], state_tokens: int, images: ImageSet | None = None, adapter: int = BASE
    ) -> tuple[StoredState | None, str, float]:
        """The state over exactly `prefix` under `adapter`: from the cache, extended from a cached
        shorter one of the same adapter, or prefilled (in chunks). A prefix longer than the state
        prefix (it covers a question) starts from the state prefix, looked up (and stored when
        fresh) on its own, so that the next question about the same state extends it; the
        longer prefix itself goes in the cache's lower `question` tier, which never evicts a
        state."""
        if not prefix:
            return None, "none", 0.0
        kind = QUESTION if len(prefix) > state_tokens else STATE
        stored = self.cache.get(prefix, kind, adapter)
        if stored is not None:
            return stored, "cached", 0.0
        t0 = time.perf_counter()
        stepped = self.stepped.take(prefix, adapter)  # prefilled in steps: still fresh
        start, how, state_first, superseded = state_start(self.cache, prefix, state_tokens, adapter, stepped)
        if state_first:
            start = self._prefill(prefix[:state_tokens], superseded, STATE, images, adapter)
        if stepped is not None:  # continue from the last step's slice where it is the longer start
            longer = self.cache.longest_prefix(prefix, adapter)
            if longer is not None and (start is None or len(longer) > len(start)):
                superseded, start = start, longer
        stored = self._prefill(prefix, start, kind, images, adapter)
        self.memory.synchronize()
        for slice_ in (superseded, start if stepped is not None else None):
            self.stepped.drop_slice(slice_, state_tokens)
        return stored, how, time.perf_counter() - t0 + (stepped or 0.0)

    def _prefill(
        self,
        ids: list[int],
        start: StoredState | None,
        kind: str = STATE,
        images: ImageSet | None = None,
        adapter: int = BASE,
        drop_start: bool = False,
    ) -> StoredState:
        """Prefill `ids` from `start` and store it in tier `kind` (`drop_start`: `start` is a
        superseded slice, dropped before the store so it costs no eviction)."""
        with self.adapters.rows(adapter):
            chunk = self.prefill_chunk_tokens
            cache = prefill(self.model, ids, start=start, chunk_tokens=chunk, images=images)
        if drop_start and start is not None:
            self.cache.discard(start.ids, start.adapter)
        return self.cache.put(ids, cache, kind, adapter)


def state_start(
    cache: Any, prefix: list[int], state_tokens: int, adapter: int, stepped: float | None
) -> tuple[StoredState | None, str, bool, StoredState | None]:
    """Where a state over `prefix` (not cached as it is) starts: the cached state it extends, its
    prefill kind ("extended" or "fresh"; a stepped prefill is fresh), whether the question-
    independent state prefix must be computed (and kept) first, and the shorter state that one
    extends (its start)."""
    if len(prefix) > state_tokens > 0:  # a question prefix: from its state, kept on its own
        start = cache.get(prefix[:state_tokens], STATE, adapter)
        how = "extended" if start is not None and stepped is None else "fresh"
        if start is None:
            return None, how, True, cache.longest_prefix(prefix[:state_tokens], adapter)
        return start, how, False, None
    start = cache.longest_prefix(prefix, adapter)
    # From the preamble alone a state is new: only the ids every prompt starts with were stored.
    extended = start is not None and not start.is_preamble and stepped is None
    return start, "extended" if extended else "fresh", False, None


def _fork(states: dict[int, StoredState | None], row_adapters: Sequence[int]) -> Any:
    """A consumable cache for a forward's rows (sorted by adapter): each row over its adapter's
    state (None: no state); rows of several adapters stack their states (`stacked_fork`)."""
    runs: list[tuple[int, int]] = []
    for adapter in row_adapters:
        if runs and runs[-1][0] == adapter:
            runs[-1] = (adapter, runs[-1][1] + 1)
        else:
            runs.append((adapter, 1))
    if states[runs[0][0]] is None:
        return None
    if len(runs) == 1:
        return states[runs[0][0]].fork(runs[0][1])  # type: ignore[union-attr]
    return stacked_fork([(states[m], n) for m, n in runs])


def _row_reads(parts: Sequence[Part[PreparedRows]]) -> list[tuple[int, ...] | None]:
    """Each row's own read columns, in the order `_run_planned` lays the rows out (None: SemIf's slots)."""
    return [
        None if p.job.payload.columns is None else p.job.payload.columns[i]
        for p in parts
        for i in range(p.start, p.stop)
    ]


def _picked(logits: Any, ids: Sequence[int], at: Mapping[int, int]) -> list[float]:
    """One row's float32 logits at `ids` (in their order) from a forward that read `at`'s ids."""
    return logits[[at[t] for t in ids]].float().tolist()


def _over_state(ids: tuple[int, ...], parts: Sequence[Part[PreparedRows]]) -> Group[PreparedRows]:
    """Lone rows as one group over their common state prefix `ids` (the shared path's rows)."""
    key = prefix_digest(ids)
    rekeyed = []
    for part in parts:
        prepared = part.job.payload
        over = replace(prepared, prefix=list(ids), state_tokens=len(ids), direct=False)
        job = Job(part.job.id, key, len(ids), tuple(len(p.ids) - len(ids) for p in prepared.prompts), over)
        rekeyed.append(Part(job, part.start, part.stop))
    return Group(key, len(ids), tuple(rekeyed))
