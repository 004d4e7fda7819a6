"""lev's method below its plug-in (`service.methods.lev`): a request rendered and encoded once,
its rows as the batcher's jobs, and its answers read as lev's server reads them.

`lev_rows` renders and encodes a request once (lev's prompt through the bounded encoder) and
checks it against the door's limits; `lev_jobs` makes its rows the batcher's jobs: the label rows
(Mode A) read their label codes' logits, the head's rows (Mode B) and their candidates read last
hidden states; all of them merge with whatever else is queued (the same bounds, stepped prefill,
state cache under the release's model, demand, forward counts), and `lev_answers` reads the
answers (the head over the hidden states, then lev's softmax, orders and calibration).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from semif_serve.domain.lev.prompt import candidate_texts, render_prefix
from semif_serve.domain.lev.readout import LevPlan, plan_request, read_plan
from semif_serve.domain.lev.types import LevAnswer, LevQuestion, ModeBUnavailable, PromptStyle
from semif_serve.domain.prompt import probed_opening
from semif_serve.domain.requests import Limits
from semif_serve.domain.tokens import BoundedEncoder, PastLimit
from semif_serve.domain.types import BatchTiming, TooManyRows, TooManyTokens
from semif_serve.engine.lev_head import candidate_ids, head_scores
from semif_serve.engine.lev_release import LevRelease

if TYPE_CHECKING:
    from semif_serve.engine.rows import PreparedRows, Readout
    from semif_serve.engine.runner import TorchEngine


@dataclass(frozen=True)
class LevReply:
    """One request's answers with one release, and lev's token counts."""

    answers: dict[str, LevAnswer]
    input_tokens: int  # the prefix once, plus every row's suffix and every Mode B candidate
    cached_input_tokens: int  # the prefix
    timing: BatchTiming  # how the engine ran the rows (their jobs' reads joined)


@dataclass(frozen=True)
class LevRows:
    """A request's plan, encoded once: lev's prefix ids (with special tokens), each row's suffix
    ids (without), as lev's server joins them, and each Mode B question's candidate ids."""

    plan: LevPlan
    prefix_ids: list[int]
    suffixes: list[list[int]]
    candidates: dict[str, list[list[int]]]
    # The ids every lev prefix of its style starts with (`LevEncoder.preamble`; the engine
    # checks that this one does).
    preamble: tuple[int, ...] = ()

    @property
    def forward_rows(self) -> int:
        """Every row the forwards read: each question in each of its orders, and every candidate."""
        return len(self.plan.rows) + sum(len(ids) for ids in self.candidates.values())

    @property
    def input_tokens(self) -> int:
        """lev's input tokens: the prefix once, every row's suffix and every candidate's ids."""
        shown = sum(len(one) for ids in self.candidates.values() for one in ids)
        return len(self.prefix_ids) + sum(len(s) for s in self.suffixes) + shown

    @property
    def label_rows(self) -> list[int]:
        """The rows read at their label codes (Mode A)."""
        return [i for i, row in enumerate(self.plan.rows) if row.label_ids is not None]

    @property
    def head_rows(self) -> list[int]:
        """The rows read by the candidate head (Mode B)."""
        return [i for i, row in enumerate(self.plan.rows) if row.label_ids is None]


class LevEncoder:
    """lev's ids of a text through the bounded encoder: `tokenizer.encode(text,
    add_special_tokens=...)`, stopping as soon as the text is proved past a limit. The special
    tokens the tokenizer wraps a text in are found once; a tokenizer that does more than wrap is
    encoded whole, after the bytes' lower bound."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.bounded = BoundedEncoder(tokenizer)
        self.wraps = self._wrapping(tokenizer)
        self._preambles: dict[PromptStyle, tuple[int, ...]] = {}

    def preamble(self, style: PromptStyle) -> tuple[int, ...]:
        """The ids every lev prefix of `style` starts with, whatever its state (the chat style's
        system turn and the user turn up to its evidence): the ids the probe states' prefixes all
        share, less the last (a token can merge across the cut). Computed once per style."""
        if style not in self._preambles:
            self._preambles[style] = probed_opening(
                lambda state: self.encode(render_prefix(state, style), None, True)
            )
        return self._preambles[style]

    @staticmethod
    def _wrapping(tokenizer: Any) -> tuple[list[int], list[int]] | None:
        probes = ("Context:\n{}", "x")
        lead = tail = None
        for text in probes:
            plain = tokenizer.encode(text, add_special_tokens=False)
            special = tokenizer.encode(text, add_special_tokens=True)
            n = len(special) - len(plain)
            for cut in range(n + 1):
                if special[cut : cut + len(plain)] == plain:
                    got = (special[:cut], special[cut + len(plain) :])
                    break
            else:
                return None
            if lead is not None and got != (lead, tail):
                return None
            lead, tail = got
        return lead or [], tail or []

    def encode(self, text: str, limit: int | None, special: bool) -> list[int]:
        """The ids; PastLimit once they are proved more than `limit`."""
        if not special:
            return self.bounded.encode(text, limit)
        if self.wraps is None:
            if limit is not None and self.bounded.at_least(text) > limit:
                raise PastLimit(self.bounded.at_least(text))
            ids = self.tokenizer.encode(text, add_special_tokens=True)
            if limit is not None and len(ids) > limit:
                raise PastLimit(len(ids))
            return ids
        lead, tail = self.wraps
        room = None if limit is None else limit - len(lead) - len(tail)
        try:
            return [*lead, *self.bounded.encode(text, room), *tail]
        except PastLimit as past:
            raise PastLimit(past.tokens + len(lead) + len(tail)) from None


def lev_rows(
    release: LevRelease,
    encoder: LevEncoder,
    state: Any,
    questions: Mapping[str, LevQuestion],
    limits: Limits | None,
) -> LevRows:
    """The request's plan and ids, refused before any forward: Mode B without a head or with a
    candidate that encodes to nothing (ModeBUnavailable), more rows than `limits.max_rows`
    (TooManyRows), a row's prompt over `max_input_tokens` or the request over
    `max_request_tokens` (TooManyTokens, as SemIf's rows are refused). Mode B's candidates are
    rows of their own: each counts against the row cap, the per-row limit and the budget."""
    plan = plan_request(state, questions, release.codes, release.options, has_head=release.head is not None)
    shown = {qid: candidate_texts(plan.questions[qid]) for qid, r in plan.routes.items() if r.mode == "B"}
    rows_needed = len(plan.rows) + sum(len(texts) for texts in shown.values())
    if limits is not None and rows_needed > limits.max_rows:
        raise TooManyRows(rows_needed, limits.max_rows)
    positions = {qid: i for i, qid in enumerate(questions)}
    input_limit = None if limits is None else limits.max_input_tokens
    budget = None if limits is None else limits.max_request_tokens
    first = positions[plan.rows[0].question_id] if plan.rows else 0
    try:
        prefix_ids = encoder.encode(plan.prefix, None if input_limit is None else input_limit - 1, True)
    except PastLimit as past:
        assert input_limit is not None
        raise TooManyTokens(past.tokens + 1, input_limit, first, at_least=True) from None
    suffixes: list[list[int]] = []
    total = len(prefix_ids)
    for counted, row in enumerate(plan.rows, start=1):
        room = None if input_limit is None else input_limit - len(prefix_ids)
        if budget is not None:
            room = min(room if room is not None else budget, budget - total)
        try:
            suffixes.append(encoder.encode(row.suffix, room, False))
        except PastLimit as past:
            assert input_limit is not None
            tokens = len(prefix_ids) + past.tokens
            if tokens <= input_limit and budget is not None:
                raise TooManyTokens.for_request(
                    total + past.tokens, budget, counted, len(plan.rows), at_least=True
                ) from None
            raise TooManyTokens(tokens, input_limit, positions[row.question_id], at_least=True) from None
        total += len(suffixes[-1])
    candidates: dict[str, list[list[int]]] = {}
    counted = len(plan.rows)
    for qid, texts in shown.items():
        ids = candidate_ids(release.tokenizer, texts)  # each cut at lev's 64 tokens
        if not all(ids):
            # The message names the question: a method's own refusal reads whole.
            raise ModeBUnavailable(
                f"question {qid!r}: a candidate encodes to no token, which lev's head cannot read"
            )
        longest = max(len(one) for one in ids)
        if input_limit is not None and longest > input_limit:
            raise TooManyTokens(longest, input_limit, positions[qid])
        counted += len(ids)
        total += sum(len(one) for one in ids)
        if budget is not None and total > budget:
            raise TooManyTokens.for_request(total, budget, counted, rows_needed)
        candidates[qid] = ids
    return LevRows(plan, prefix_ids, suffixes, candidates, encoder.preamble(release.options.prompt_style))


def lev_jobs(
    rows: LevRows, engine: TorchEngine, adapter: int, encode_seconds: float = 0.0
) -> list[Callable[[], PreparedRows]]:
    """The request's rows as the batcher's jobs under the bank's `adapter` (each made on an
    encoder thread): the label rows over lev's prefix, read at their codes; the head's rows over
    it, read as hidden states; every Mode B question's candidates as whole rows, read as hidden
    states."""
    prepare = functools.partial(engine.prepare_ids, adapter=adapter, encode_seconds=encode_seconds)
    over_prefix = functools.partial(prepare, preamble=rows.preamble)  # rows that start with lev's prefix
    plan = rows.plan
    jobs: list[Callable[[], PreparedRows]] = []
    if rows.label_rows:
        suffixes = [rows.suffixes[i] for i in rows.label_rows]
        reads = [plan.rows[i].label_ids or () for i in rows.label_rows]
        jobs.append(functools.partial(over_prefix, rows.prefix_ids, suffixes, reads))
    if rows.head_rows:
        jobs.append(
            functools.partial(over_prefix, rows.prefix_ids, [rows.suffixes[i] for i in rows.head_rows], None)
        )
        candidates = [ids for qid in rows.candidates for ids in rows.candidates[qid]]
        jobs.append(functools.partial(prepare, [], candidates, None))
    return jobs


def lev_answers(release: LevRelease, rows: LevRows, readouts: Sequence[Readout]) -> LevReply:
    """The request's answers from its jobs' readouts (in `lev_jobs`' order): label logits as they
    are, the head over each head row's state and its question's candidates' states."""
    plan = rows.plan
    scores: list[list[float]] = [[] for _ in plan.rows]
    reads = iter(readouts)
    if rows.label_rows:
        labels = next(reads)
        for k, i in enumerate(rows.label_rows):
            scores[i] = labels.rows[k].option_logits
    if rows.head_rows:
        import torch

        heads, shown = next(reads), next(reads)
        states, at = {}, 0
        for qid, ids in rows.candidates.items():
            states[qid] = torch.stack([r.hidden for r in shown.rows[at : at + len(ids)]])
            at += len(ids)
        for k, i in enumerate(rows.head_rows):
            scores[i] = head_scores(release.head, heads.rows[k].hidden, states[plan.rows[i].question_id])
    answers = read_plan(plan, scores, release.calibration)
    return LevReply(answers, rows.input_tokens, len(rows.prefix_ids), joined([r.timing for r in readouts]))


def joined(runs: Sequence[BatchTiming]) -> BatchTiming:
    """One request's timing from its jobs' reads: seconds, rows, tokens and forwards added up; the
    prefix and where it came from, of the read that ran over it."""
    over = [run for run in runs if run.prefill != "none"] or list(runs)
    return BatchTiming(
        prefix_tokens=max(run.prefix_tokens for run in runs),
        prefill_seconds=sum(run.prefill_seconds for run in runs),
        replicate_seconds=sum(run.replicate_seconds for run in runs),
        suffix_forward_seconds=sum(run.suffix_forward_seconds for run in runs),
        batch_size=sum(run.batch_size for run in runs),
        true_suffix_tokens=sum(run.true_suffix_tokens for run in runs),
        padded_suffix_tokens=sum(run.padded_suffix_tokens for run in runs),
        forward_batches=sum(run.forward_batches for run in runs),
        merged_requests=max(run.merged_requests for run in runs),
        prefill=over[0].prefill,
        prefill_shared=any(run.prefill_shared for run in runs),
    )
