"""The runner: scores rows (one question + ordered options) over a state with a loaded model.

A row's score is SemIf's readout: the full-vocabulary logits at the last prompt position,
in float32, restricted to the answer slots. Rows that share a state run through one path:
the state prefix's cache comes from the state cache or is prefilled once (in chunks), is
forked over the rows, every suffix runs in one right-padded forward and each row is read at
its last real position, whose hidden state alone goes through the vocabulary projection.

Scoring is split so that the worker can merge requests: `prepare` (encode and check one
request, off the engine thread), `run_group` (one planned group of requests' rows, on the
engine thread) and `readout` (one request's `Readout` from its scored rows). `score` runs
the three for one request alone.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from semif_serve.domain.images import ImageAsset
from semif_serve.domain.prompt import EncodedPrompt, PromptCodec
from semif_serve.domain.types import BatchTiming, ImageTooLargeForMemory, PromptRow, TooLargeForMemory
from semif_serve.engine.batching import UNFINISHED, Group, Job, Part
from semif_serve.engine.loader import LoadedModel, ModelIdentity
from semif_serve.engine.memory import DeviceMemory, MemoryEstimate
from semif_serve.engine.state_cache import (
    QUESTION,
    STATE,
    StateCache,
    StoredState,
    logits_over,
    prefill,
    prefix_digest,
)
from semif_serve.engine.vision import ImageSet, VisionTower, has_image_tokens, text_chunk_flops

log = logging.getLogger("semif_serve.engine")

DIRECT_READOUT = "native full-vocabulary last-position logits restricted to declared answer slots"
SHARED_READOUT = "native selected suffix-position logits"
SHARED_SERVING_CONFIG = "native-state-prefix-parallel-v1"
# How a lone row (no orderings) is run: "reuse" serves it from a cached state when there is one
# (and fills the cache afterwards, while the engine is idle); "plain" always runs SemIf's plain
# forward and never touches the cache (parity runs against upstream's predictions).
DIRECT_PATHS = ("reuse", "plain")
IDLE_PREFILL_TOKENS = 512  # one idle step of a deferred prefill: what a newcomer may wait behind
MAX_DEFERRED = 4  # states waiting for an idle prefill (the newest first; older ones are dropped)


@dataclass(frozen=True)
class RowReadout:
    """SemIf's readout of one row."""

    option_logits: list[float]
    probabilities: list[float]
    input_tokens: int
    prompt_sha256: str


@dataclass(frozen=True)
class Readout:
    """The readouts of a batch of rows, in order, and how they were computed."""

    rows: list[RowReadout]
    shared: bool
    forward_seconds: float
    total_seconds: float
    timing: BatchTiming | None  # None on the direct path
    lone_timing: BatchTiming | None = None  # a lone row's run: `prefill` says whether it ran over a state


@dataclass(frozen=True)
class PreparedRows:
    """One request's rows, encoded and checked, ready to join a group of requests.

    `prefix` is what its rows share (prefilled once, or found in the state cache; empty on
    the direct path); its first `state_tokens` are the question-independent state prefix.
    """

    engine: TorchEngine
    prompts: list[EncodedPrompt]
    n_options: list[int]
    prefix: list[int]
    state_tokens: int
    direct: bool
    encode_seconds: float
    state_ids: tuple[int, ...] = ()  # the question-independent state prefix (a lone row's state)
    demand_key: str | None = None  # the raw state's digest (`state_digest`), set by the worker
    images: ImageSet | None = None  # the images its rows show (None: text only)

    def job(self, job_id: Hashable) -> Job:
        """The batching job for these rows (rows sized after the prefix)."""
        n = len(self.prefix)
        return Job(
            id=job_id,
            prefix_key=prefix_digest(self.prefix) if n else None,
            prefix_tokens=n,
            row_tokens=tuple(len(p.ids) - n for p in self.prompts),
            payload=self,
        )


@dataclass(frozen=True)
class GroupRun:
    """How one group ran: its state, its forwards and who shared them."""

    prefix_tokens: int
    prefill: str  # "fresh", "extended", "cached" or "none"
    prefill_seconds: float
    replicate_seconds: float
    suffix_forward_seconds: float
    requests: int
    rows: int
    forwards: int
    width: int  # the widest suffix of the group (rows are padded to it)
    direct: bool  # SemIf's plain forward of one lone row


@dataclass(frozen=True)
class ScoredRow:
    """One row's slot logits and probabilities, and the group run that computed it."""

    option_logits: list[float]
    probabilities: list[float]
    run: GroupRun


class TorchEngine:
    """A loaded model and tokenizer that reads rows; owned by one worker thread.

    `headroom_bytes` (bytes between the warm baseline and the cap; None where the device has
    no cap or splitting is off) decides when a shared batch is split across forwards.
    `cache` keeps prefilled states for reuse; `prefill_chunk_tokens` bounds one prefill
    forward (None: the whole prefix at once).
    """

    def __init__(
        self,
        model: Any,
        codec: PromptCodec,
        identity: ModelIdentity,
        memory: DeviceMemory,
        headroom_bytes: int | None = None,
        cache: StateCache | None = None,
        prefill_chunk_tokens: int | None = None,
        direct_path: str = "reuse",
        vision: VisionTower | None = None,
    ) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.codec = codec
        self.identity = identity
        self.memory = memory
        self.headroom_bytes = headroom_bytes
        self.cache = cache if cache is not None else StateCache(0)
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._stepped: dict[str, float] = {}  # prefixes being prefilled in steps -> seconds so far
        self._slices: set[str] = set()  # the step slices stored in the cache, by digest
        if direct_path not in DIRECT_PATHS:
            raise ValueError(f"direct_path must be one of {DIRECT_PATHS}")
        self.direct_path = direct_path
        self.vision = vision
        # One engine step of the vision tower costs at most what one prefill chunk costs.
        self.tower_step_flops = (
            text_chunk_flops(model, prefill_chunk_tokens)
            if vision is not None and prefill_chunk_tokens
            else None
        )
        self._deferred: OrderedDict[str, _DeferredFill] = OrderedDict()  # engine thread only
        self.device = torch.device(identity.device)
        self.slot_ids = torch.tensor(codec.slots, device=self.device)
        self.estimate = MemoryEstimate(model.config, torch.tensor([], dtype=model.dtype).element_size())
        tokenizer = codec.tokenizer
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self.model_info = identity.as_dict()

    @classmethod
    def over(cls, loaded: LoadedModel) -> TorchEngine:
        """An engine over a loaded checkpoint (no state cache until startup gives it one)."""
        return cls(loaded.model, loaded.codec, loaded.identity, loaded.memory, vision=loaded.vision)

    @property
    def capacity(self) -> int:
        """How many answer codes the loaded tokenizer can read (System One's option cap)."""
        return self.codec.capacity

    @property
    def reads_images(self) -> bool:
        """Whether the loaded model has a vision tower (requests may show it images)."""
        return self.vision is not None

    def with_memory(self, memory: DeviceMemory, headroom_bytes: int | None = None) -> TorchEngine:
        """The same weights, codec and state cache on another memory view and headroom (a new engine)."""
        return TorchEngine(
            self.model,
            self.codec,
            self.identity,
            memory,
            headroom_bytes,
            self.cache,
            self.prefill_chunk_tokens,
            self.direct_path,
            self.vision,
        )

    def with_state_cache(self, cache: StateCache, prefill_chunk_tokens: int | None) -> TorchEngine:
        """The same weights, memory view and headroom over another state cache (a new engine)."""
        return TorchEngine(
            self.model,
            self.codec,
            self.identity,
            self.memory,
            self.headroom_bytes,
            cache,
            prefill_chunk_tokens,
            self.direct_path,
            self.vision,
        )

    def with_direct_path(self, direct_path: str) -> TorchEngine:
        """The same engine running lone rows by `direct_path` ("reuse" or "plain"; a new engine)."""
        return TorchEngine(
            self.model,
            self.codec,
            self.identity,
            self.memory,
            self.headroom_bytes,
            self.cache,
            self.prefill_chunk_tokens,
            direct_path,
            self.vision,
        )

    # -- reading ------------------------------------------------------------------------------

    def score(
        self,
        state: Any,
        rows: Sequence[PromptRow],
        *,
        shared: bool,
        max_input_tokens: int,
        max_request_tokens: int | None = None,
        images: Sequence[ImageAsset] = (),
    ) -> Readout:
        """Read rows over one state, alone. `shared=False` with one row runs SemIf's plain
        forward; otherwise the state prefix is prefilled once (or found in the state cache)
        and the rows run in right-padded batches (split where the memory headroom says one
        batch would not fit).

        Raises TooManyTokens, AnswerBoundary or TooLargeForMemory with `row` set to the
        position of the row concerned.
        """
        prepared = self.prepare(
            state,
            rows,
            shared=shared,
            max_input_tokens=max_input_tokens,
            max_request_tokens=max_request_tokens,
            images=images,
        )
        job = prepared.job(0)
        group = Group(job.prefix_key, job.prefix_tokens, (_whole(job),))
        while (scored := self.run_group(group)) is UNFINISHED:
            pass
        return self.readout(prepared, scored[0])

    def prepare(
        self,
        state: Any,
        rows: Sequence[PromptRow],
        *,
        shared: bool,
        max_input_tokens: int,
        max_request_tokens: int | None = None,
        images: Sequence[ImageAsset] = (),
    ) -> PreparedRows:
        """Encode (the state once) and check one request's rows and find what they share; refuses
        (TooManyTokens, for a row or past `max_request_tokens` for the request; AnswerBoundary,
        TooLargeForMemory; with `row` set) before anything runs.

        `images` (the request's, each with its placeholder): every placeholder becomes its
        image's tokens, and the pixels of images whose state is not cached are decoded here
        (off the engine thread). They need a model that reads images (`reads_images`), which
        the door checks first; an image too large for the tower's memory is refused here."""
        started = time.perf_counter()
        image_set = None
        codec = self.codec
        if images:
            if self.vision is None:
                raise ValueError("images for a model without a vision tower")
            image_set = self.vision.prepare(images)
            self._tower_fits(image_set)
            codec = codec.with_images(image_set.spans)
        prompts = codec.encode_prompts(state, rows, max_input_tokens, max_request_tokens)
        direct = not shared and len(rows) == 1
        prefix: list[int] = []
        state_tokens = 0
        state_ids: tuple[int, ...] = ()
        if direct and self.direct_path == "reuse":
            state_ids = tuple(shared_token_prefix(codec.state_prefix(state, prompts[0]), prompts))
        if not direct:
            state_prefix = codec.state_prefix(state, prompts[0])
            prefix = shared_token_prefix(state_prefix, prompts)
            state_tokens = min(len(state_prefix), len(prefix))
            widest = max(range(len(prompts)), key=lambda i: len(prompts[i].ids))
            self._rows_that_fit(len(prefix), len(prompts[widest].ids) - len(prefix), widest)
        if image_set is not None:
            image_set.preprocess(self._uncached_images(image_set, prefix or list(state_ids), prompts))
        return PreparedRows(
            engine=self,
            prompts=prompts,
            n_options=[len(row.descriptions) for row in rows],
            prefix=prefix,
            state_tokens=state_tokens,
            direct=direct,
            encode_seconds=time.perf_counter() - started,
            state_ids=state_ids,
            images=image_set,
        )

    def run_group(self, group: Group) -> dict[Hashable, list[ScoredRow]] | Any:
        """Score one planned group on this thread; the results of each job's rows in the
        group, in order. Lone rows (no shared prefix) go through `_run_direct`, which serves
        them from a state where one is cached or wanted by several requests; everything else
        through `_run_planned`. An image whose tower costs more than a prefill chunk first goes
        through the tower one step per call (`_tower_step`), each returning UNFINISHED."""
        if self._tower_step(group):
            return UNFINISHED
        if group.prefix_key is None and self.direct_path == "reuse" and group.parts[0].job.payload.direct:
            return self._run_direct(group)
        return self._run_planned(group)

    def _tower_step(self, group: Group) -> bool:
        """One step of the vision tower for an image whose features this group's forward needs
        (shown in its rows past the longest cached state); False when none needs a step."""
        if self.tower_step_flops is None:
            return False
        images = ImageSet.union([p.job.payload.images for p in group.parts])
        if images is None:
            return False
        payloads = {id(p.job.payload): p.job.payload for p in group.parts}.values()
        if not images.tower_step(images.shown_in(self._ids_to_compute(payloads)), self.tower_step_flops):
            return False
        self.memory.synchronize()
        return True

    def _ids_to_compute(self, payloads: Iterable[PreparedRows]) -> Iterator[Sequence[int]]:
        """The ids a forward over these requests' rows computes: each state past its longest
        cached prefix, and every row after the state."""
        for prepared in payloads:
            state = prepared.prefix or list(prepared.state_ids)
            cached = self.cache.longest_prefix(state) if state else None
            yield state[len(cached) if cached is not None else 0 :]
            yield from (p.ids[len(state) :] for p in prepared.prompts)

    def _run_planned(self, group: Group) -> dict[Hashable, list[ScoredRow]] | Any:
        """Score one planned group on this thread: one state (cached or prefilled once) for
        every part, the rows in right-padded forwards split by the memory headroom; the
        results of each job's rows in the group, in order. A lone direct row runs SemIf's
        plain forward; direct rows merged with others run right-padded with no state.

        A state longer than PREFILL_STEP_CHUNKS chunks is prefilled a step at a time: this
        call prefills one step, keeps it in the state cache and returns UNFINISHED, so the
        batcher can run other requests' groups before the next step (the cache must be on)."""
        parts = group.parts
        images = ImageSet.union([p.job.payload.images for p in parts])
        if len(parts) == 1 and parts[0].job.payload.direct:
            prepared = parts[0].job.payload
            (logits, probs), seconds = self._direct(prepared.prompts[0].ids, prepared.n_options[0], images)
            run = GroupRun(0, "none", 0.0, 0.0, seconds, 1, 1, 1, len(prepared.prompts[0].ids), True)
            return {parts[0].job.id: [ScoredRow(logits, probs, run)]}
        first: PreparedRows = parts[0].job.payload
        prefix = first.prefix if group.prefix_key is not None else []
        if self._prefill_step(prefix, first.state_tokens, images):
            return UNFINISHED
        stored, how, prefill_seconds = self._state(prefix, first.state_tokens, images)
        rows = [
            (p.job.payload.prompts[i].ids[len(prefix) :], p.job.payload.n_options[i])
            for p in parts
            for i in range(p.start, p.stop)
        ]
        width = max(len(suffix) for suffix, _ in rows)
        step = self._rows_per_forward(len(prefix), width) or len(rows)
        readouts: list[tuple[list[float], list[float]]] = []
        replicate_seconds = suffix_seconds = 0.0
        forwards = 0
        torch = self.torch
        with torch.inference_mode():
            for start in range(0, len(rows), step):
                chunk = rows[start : start + step]
                t0 = time.perf_counter()
                cache = stored.fork(len(chunk)) if stored is not None else None
                self.memory.synchronize()
                t1 = time.perf_counter()
                logits = logits_over(
                    self.model,
                    cache,
                    len(prefix),
                    [s for s, _ in chunk],
                    self.pad_id,
                    self.prefill_chunk_tokens,
                    images,
                    prefix,
                )
                del cache
                readouts.extend(self._readout(logits[i], n) for i, (_, n) in enumerate(chunk))
                del logits
                self.memory.synchronize()
                replicate_seconds += t1 - t0
                suffix_seconds += time.perf_counter() - t1
                forwards += 1
        run = GroupRun(
            prefix_tokens=len(prefix),
            prefill=how,
            prefill_seconds=prefill_seconds,
            replicate_seconds=replicate_seconds,
            suffix_forward_seconds=suffix_seconds,
            requests=len({p.job.id for p in parts}),
            rows=len(rows),
            forwards=forwards,
            width=width,
            direct=False,
        )
        results: dict[Hashable, list[ScoredRow]] = {}
        at = 0
        for p in parts:
            count = p.stop - p.start
            results[p.job.id] = [ScoredRow(lg, pr, run) for lg, pr in readouts[at : at + count]]
            at += count
        return results

    def readout(self, prepared: PreparedRows, scored: Sequence[ScoredRow]) -> Readout:
        """One request's readouts and timing from its scored rows (which may span several groups)."""
        runs = list({id(r.run): r.run for r in scored}.values())
        readouts = [
            RowReadout(row.option_logits, row.probabilities, len(p.ids), p.sha256)
            for row, p in zip(scored, prepared.prompts, strict=True)
        ]
        forward_seconds = sum(
            r.prefill_seconds + r.replicate_seconds + r.suffix_forward_seconds for r in runs
        )
        total = prepared.encode_seconds + forward_seconds
        n_prefix = len(prepared.prefix)  # 0 for a lone row: its state, if it ran over one, is not shared
        prefills = [r.prefill for r in runs]
        timing = BatchTiming(
            prefix_tokens=n_prefix,
            prefill_seconds=sum(r.prefill_seconds for r in runs),
            replicate_seconds=sum(r.replicate_seconds for r in runs),
            suffix_forward_seconds=sum(r.suffix_forward_seconds for r in runs),
            batch_size=len(prepared.prompts),
            true_suffix_tokens=sum(len(p.ids) - n_prefix for p in prepared.prompts),
            padded_suffix_tokens=sum(r.width * sum(1 for row in scored if row.run is r) for r in runs),
            forward_batches=sum(r.forwards for r in runs),
            merged_requests=max(r.requests for r in runs),
            prefill=next((k for k in PREFILL_KINDS if k in prefills), "none"),
            prefill_shared=any(r.requests > 1 for r in runs) and n_prefix > 0,
        )
        if prepared.direct:  # SemIf's direct readout whichever way it ran; `lone_timing` says how
            return Readout(readouts, False, forward_seconds, total, None, lone_timing=timing)
        return Readout(readouts, True, forward_seconds, total, timing)

    def _prefill_step(self, prefix: list[int], state_tokens: int, images: ImageSet | None = None) -> bool:
        """Prefill one step of a long `prefix` into the state cache; False when what is left
        fits in one step (or the cache cannot keep a step), so `_state` finishes it now."""
        if not prefix or not self.prefill_chunk_tokens or self.cache.holds(prefix):
            return False
        step = self.prefill_chunk_tokens * PREFILL_STEP_CHUNKS
        whole_state = self.estimate.cache_per_token * len(prefix) + self.estimate.state_per_row
        if whole_state > self.cache.budget_bytes:
            return False  # the cache could not keep the steps: prefilled in one go
        start = self.cache.longest_prefix(prefix)
        done = len(start) if start is not None else 0
        if len(prefix) - done <= step:
            return False
        boundary = state_tokens if done < state_tokens else len(prefix)
        target = min(boundary, done + step)
        t0 = time.perf_counter()
        stored = self._prefill(prefix[:target], start, STATE if target <= state_tokens else QUESTION, images)
        self.memory.synchronize()
        if not self.cache.holds(stored.ids):
            return False
        self._drop_slice(start, state_tokens)
        if len(self._stepped) > MAX_STEPPED:
            self._stepped.clear()  # abandoned states' counters; only their timing is lost
        key = prefix_digest(prefix)
        self._stepped[key] = self._stepped.get(key, 0.0) + time.perf_counter() - t0
        self._slices.add(stored.digest)
        return True

    def _drop_slice(self, start: StoredState | None, state_tokens: int) -> None:
        """Drop a step's slice once a longer one supersedes it (the state prefix itself stays)."""
        if start is not None and start.digest in self._slices:
            self._slices.discard(start.digest)
            if len(start) != state_tokens:
                self.cache.discard(start.ids)

    def _run_direct(self, group: Group) -> dict[Hashable, list[ScoredRow]] | Any:
        """Lone rows (each request one row, no orderings), grouped by their state prefix.

        A state that is cached, or that several of these rows (or several requests in flight)
        want, is used (prefilled once and stored): each row then costs its suffix. Every other
        row runs as SemIf's plain forward of its whole prompt (the cheapest way to answer it
        now; several right-padded together) and its state is queued for an idle prefill, so a
        follow-up finds it cached. Either way a row equals the plain forward within 1e-5
        (float32) and keeps its `prompt_sha256` and `input_tokens`.
        """
        by_state: dict[tuple[int, ...], list[Part]] = {}
        for part in group.parts:
            by_state.setdefault(part.job.payload.state_ids, []).append(part)
        results: dict[Hashable, list[ScoredRow]] = {}
        plain: list[Part] = []
        for ids, parts in by_state.items():
            if ids and self._reuses(ids, parts):
                over = self._run_planned(_over_state(ids, parts))
                if over is UNFINISHED:
                    return UNFINISHED  # a long state's prefill step: the group runs again next turn
                results.update(over)
            else:
                plain.extend(parts)
        if len(plain) == 1:
            results.update(self._run_planned(Group(None, 0, tuple(plain))))
        elif plain:
            results.update(self._run_planned(Group(None, 0, tuple(_as_rows(p) for p in plain))))
        for part in plain:
            self._defer_prefill(part.job.payload.state_ids)
        return results

    def _reuses(self, ids: tuple[int, ...], parts: Sequence[Part]) -> bool:
        """Whether rows over state `ids` run over the state: it is cached, several want it, or it
        is longer than DIRECT_MAX_TOKENS (prefilled in chunks like any state, never one unbounded
        plain forward)."""
        if self.cache.has(ids):
            return True
        if len(ids) > DIRECT_MAX_TOKENS:
            return True
        if self.cache.budget_bytes and has_image_tokens(ids):
            return True  # kept now: an idle prefill later would have to run the tower again
        if self.cache.budget_bytes == 0:
            return len(parts) > 1  # one prefill still serves them all, nothing to keep
        wanted = max(self.cache.demand.count(p.job.payload.demand_key) for p in parts)
        return len(parts) > 1 or wanted > 1

    def _defer_prefill(self, ids: tuple[int, ...]) -> None:
        """Queue a state for an idle prefill (newest first; the oldest dropped past MAX_DEFERRED)."""
        if not ids or self.cache.budget_bytes == 0 or self.cache.has(ids) or has_image_tokens(ids):
            return
        key = prefix_digest(ids)
        self._deferred.pop(key, None)
        self._deferred[key] = _DeferredFill(ids)
        while len(self._deferred) > MAX_DEFERRED:
            self._deferred.popitem(last=False)

    @property
    def deferred_prefills(self) -> int:
        """States queued for an idle prefill."""
        return len(self._deferred)

    def fill_idle_step(self) -> bool:
        """One step (at most IDLE_PREFILL_TOKENS) of the newest deferred prefill, on the engine
        thread while nothing is queued; a finished state is stored in the cache. Whether
        more remains."""
        while self._deferred:
            key, fill = next(reversed(self._deferred.items()))
            if self.cache.has(fill.ids):  # a follow-up prefilled it meanwhile
                del self._deferred[key]
                continue
            upto = min(len(fill.ids), fill.done + IDLE_PREFILL_TOKENS)
            cache = prefill(self.model, fill.ids[:upto], start=fill.partial, chunk_tokens=IDLE_PREFILL_TOKENS)
            if upto == len(fill.ids):
                self.cache.put(fill.ids, cache, STATE)
                del self._deferred[key]
            else:
                fill.partial = StoredState(fill.ids[:upto], cache)
            self.memory.synchronize()
            return bool(self._deferred)
        return False

    def drop_deferred(self) -> None:
        """Forget every deferred prefill (after a failure: memory comes first)."""
        self._deferred.clear()

    def _state(
        self, prefix: list[int], state_tokens: int, images: ImageSet | None = None
    ) -> tuple[StoredState | None, str, float]:
        """The state over exactly `prefix`: from the cache, extended from a cached shorter one,
        or prefilled (in chunks). A prefix longer than the state prefix (it covers a question)
        starts from the state prefix, looked up (and stored when fresh) on its own, so that
        the next question about the same state extends it; the longer prefix itself goes in
        the cache's lower `question` tier, which never evicts a state."""
        if not prefix:
            return None, "none", 0.0
        kind = QUESTION if len(prefix) > state_tokens else STATE
        stored = self.cache.get(prefix, kind)
        if stored is not None:
            return stored, "cached", 0.0
        t0 = time.perf_counter()
        stepped = self._stepped.pop(prefix_digest(prefix), None)  # prefilled in steps: still fresh
        superseded: StoredState | None = None
        if kind == QUESTION and state_tokens > 0:
            start = self.cache.get(prefix[:state_tokens], STATE)
            how = "extended" if start is not None and stepped is None else "fresh"
            if start is None:
                state = prefix[:state_tokens]
                superseded = self.cache.longest_prefix(state)
                start = self._prefill(state, superseded, STATE, images)
        else:
            start = self.cache.longest_prefix(prefix)
            how = "extended" if start is not None and stepped is None else "fresh"
        if stepped is not None:  # continue from the last step's slice where it is the longer start
            longer = self.cache.longest_prefix(prefix)
            if longer is not None and (start is None or len(longer) > len(start)):
                superseded, start = start, longer
        stored = self._prefill(prefix, start, kind, images)
        self.memory.synchronize()
        for slice_ in (superseded, start if stepped is not None else None):
            self._drop_slice(slice_, state_tokens)
        return stored, how, time.perf_counter() - t0 + (stepped or 0.0)

    def _prefill(
        self, ids: list[int], start: StoredState | None, kind: str = STATE, images: ImageSet | None = None
    ) -> StoredState:
        cache = prefill(self.model, ids, start=start, chunk_tokens=self.prefill_chunk_tokens, images=images)
        return self.cache.put(ids, cache, kind)

    def _rows_per_forward(self, n_prefix: int, width: int) -> int | None:
        """Rows per suffix forward under the headroom (None: no limit); at least one."""
        if self.headroom_bytes is None:
            return None
        return max(
            1, self.estimate.rows_per_forward(self.headroom_bytes, n_prefix, width, self.prefill_chunk_tokens)
        )

    def _rows_that_fit(self, n_prefix: int, width: int, widest: int) -> None:
        """Refuse a request whose widest row (at position `widest`) cannot fit under the headroom."""
        if self.headroom_bytes is None:
            return
        chunk = self.prefill_chunk_tokens
        if self.estimate.rows_per_forward(self.headroom_bytes, n_prefix, width, chunk) == 0:
            need = self.estimate.prefill_bytes(n_prefix, chunk) + self.estimate.row_bytes(
                n_prefix, width, chunk
            )
            refusal = TooLargeForMemory(need, self.headroom_bytes)
            refusal.row = widest
            raise refusal

    def _readout(self, last_logits: Any, n_options: int) -> tuple[list[float], list[float]]:
        """Full-vocabulary float32 logits of one position -> (slot logits, their softmax)."""
        option = last_logits[self.slot_ids[:n_options]].float()  # the slots alone, not the vocabulary
        return option.tolist(), self.torch.softmax(option, dim=-1).tolist()

    def _uncached_images(
        self, images: ImageSet, prefix: Sequence[int], prompts: Sequence[EncodedPrompt]
    ) -> set[tuple[int, ...]]:
        """The images a forward may need features for: every one, unless a state over `prefix`
        is cached (then only those after it). The cache may still drop the state before the
        rows run; the images are then preprocessed on the engine thread."""
        after = len(prefix) if prefix and self.cache.holds(prefix) else 0
        return images.shown_in(p.ids[after:] for p in prompts)

    def _tower_fits(self, images: ImageSet) -> None:
        """Refuse images whose largest needs more memory in the tower than the headroom has."""
        if self.headroom_bytes is None or self.vision is None:
            return
        patches = self.vision.patches(list(images.images.values()))
        need = self.vision.activation_bytes(patches, self.estimate)
        if need > self.headroom_bytes:
            raise ImageTooLargeForMemory(need, self.headroom_bytes, patches)

    def _direct(
        self, ids: list[int], n_options: int, images: ImageSet | None = None
    ) -> tuple[tuple[list[float], list[float]], float]:
        torch = self.torch
        t0 = time.perf_counter()
        with torch.inference_mode():
            if images is not None and has_image_tokens(ids):  # embeddings and 3-D positions
                last = logits_over(
                    self.model, None, 0, [ids], self.pad_id, self.prefill_chunk_tokens, images
                )[0]
            else:
                last = self.model(
                    input_ids=torch.tensor([ids], device=self.device), use_cache=False, logits_to_keep=1
                ).logits[0, -1]
            readout = self._readout(last, n_options)
        self.memory.synchronize()
        return readout, time.perf_counter() - t0


PREFILL_STEP_CHUNKS = 1  # prefill chunks per engine step, between which other requests run
# The longest state a lone row's plain forward covers: SemIf's own per-row limit (/decide's 4096);
# System One's longer states are prefilled in chunks (two forwards cost about one at that length).
DIRECT_MAX_TOKENS = 4096
MAX_STEPPED = 1024
PREFILL_KINDS = ("fresh", "extended", "cached")  # a request's `prefill`: the costliest of its groups'


def _whole(job: Job) -> Part:
    return Part(job, 0, len(job.row_tokens))


@dataclass
class _DeferredFill:
    """A state waiting for an idle prefill, and how far it got (a private partial state)."""

    ids: tuple[int, ...]
    partial: StoredState | None = None

    @property
    def done(self) -> int:
        return len(self.partial) if self.partial is not None else 0


def _over_state(ids: tuple[int, ...], parts: Sequence[Part]) -> Group:
    """Lone rows as one group over their common state prefix `ids` (the shared path's rows)."""
    key = prefix_digest(ids)
    rekeyed = []
    for part in parts:
        prepared: PreparedRows = part.job.payload
        over = replace(prepared, prefix=list(ids), state_tokens=len(ids), direct=False)
        job = Job(part.job.id, key, len(ids), tuple(len(p.ids) - len(ids) for p in prepared.prompts), over)
        rekeyed.append(Part(job, part.start, part.stop))
    return Group(key, len(ids), tuple(rekeyed))


def _as_rows(part: Part) -> Part:
    """A lone row as a row of a right-padded forward without a state."""
    prepared: PreparedRows = part.job.payload
    return Part(replace(part.job, payload=replace(prepared, direct=False)), part.start, part.stop)


def shared_token_prefix(state_prefix: list[int], prompts: Sequence[EncodedPrompt]) -> list[int]:
    """The tokens to prefill once: the state prefix, cut back to what every prompt starts with,
    then, for several rows, extended over whatever they all still share (the question, for
    the orderings of one decision). Any common token prefix is exact: the model is causal.

    Upstream's rule (drop the prefix's last token) covers a tokenizer that merges JSON
    punctuation into one token; one that merges deeper needs the cut-back. Every row keeps at
    least its last token, whose position is read.
    """
    limit = min(len(p.ids) for p in prompts) - 1
    length = min(len(state_prefix), limit)
    while length and any(p.ids[:length] != state_prefix[:length] for p in prompts):
        length -= 1
    if length < len(state_prefix):
        log.debug("state prefix cut from %d to %d tokens", len(state_prefix), length)
    first = prompts[0].ids
    if len(prompts) > 1 and length == len(state_prefix):
        while length < limit and all(p.ids[length] == first[length] for p in prompts):
            length += 1
    return first[:length]
