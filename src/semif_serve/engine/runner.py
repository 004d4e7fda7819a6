"""The engine: scores rows (one question + ordered options) over a state with a loaded model.

A row's score is SemIf's readout: the logits of the answer slots at the last prompt position,
in float32 (the output head computes those rows only, `forwards.head_logits`). Rows that share
a state run through one path: the state prefix's cache comes from the state cache or is
prefilled once (in chunks), is forked over the rows, every suffix runs in one right-padded
forward and each row is read at its last real position.

Scoring is split so that the worker can merge requests: `prepare` (encode and check one
request, off the engine thread), `run_group` (one planned group of requests' rows, on the
engine thread) and `readout` (one request's `Readout` from its scored rows). `read` runs
the three for one request alone. The rooms around it: the forwards (`forwards`), the stepped
prefill (`stepped`), the lone-row policy (`lone`), lev's prefix rule (`sharing`), the headroom
checks (`memory.MemoryEstimate`), the state cache (`state_cache`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from semif_serve.domain.prompt import EncodedPrompt, PromptCodec
from semif_serve.domain.requests import BASE, RowsRequest
from semif_serve.engine.adapters import AdapterBank
from semif_serve.engine.batching import UNFINISHED, Group, Job, Part, Unfinished
from semif_serve.engine.group_runs import GroupRunner
from semif_serve.engine.lanes import ForwardLanes
from semif_serve.engine.loader import LoadedModel, ModelIdentity
from semif_serve.engine.memory import DeviceMemory, MemoryEstimate
from semif_serve.engine.options import DIRECT_PATHS, DirectPath, EngineOptions
from semif_serve.engine.packed_runs import PackedRunner
from semif_serve.engine.rows import PreparedRows, Readout, Results, ScoredRow, preamble_of, readout_of
from semif_serve.engine.sharing import prefill_pays
from semif_serve.engine.state_cache import StateCache, prefix_digest
from semif_serve.engine.threads import EngineThreads
from semif_serve.engine.tower_steps import text_chunk_flops
from semif_serve.engine.vision import ImageSet, VisionTower

__all__ = ["DIRECT_PATHS", "DirectPath", "EngineOptions", "TorchEngine"]

log = logging.getLogger("semif_serve.engine")

DIRECT_READOUT = "native full-vocabulary last-position logits restricted to declared answer slots"
SHARED_READOUT = "native selected suffix-position logits"
SHARED_SERVING_CONFIG = "native-state-prefix-parallel-v1"


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
        self.groups = GroupRunner(model, self.adapters, options, self.estimate, self.slot_ids, self.pad_id)
        self.stepped, self.lone = self.groups.stepped, self.groups.lone
        # Lanes on a CPU only: a GPU's forward runs on the device, however many threads feed it.
        lanes = options.forward_lanes if self.device.type == "cpu" else 1
        self.packed = PackedRunner(self.groups, ForwardLanes(lanes))
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

    # -- reading ------------------------------------------------------------------------------

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
        adapter = request.adapter
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
            over = prefix or list(state_ids)
            image_set.preprocess(self._uncached_images(image_set, over, prompts, adapter))
        preamble = self.codec.preamble if not direct or self.direct_path == "reuse" else ()
        return PreparedRows(
            prompts=prompts,
            n_options=[len(row.descriptions) for row in rows],
            prefix=prefix,
            state_tokens=state_tokens,
            direct=direct,
            encode_seconds=time.perf_counter() - started,
            state_ids=state_ids,
            images=image_set,
            adapter=adapter,
            preamble=preamble_of(preamble, [p.ids for p in prompts]),
        )

    def readout(self, prepared: PreparedRows, scored: Sequence[ScoredRow]) -> Readout:
        """One request's readouts and timing from its scored rows (`rows.readout_of`)."""
        return readout_of(prepared, scored)

    def run_group(self, group: Group[PreparedRows]) -> Results | Unfinished:
        """Score one planned group on this thread (`run_groups` of it alone)."""
        return self.run_groups([group])[0]

    def run_groups(self, groups: Sequence[Group[PreparedRows]]) -> list[Results | Unfinished]:
        """Score the groups of one engine turn on this thread, in one packed forward
        (`PackedRunner`); for each group the results of each job's rows in it, in order, or
        UNFINISHED (a prefill step or a step of the vision tower ran; it runs again next turn).
        An image whose tower costs more than a prefill chunk first goes through the tower one step
        per turn (`_tower_step`)."""
        self._threads_for(sum(self._tokens_to_compute(g) for g in groups))
        outcomes: list[Results | Unfinished] = [UNFINISHED] * len(groups)
        ready = [n for n, g in enumerate(groups) if not self._tower_step(g)]
        packed = self.packed.run([groups[n] for n in ready], self.direct_path == "reuse")
        for n, outcome in zip(ready, packed, strict=True):
            outcomes[n] = outcome
        return outcomes

    def forward_cost(self, group: Group[PreparedRows]) -> int:
        """The tokens a forward computes for this group (the batcher's budget counts them)."""
        return self._tokens_to_compute(group)

    def _tokens_to_compute(self, group: Group[PreparedRows]) -> int:
        """About the tokens this group's forwards compute: each state unless it is cached as it is
        (a hash lookup that counts nothing and moves nothing), and each of the group's rows after
        its state (a part's rows only: a request cut over several groups counts once in all). A
        group's shared state is computed once per adapter however many requests ask about it."""
        tokens = 0
        counted: set[Hashable] = set()
        for part in group.parts:
            prepared = part.job.payload
            state = prepared.prefix or prepared.state_ids
            key = (group.prefix_key, prepared.adapter) if group.prefix_key is not None else id(prepared)
            if state and key not in counted and not self.cache.has(state, adapter=prepared.adapter):
                tokens += len(state)
            counted.add(key)
            tokens += sum(len(prepared.prompts[i].ids) - len(state) for i in range(part.start, part.stop))
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
            cached = self.cache.longest_prefix(state, prepared.adapter) if state else None
            yield state[len(cached) if cached is not None else 0 :]
            yield from (p.ids[len(state) :] for p in prepared.prompts)

    def prepare_ids(
        self,
        prefix: list[int],
        suffixes: Sequence[Sequence[int]],
        columns: Sequence[Sequence[int]] | None,
        adapter: int = BASE,
        encode_seconds: float = 0.0,
        preamble: tuple[int, ...] = (),
    ) -> PreparedRows:
        """A method's own rows (lev's: its ids rendered and encoded by the method) as a job of
        the batcher: each row `prefix + suffixes[i]`, read at `columns[i]` (raw logits), or
        (`columns` None) its last hidden state in float32. Rows over one prefix when it is worth
        it (`shares_prefix`: long enough to keep, or a prefill that pays), else each row whole;
        the state cache keys the prefix under `adapter` (the adapter bank's index its rows read).
        `preamble`: the ids every prompt of the method starts with (set where `prefix` does)."""
        width = max(len(s) for s in suffixes)
        shared = bool(prefix) and self.shares_prefix(prefix, adapter, len(suffixes), width)
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
            adapter=adapter,
            columns=tuple(tuple(int(t) for t in c) for c in columns) if columns is not None else None,
            hidden=columns is None,
            preamble=preamble_of(preamble, [prefix]),
        )

    def shares_prefix(self, prefix: Sequence[int], adapter: int, rows: int, width: int) -> bool:
        """Whether `rows` rows (suffixes up to `width` tokens) run over one state of `prefix`
        under `adapter` rather than each whole: a prefix worth keeping (`keep_state_tokens`), or
        one whose prefill pays (`prefill_pays`, counting what the cache already holds)."""
        if len(prefix) >= self.options.keep_state_tokens:
            return True
        to_prefill = len(prefix) - len(self.cache.longest_prefix(prefix, adapter) or ())
        return prefill_pays(len(prefix), to_prefill, rows, width)

    def _uncached_images(
        self, images: ImageSet, prefix: Sequence[int], prompts: Sequence[EncodedPrompt], adapter: int
    ) -> set[tuple[int, ...]]:
        """The images a forward may need features for: every one, unless a state over `prefix`
        is cached under `adapter` (then only those after it). The cache may still drop the state
        before the rows run; the images are then preprocessed on the engine thread."""
        after = len(prefix) if prefix and self.cache.has(prefix, adapter=adapter) else 0
        return images.shown_in(p.ids[after:] for p in prompts)

    def _tower_fits(self, images: ImageSet) -> None:
        """Refuse images whose largest needs more memory in the tower than the headroom has."""
        if self.headroom_bytes is None or self.vision is None:
            return
        patches = self.vision.patches(list(images.images.values()))
        self.estimate.check_tower(
            self.headroom_bytes, self.vision.activation_bytes(patches, self.estimate), patches
        )


def _whole(job: Job[PreparedRows]) -> Part[PreparedRows]:
    return Part(job, 0, len(job.row_tokens))


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
