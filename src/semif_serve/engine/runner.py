"""The engine: scores rows (one question + ordered options) over a state with a loaded model.

A row's score is SemIf's readout: the logits of the answer slots at the last prompt position,
in float32 (the output head computes those rows only, `forwards.head_logits`). Rows that share
a state run through one path: the state prefix's cache comes from the state cache or is
prefilled once (in chunks), is forked over the rows, every suffix runs in one right-padded
forward and each row is read at its last real position.

Scoring is split so that the worker can merge requests: `prepare` (encode and check one
request, off the engine thread), `run_group` (one planned group of requests' rows, on the
engine thread) and `readout` (one request's `Readout` from its scored rows). `score` runs
the three for one request alone. The rooms around it: the forwards (`forwards`), the stepped
prefill (`stepped`), the lone-row policy (`lone`), lev's prefix rule (`sharing`), the headroom
checks (`memory.MemoryEstimate`), the state cache (`state_cache`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from semif_serve.domain.prompt import EncodedPrompt, PromptCodec
from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import BatchTiming, EngineWait, PromptRow
from semif_serve.engine.adapters import BASE, AdapterBank, stacked_fork
from semif_serve.engine.batching import UNFINISHED, Group, Job, Part, Unfinished
from semif_serve.engine.forwards import head_logits, logits_over, plain_logits, prefill, read_slots
from semif_serve.engine.loader import LoadedModel, ModelIdentity
from semif_serve.engine.lone import KEEP_STATE_TOKENS, LoneRowPolicy
from semif_serve.engine.memory import DeviceMemory, MemoryEstimate
from semif_serve.engine.sharing import prefill_pays
from semif_serve.engine.state_cache import QUESTION, STATE, StateCache, StoredState, prefix_digest
from semif_serve.engine.stepped import SteppedPrefill
from semif_serve.engine.threads import EngineThreads, ThreadPolicy
from semif_serve.engine.vision import ImageSet, VisionTower, text_chunk_flops

log = logging.getLogger("semif_serve.engine")

DIRECT_READOUT = "native full-vocabulary last-position logits restricted to declared answer slots"
SHARED_READOUT = "native selected suffix-position logits"
SHARED_SERVING_CONFIG = "native-state-prefix-parallel-v1"
# How a lone row (no orderings) is run: "reuse" serves it from a cached state when there is one
# (and keeps a long state by its own pass: prefill, store, suffix); "plain" always runs SemIf's plain
# forward and never touches the cache (parity runs against upstream's predictions).
DirectPath = Literal["reuse", "plain"]
DIRECT_PATHS: tuple[DirectPath, ...] = ("reuse", "plain")
PREFILL_KINDS = ("fresh", "extended", "cached")  # a request's `prefill`: the costliest of its groups'
Results = dict[Hashable, list["ScoredRow"]]


@dataclass(frozen=True)
class EngineOptions:
    """How an engine runs over its weights; changed with `dataclasses.replace` (`with_options`).

    `headroom_bytes` (bytes between the warm baseline and the cap; None where the device has
    no cap or splitting is off) decides when a shared batch is split across forwards.
    `cache` keeps prefilled states for reuse; `prefill_chunk_tokens` bounds one prefill
    forward (None: the whole prefix at once); `direct_path` says how lone rows run."""

    memory: DeviceMemory
    headroom_bytes: int | None = None
    cache: StateCache = field(default_factory=lambda: StateCache(0))
    prefill_chunk_tokens: int | None = None
    direct_path: DirectPath = "reuse"
    keep_state_tokens: int = KEEP_STATE_TOKENS  # a lone row's state this long is kept by its own pass
    threads: ThreadPolicy = field(default_factory=ThreadPolicy.of_machine)  # a CPU's threads per forward

    def __post_init__(self) -> None:
        if self.direct_path not in DIRECT_PATHS:
            raise ValueError(f"direct_path must be one of {DIRECT_PATHS}")


@dataclass(frozen=True)
class RowReadout:
    """SemIf's readout of one row."""

    option_logits: list[float]
    probabilities: list[float]
    input_tokens: int
    prompt_sha256: str
    hidden: Any = None  # the last hidden state (float32), for rows that read it (lev's head)


@dataclass(frozen=True)
class Readout:
    """The readouts of a batch of rows, in order, and how they were computed: `timing` is the
    shared path's batch, or (`shared` False) how a lone row ran (`prefill` says whether it ran
    over a state)."""

    rows: list[RowReadout]
    shared: bool
    forward_seconds: float
    total_seconds: float
    timing: BatchTiming
    wait: EngineWait = EngineWait()  # set by the worker: the request's wait for the engine


@dataclass(frozen=True)
class PreparedRows:
    """One request's rows, encoded and checked, ready to join a group of requests.

    `prefix` is what its rows share (prefilled once, or found in the state cache; empty on
    the direct path); its first `state_tokens` are the question-independent state prefix.
    """

    prompts: list[EncodedPrompt]
    n_options: list[int]
    prefix: list[int]
    state_tokens: int
    direct: bool
    encode_seconds: float
    state_ids: tuple[int, ...] = ()  # the question-independent state prefix (a lone row's state)
    demand_key: str | None = None  # the raw state's digest (`state_digest`), set by the worker
    images: ImageSet | None = None  # the images its rows show (None: text only)
    model: int = BASE  # the adapter its rows read (`AdapterBank` index; BASE: the base)
    # Per row, the token ids whose logits a method of its own reads (lev's label codes), raw;
    # None: SemIf's answer slots, read as `read_slots` does.
    columns: tuple[tuple[int, ...], ...] | None = None
    hidden: bool = False  # its rows read their last hidden states (float32), no logits

    def job(self, job_id: Hashable) -> Job[PreparedRows]:
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

    suffix_forward_seconds: float
    width: int  # the widest suffix of the group (rows are padded to it)
    prefix_tokens: int = 0
    prefill: str = "none"  # "fresh", "extended", "cached" or "none"
    prefill_seconds: float = 0.0
    replicate_seconds: float = 0.0
    requests: int = 1
    rows: int = 1
    forwards: int = 1
    direct: bool = False  # SemIf's plain forward of one lone row


@dataclass(frozen=True)
class ScoredRow:
    """One row's slot logits and probabilities, and the group run that computed it."""

    option_logits: list[float]
    probabilities: list[float]
    run: GroupRun
    hidden: Any = None  # the row's last hidden state, where it reads that


class TorchEngine:
    """A loaded model and tokenizer that reads rows under its `options`; owned by one worker
    thread."""

    def __init__(
        self,
        model: Any,
        codec: PromptCodec,
        identity: ModelIdentity,
        options: EngineOptions,
        vision: VisionTower | None = None,
        adapters: AdapterBank | None = None,
    ) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.codec = codec
        self.identity = identity
        self.options = options
        self.vision = vision
        self.adapters = adapters if adapters is not None else AdapterBank(model)
        chunk = options.prefill_chunk_tokens
        # One engine step of the vision tower costs at most what one prefill chunk costs.
        self.tower_step_flops = text_chunk_flops(model, chunk) if vision is not None and chunk else None
        self.device = torch.device(identity.device)
        self.slot_ids = torch.tensor(codec.slots, device=self.device)
        self.estimate = MemoryEstimate(model.config, torch.tensor([], dtype=model.dtype).element_size())
        tokenizer = codec.tokenizer
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self.model_info = identity.as_dict()
        self.stepped = SteppedPrefill(self.cache, self.estimate, self.memory, chunk, self._prefill)
        self.lone = LoneRowPolicy(self.cache, options.keep_state_tokens)
        # On a CPU every forward sets its intra-op threads from its size (a GPU's forward runs on the device).
        self.threads = EngineThreads(options.threads, torch) if self.device.type == "cpu" else None

    @classmethod
    def over(cls, loaded: LoadedModel, adapters: AdapterBank | None = None) -> TorchEngine:
        """An engine over a loaded checkpoint and the adapters served over it (none: the base
        alone; no state cache until startup gives it one)."""
        options = EngineOptions(loaded.memory)
        return cls(loaded.model, loaded.codec, loaded.identity, options, loaded.vision, adapters)

    def with_options(self, **changes: Any) -> TorchEngine:
        """A new engine over the same weights, codec and tower, its options changed as given
        (`dataclasses.replace`); its stepped prefills start empty."""
        options = replace(self.options, **changes)
        return TorchEngine(self.model, self.codec, self.identity, options, self.vision, self.adapters)

    def with_adapters(self, adapters: AdapterBank) -> TorchEngine:
        """A new engine over the same weights, options and tower that serves `adapters`."""
        return TorchEngine(self.model, self.codec, self.identity, self.options, self.vision, adapters)

    @property
    def memory(self) -> DeviceMemory:
        return self.options.memory

    @property
    def cache(self) -> StateCache:
        return self.options.cache

    @property
    def headroom_bytes(self) -> int | None:
        return self.options.headroom_bytes

    @property
    def prefill_chunk_tokens(self) -> int | None:
        return self.options.prefill_chunk_tokens

    @property
    def direct_path(self) -> DirectPath:
        return self.options.direct_path

    @property
    def capacity(self) -> int:
        """How many answer codes the loaded tokenizer can read (System One's option cap)."""
        return self.codec.capacity

    @property
    def reads_images(self) -> bool:
        """Whether the loaded model has a vision tower (requests may show it images)."""
        return self.vision is not None

    def model_index(self, name: str | None) -> int:
        """The adapter bank's index of the model `name` (None: the base)."""
        return BASE if name is None else self.adapters.index(name)

    # -- reading ------------------------------------------------------------------------------

    def score(self, state: Any, rows: Sequence[PromptRow], **limits: Any) -> Readout:
        """`read` of rows given one by one, with `RowsRequest.of`'s keywords (warm-up, tests and
        benches; the worker sends a request)."""
        return self.read(RowsRequest.of(state, rows, **limits))

    def read(self, request: RowsRequest) -> Readout:
        """Read one request's rows alone. `shared=False` with one row runs SemIf's plain
        forward; otherwise the state prefix is prefilled once (or found in the state cache)
        and the rows run in right-padded batches (split where the memory headroom says one
        batch would not fit).

        Raises TooManyTokens, AnswerBoundary or TooLargeForMemory with `row` set to the
        position of the row concerned.
        """
        return self.read_prepared(self.prepare(request))

    def read_prepared(self, prepared: PreparedRows) -> Readout:
        """Read prepared rows alone on this thread (as one group, every step run in turn)."""
        job = prepared.job(0)
        group = Group(job.prefix_key, job.prefix_tokens, (_whole(job),))
        while isinstance(scored := self.run_group(group), Unfinished):
            pass
        return self.readout(prepared, scored[0])

    def prepare(self, request: RowsRequest) -> PreparedRows:
        """Encode (the state once) and check one request's rows and find what they share; refuses
        (TooManyTokens, for a row or past `max_request_tokens` for the request; AnswerBoundary,
        TooLargeForMemory; with `row` set) before anything runs.

        The request's images (each with its placeholder): every placeholder becomes its
        image's tokens, and the pixels of images whose state is not cached are decoded here
        (off the engine thread). They need a model that reads images (`reads_images`), which
        the door checks first; an image too large for the tower's memory is refused here."""
        started = time.perf_counter()
        state, rows, limits = request.state, request.rows, request.limits
        model = self.model_index(request.model)
        image_set = None
        codec = self.codec
        if request.images:
            if self.vision is None:
                raise ValueError("images for a model without a vision tower")
            image_set = self.vision.prepare(request.images)
            self._tower_fits(image_set)
            codec = codec.with_images(image_set.spans)
        prompts = codec.encode_prompts(state, rows, limits.max_input_tokens, limits.max_request_tokens)
        direct = not request.shared and len(rows) == 1
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
            width = len(prompts[widest].ids) - len(prefix)
            self.estimate.check_row(
                self.headroom_bytes, len(prefix), width, self.prefill_chunk_tokens, widest
            )
        if image_set is not None:
            image_set.preprocess(self._uncached_images(image_set, prefix or list(state_ids), prompts, model))
        return PreparedRows(
            prompts=prompts,
            n_options=[len(row.descriptions) for row in rows],
            prefix=prefix,
            state_tokens=state_tokens,
            direct=direct,
            encode_seconds=time.perf_counter() - started,
            state_ids=state_ids,
            images=image_set,
            model=model,
        )

    def run_group(self, group: Group[PreparedRows]) -> Results | Unfinished:
        """Score one planned group on this thread; the results of each job's rows in the
        group, in order. Lone rows (no shared prefix) go through `_run_direct`, which serves
        them from a state where one is cached or wanted by several requests; everything else
        through `_run_planned`. An image whose tower costs more than a prefill chunk first goes
        through the tower one step per call (`_tower_step`), each returning UNFINISHED."""
        self._threads_for(self._tokens_to_compute(group))
        if self._tower_step(group):
            return UNFINISHED
        if group.prefix_key is None and self.direct_path == "reuse" and group.parts[0].job.payload.direct:
            return self._run_direct(group)
        return self._run_planned(group)

    def _tokens_to_compute(self, group: Group[PreparedRows]) -> int:
        """About the tokens this group's forwards compute: each state unless it is cached as it is
        (a hash lookup that counts nothing and moves nothing), and every row after its state."""
        tokens = 0
        for prepared in {id(p.job.payload): p.job.payload for p in group.parts}.values():
            state = prepared.prefix or prepared.state_ids
            if state and not self.cache.has(state, model=prepared.model):
                tokens += len(state)
            tokens += sum(len(p.ids) - len(state) for p in prepared.prompts)
        return tokens

    def _threads_for(self, tokens: int) -> None:
        """The intra-op threads of the forwards that compute `tokens` tokens (`engine.threads`)."""
        if self.threads is not None:
            self.threads.use(tokens)

    def _tower_step(self, group: Group[PreparedRows]) -> bool:
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
            cached = self.cache.longest_prefix(state, prepared.model) if state else None
            yield state[len(cached) if cached is not None else 0 :]
            yield from (p.ids[len(state) :] for p in prepared.prompts)

    def _run_planned(self, group: Group[PreparedRows]) -> Results | Unfinished:
        """Score one planned group on this thread: one state (cached or prefilled once) for
        every part, the rows in right-padded forwards split by the memory headroom; the
        results of each job's rows in the group, in order. A lone direct row runs SemIf's
        plain forward; direct rows merged with others run right-padded with no state.

        A state longer than one prefill step is prefilled a step at a time (`SteppedPrefill`):
        this call prefills one step, keeps it in the state cache and returns UNFINISHED, so the
        batcher can run other requests' groups before the next step (the cache must be on)."""
        # Rows of one model side by side: each adapter reads a contiguous run of the batch.
        parts = sorted(group.parts, key=lambda p: p.job.payload.model)
        images = ImageSet.union([p.job.payload.images for p in parts])
        if len(parts) == 1 and parts[0].job.payload.direct:
            return {parts[0].job.id: [self._plain(parts[0].job.payload, images)]}
        first = parts[0].job.payload
        prefix = first.prefix if group.prefix_key is not None else []
        models = sorted({p.job.payload.model for p in parts})
        if any(self.stepped.step(prefix, first.state_tokens, images, m, (group.job_ids, m)) for m in models):
            return UNFINISHED
        states = {m: self._state(prefix, first.state_tokens, images, m) for m in models}
        hows = {how for _, how, _ in states.values()}
        how = next((k for k in PREFILL_KINDS if k in hows), "none")
        prefill_seconds = sum(seconds for _, _, seconds in states.values())
        rows = [
            (p.job.payload.prompts[i].ids[len(prefix) :], p.job.payload.n_options[i], p.job.payload.model)
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
                row_models = [m for _, _, m in batch]
                t0 = time.perf_counter()
                cache = _fork({m: stored for m, (stored, _, _) in states.items()}, row_models)
                self.memory.synchronize()
                t1 = time.perf_counter()
                suffixes = [s for s, _, _ in batch]
                any_hidden = any(hidden_rows[start : start + len(batch)])
                with self.adapters.rows(row_models):
                    last = logits_over(
                        self.model,
                        cache,
                        len(prefix),
                        suffixes,
                        self.pad_id,
                        chunk,
                        images,
                        prefix,
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
        ids = [int(t) for t in self.codec.slots] if any(r is None for r in reads) else []
        at = {t: i for i, t in enumerate(ids)}
        for own in reads:
            for token in own or ():
                if token not in at:
                    at[token] = len(ids)
                    ids.append(token)
        return self.torch.tensor(ids, device=self.device), at

    def prepare_ids(
        self,
        prefix: list[int],
        suffixes: Sequence[Sequence[int]],
        columns: Sequence[Sequence[int]] | None,
        model: int = BASE,
        encode_seconds: float = 0.0,
    ) -> PreparedRows:
        """A method's own rows (lev's: its ids rendered and encoded by the method) as a job of
        the batcher: each row `prefix + suffixes[i]`, read at `columns[i]` (raw logits), or
        (`columns` None) its last hidden state in float32. Rows over one prefix when it is worth
        it (`shares_prefix`: long enough to keep, or a prefill that pays), else each row whole;
        the state cache keys the prefix under `model`."""
        width = max(len(s) for s in suffixes)
        shared = bool(prefix) and self.shares_prefix(prefix, model, len(suffixes), width)
        whole = [[*prefix, *suffix] for suffix in suffixes]
        prompts = [EncodedPrompt("", ids, prefix_digest(ids), 0) for ids in whole]
        if shared:
            widest = max(range(len(whole)), key=lambda i: len(whole[i]))
            self.estimate.check_row(
                self.headroom_bytes, len(prefix), width, self.prefill_chunk_tokens, widest
            )
        return PreparedRows(
            prompts=prompts,
            n_options=[len(c) for c in columns] if columns is not None else [0] * len(suffixes),
            prefix=list(prefix) if shared else [],
            state_tokens=len(prefix) if shared else 0,
            direct=False,
            encode_seconds=encode_seconds,
            model=model,
            columns=tuple(tuple(int(t) for t in c) for c in columns) if columns is not None else None,
            hidden=columns is None,
        )

    def shares_prefix(self, prefix: Sequence[int], model: int, rows: int, width: int) -> bool:
        """Whether `rows` rows (suffixes up to `width` tokens) run over one state of `prefix`
        under `model` rather than each whole: a prefix worth keeping (`keep_state_tokens`), or
        one whose prefill pays (`prefill_pays`, counting what the cache already holds)."""
        if len(prefix) >= self.options.keep_state_tokens:
            return True
        to_prefill = len(prefix) - len(self.cache.longest_prefix(prefix, model) or ())
        return prefill_pays(len(prefix), to_prefill, rows, width)

    def _plain(self, prepared: PreparedRows, images: ImageSet | None) -> ScoredRow:
        """SemIf's plain forward of a lone row's whole prompt."""
        ids = prepared.prompts[0].ids
        t0 = time.perf_counter()
        with self.adapters.rows(prepared.model):
            last = plain_logits(
                self.model, ids, self.pad_id, self.device, self.prefill_chunk_tokens, images, self.slot_ids
            )
        with self.torch.inference_mode():
            logits, probs = read_slots(last, prepared.n_options[0])
        self.memory.synchronize()
        run = GroupRun(suffix_forward_seconds=time.perf_counter() - t0, width=len(ids), direct=True)
        return ScoredRow(logits, probs, run)

    def readout(self, prepared: PreparedRows, scored: Sequence[ScoredRow]) -> Readout:
        """One request's readouts and timing from its scored rows (which may span several groups)."""
        runs = list({id(r.run): r.run for r in scored}.values())
        readouts = [
            RowReadout(row.option_logits, row.probabilities, len(p.ids), p.sha256, row.hidden)
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
        # A lone row gets SemIf's direct readout whichever way it ran; its timing says how.
        return Readout(readouts, not prepared.direct, forward_seconds, total, timing)

    def _run_direct(self, group: Group[PreparedRows]) -> Results | Unfinished:
        """Lone rows (each request one row, no orderings), grouped by their state prefix.

        A state the lone-row policy says to use (cached, wanted by several, long enough to keep)
        is used: prefilled once by this pass and stored, each row then costs its suffix, and a
        follow-up sent at once finds it. Every other (short) state's row runs as SemIf's plain
        forward of its whole prompt (several right-padded together), and nothing is kept or
        queued for later. Either way a row equals the plain forward within 1e-5 (float32) and
        keeps its `prompt_sha256` and `input_tokens`. Every state takes its turn in each call (a
        prefill step, or a wait for the prefills ahead of it); while any is unfinished the rows
        that are done go back at once (`Unfinished.done`) and the rest run again next turn.
        """
        by_state: dict[tuple[tuple[int, ...], int], list[Part[PreparedRows]]] = {}
        for part in group.parts:
            by_state.setdefault((part.job.payload.state_ids, part.job.payload.model), []).append(part)
        results: Results = {}
        plain: list[Part[PreparedRows]] = []
        stepping = False
        for (ids, model), parts in by_state.items():
            if ids and self.lone.reuses(ids, [p.job.payload.demand_key for p in parts], model):
                over = self._run_planned(_over_state(ids, parts))
                if isinstance(over, Unfinished):
                    stepping = True  # its prefill's step ran, or it waits its turn: again next turn
                    continue
                results.update(over)
            else:
                plain.extend(parts)
        if len(plain) == 1:
            results.update(self._expect_done(self._run_planned(Group(None, 0, tuple(plain)))))
        elif plain:
            results.update(
                self._expect_done(self._run_planned(Group(None, 0, tuple(_as_rows(p) for p in plain))))
            )
        if stepping:
            return Unfinished(results) if results else UNFINISHED
        return results

    @staticmethod
    def _expect_done(results: Results | Unfinished) -> Results:
        """The results of a group without a state, which never runs in steps."""
        if isinstance(results, Unfinished):
            raise RuntimeError("a group without a state ran in steps")
        return results

    def _state(
        self, prefix: list[int], state_tokens: int, images: ImageSet | None = None, model: int = BASE
    ) -> tuple[StoredState | None, str, float]:
        """The state over exactly `prefix` under `model`: from the cache, extended from a cached
        shorter one of the same model, or prefilled (in chunks). A prefix longer than the state
        prefix (it covers a question) starts from the state prefix, looked up (and stored when
        fresh) on its own, so that the next question about the same state extends it; the
        longer prefix itself goes in the cache's lower `question` tier, which never evicts a
        state."""
        if not prefix:
            return None, "none", 0.0
        kind = QUESTION if len(prefix) > state_tokens else STATE
        stored = self.cache.get(prefix, kind, model)
        if stored is not None:
            return stored, "cached", 0.0
        t0 = time.perf_counter()
        stepped = self.stepped.take(prefix, model)  # prefilled in steps: still fresh
        superseded: StoredState | None = None
        if kind == QUESTION and state_tokens > 0:
            start = self.cache.get(prefix[:state_tokens], STATE, model)
            how = "extended" if start is not None and stepped is None else "fresh"
            if start is None:
                state = prefix[:state_tokens]
                superseded = self.cache.longest_prefix(state, model)
                start = self._prefill(state, superseded, STATE, images, model)
        else:
            start = self.cache.longest_prefix(prefix, model)
            how = "extended" if start is not None and stepped is None else "fresh"
        if stepped is not None:  # continue from the last step's slice where it is the longer start
            longer = self.cache.longest_prefix(prefix, model)
            if longer is not None and (start is None or len(longer) > len(start)):
                superseded, start = start, longer
        stored = self._prefill(prefix, start, kind, images, model)
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
        model: int = BASE,
        drop_start: bool = False,
    ) -> StoredState:
        """Prefill `ids` from `start` and store it in tier `kind` (`drop_start`: `start` is a
        superseded slice, dropped before the store so it costs no eviction)."""
        with self.adapters.rows(model):
            chunk = self.prefill_chunk_tokens
            cache = prefill(self.model, ids, start=start, chunk_tokens=chunk, images=images)
        if drop_start and start is not None:
            self.cache.discard(start.ids, start.model)
        return self.cache.put(ids, cache, kind, model)

    def _uncached_images(
        self, images: ImageSet, prefix: Sequence[int], prompts: Sequence[EncodedPrompt], model: int
    ) -> set[tuple[int, ...]]:
        """The images a forward may need features for: every one, unless a state over `prefix`
        is cached under `model` (then only those after it). The cache may still drop the state
        before the rows run; the images are then preprocessed on the engine thread."""
        after = len(prefix) if prefix and self.cache.has(prefix, model=model) else 0
        return images.shown_in(p.ids[after:] for p in prompts)

    def _tower_fits(self, images: ImageSet) -> None:
        """Refuse images whose largest needs more memory in the tower than the headroom has."""
        if self.headroom_bytes is None or self.vision is None:
            return
        patches = self.vision.patches(list(images.images.values()))
        self.estimate.check_tower(
            self.headroom_bytes, self.vision.activation_bytes(patches, self.estimate), patches
        )


def _timing_of(run: GroupRun, row_tokens: Sequence[int]) -> BatchTiming:
    """The timing block of one request's rows that ran alone as `run` (`row_tokens`: each row's
    tokens after the prefix run, the whole row when none was)."""
    return BatchTiming(
        prefix_tokens=run.prefix_tokens,
        prefill_seconds=run.prefill_seconds,
        replicate_seconds=run.replicate_seconds,
        suffix_forward_seconds=run.suffix_forward_seconds,
        batch_size=run.rows,
        true_suffix_tokens=sum(row_tokens),
        padded_suffix_tokens=run.rows * run.width,
        forward_batches=run.forwards,
        prefill=run.prefill,
    )


def _fork(states: dict[int, StoredState | None], row_models: Sequence[int]) -> Any:
    """A consumable cache for a forward's rows (sorted by model): each row over its model's state
    (None: no state); rows of several models stack their states (`stacked_fork`)."""
    runs: list[tuple[int, int]] = []
    for model in row_models:
        if runs and runs[-1][0] == model:
            runs[-1] = (model, runs[-1][1] + 1)
        else:
            runs.append((model, 1))
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


def _whole(job: Job[PreparedRows]) -> Part[PreparedRows]:
    return Part(job, 0, len(job.row_tokens))


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


def _as_rows(part: Part[PreparedRows]) -> Part[PreparedRows]:
    """A lone row as a row of a right-padded forward without a state."""
    prepared = part.job.payload
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
