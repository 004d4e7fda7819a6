"""What the engine reads and returns: one request's prepared rows (`PreparedRows`, a job of the
batcher), a scored row and the group run that computed it, and one request's `Readout`."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from semif_serve.domain.prompt import EncodedPrompt
from semif_serve.domain.requests import BASE
from semif_serve.domain.types import BatchTiming, EngineWait
from semif_serve.engine.batching import Job
from semif_serve.engine.state_cache import prefix_digest
from semif_serve.engine.vision import ImageSet

PREFILL_KINDS = ("fresh", "extended", "cached")  # a request's `prefill`: the costliest of its groups'
Results = dict[Hashable, list["ScoredRow"]]


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
    adapter: int = BASE  # the adapter its rows read (`AdapterBank` index; BASE: the base)
    # Per row, the token ids whose logits a method of its own reads (lev's label codes), raw;
    # None: SemIf's answer slots, read as `read_slots` does.
    columns: tuple[tuple[int, ...], ...] | None = None
    hidden: bool = False  # its rows read their last hidden states (float32), no logits
    # The ids every prompt of its method starts with, which its prompts do (`PromptCodec.preamble`;
    # empty: none): a prompt computed from position 0 continues the preamble's stored state.
    preamble: tuple[int, ...] = ()

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
class RowsJob:
    """One call's rows for the worker: prepared on an encoder thread (`prepare`, which refuses
    before anything runs; the one image thread where `images`), over the state `demand_key`
    names (`state_cache.state_digest` with the model), so requests in flight for it are counted."""

    demand_key: str
    prepare: Callable[[], PreparedRows]
    images: bool = False


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
    forward_requests: int = 1  # requests whose rows ran in the same forward, this one included
    packed: bool = False  # its rows ran packed end to end (no padding)


@dataclass(frozen=True)
class ScoredRow:
    """One row's slot logits and probabilities, and the group run that computed it."""

    option_logits: list[float]
    probabilities: list[float]
    run: GroupRun
    hidden: Any = None  # the row's last hidden state, where it reads that


def preamble_of(preamble: tuple[int, ...], sequences: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """`preamble` where every one of `sequences` starts with it, else none: the ids a request's
    rows may continue from the preamble's stored state (`PreparedRows.preamble`)."""
    n = len(preamble)
    return preamble if all(tuple(ids[:n]) == preamble for ids in sequences) else ()


def _padded(run: GroupRun, prepared: PreparedRows, scored: Sequence[ScoredRow]) -> int:
    """The suffix tokens `run` computed for this request's rows: each row's own where it ran
    packed, else the group's widest for each row (right padding)."""
    n_prefix = len(prepared.prefix)
    mine = [len(p.ids) - n_prefix for p, row in zip(prepared.prompts, scored, strict=True) if row.run is run]
    return sum(mine) if run.packed else run.width * len(mine)


def readout_of(prepared: PreparedRows, scored: Sequence[ScoredRow]) -> Readout:
    """One request's readouts and timing from its scored rows (which may span several groups)."""
    runs = list({id(r.run): r.run for r in scored}.values())
    readouts = [
        RowReadout(row.option_logits, row.probabilities, len(p.ids), p.sha256, row.hidden)
        for row, p in zip(scored, prepared.prompts, strict=True)
    ]
    forward_seconds = sum(r.prefill_seconds + r.replicate_seconds + r.suffix_forward_seconds for r in runs)
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
        padded_suffix_tokens=sum(_padded(r, prepared, scored) for r in runs),
        forward_batches=sum(r.forwards for r in runs),
        merged_requests=max(max(r.requests, r.forward_requests) for r in runs),
        prefill=next((k for k in PREFILL_KINDS if k in prefills), "none"),
        prefill_shared=any(r.requests > 1 for r in runs) and n_prefix > 0,
    )
    # A lone row gets SemIf's direct readout whichever way it ran; its timing says how.
    return Readout(readouts, not prepared.direct, forward_seconds, total, timing)
