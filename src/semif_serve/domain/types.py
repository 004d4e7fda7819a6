"""The decision domain: questions, the rows the engine reads, typed outcomes and domain errors.

Nothing here knows HTTP. Errors say which question and option they concern by position;
each door maps them to its own status, code and field path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Self

from semif_serve.domain.echo import quoted

Ordering = Literal["rotations", "all", "shifts", "reversal"]
#: Where a request's state came from: prefilled fresh, extended from a cached prefix, cached whole, or none.
Prefill = Literal["fresh", "extended", "cached", "none"]
#: How a question asked once runs: from a cached state (else the plain forward), or always the plain forward.
DirectPath = Literal["reuse", "plain"]
#: The state cache's tiers: whole states, and question prefixes over a state.
CacheKind = Literal["state", "question"]


@dataclass(frozen=True)
class Option:
    """One answer option: the caller's id and the description the model reads."""

    id: str
    description: str


@dataclass(frozen=True)
class Question:
    """A question over a state: its options, the orderings to ask them in, and its workload."""

    id: str
    text: str
    options: tuple[Option, ...]
    orderings: Ordering | None = None
    workload: str | None = None


@dataclass(frozen=True)
class PromptRow:
    """What the engine reads: one question with its option descriptions in the order asked."""

    question: str
    descriptions: tuple[str, ...]


# -- outcomes ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class OrderingReadout:
    """SemIf's native readout of one ordering: option ids in the order asked and their scores."""

    option_ids: tuple[str, ...]
    option_logits: list[float]
    probabilities: list[float]
    input_tokens: int
    prompt_sha256: str


@dataclass(frozen=True)
class Combined:
    """The answer combined over orderings (see orderings.combine)."""

    mode: str
    orderings: int
    probabilities: dict[str, float]
    top: str
    agreement: float
    spread: float


@dataclass(frozen=True)
class Calibrated:
    """A workload temperature applied to logits (the caller's order for combined answers)."""

    workload: str
    temperature: float
    temperature_mode: str
    probabilities: list[float]


@dataclass(frozen=True)
class QuestionOutcome:
    """One question's answer: the per-ordering readouts (the caller's order first), and where
    asked for, the combination over orderings and the calibrated probabilities."""

    question: Question
    readouts: tuple[OrderingReadout, ...]
    combined: Combined | None
    calibrated: Calibrated | None


@dataclass(frozen=True)
class BatchTiming:
    """How a shared-path batch was computed (absent on the direct path)."""

    prefix_tokens: int
    prefill_seconds: float
    replicate_seconds: float
    suffix_forward_seconds: float
    batch_size: int
    true_suffix_tokens: int
    padded_suffix_tokens: int
    forward_batches: int
    merged_requests: int = 1  # requests whose rows ran in the same forward(s), this one included
    prefill: str = "fresh"  # where the state came from: fresh, extended, cached or none
    prefill_shared: bool = False  # the state's prefill (or cache hit) served other requests too

    def as_dict(self) -> dict[str, Any]:
        """The timing block, keys in the documented order."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class EngineWait:
    """How long a call waited for the engine before its first forward (behind other requests'
    work: the engine runs nothing else)."""

    seconds: float = 0.0


@dataclass(frozen=True)
class DecisionOutcome:
    """Every question's outcome for one call, and how the batch ran."""

    questions: tuple[QuestionOutcome, ...]
    shared: bool
    forward_seconds: float
    total_seconds: float
    timing: BatchTiming  # how it ran: the shared path's batch, or the lone row (plain, or over a state)
    wait: EngineWait = EngineWait()  # the call's wait for the engine


# -- errors -----------------------------------------------------------------------------------


class DecisionError(Exception):
    """Why a decision call was not answered; `question`/`option` are positions where known, and
    `field` the request's field as the door named it, where the error names one itself."""

    field: str | None = None

    def __init__(self, message: str, question: int | None = None, option: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.question = question
        self.option = option
        self.row: int | None = None  # position in the engine's batch, until the core maps it to a question

    def located(
        self, *, question: int | None = None, option: int | None = None, row: int | None = None
    ) -> Self:
        """A copy of this error placed at `question`, `option` or `row` (the others kept); the
        original stays as it was built."""
        placed = type(self).__new__(type(self))
        placed.args = self.args
        placed.__dict__.update(self.__dict__)
        placed.__dict__.update(
            (name, value)
            for name, value in (("question", question), ("option", option), ("row", row))
            if value is not None
        )
        return placed


class Refusal(DecisionError):
    """The request itself cannot be answered as asked; nothing ran that needs releasing."""


class TooManyTokens(Refusal):
    """A prompt is longer than the per-call token limit (prompts are never truncated)."""

    def __init__(
        self, tokens: int, limit: int, question: int | None = None, *, at_least: bool = False
    ) -> None:
        need = (
            f"at least {tokens}" if at_least else str(tokens)
        )  # at_least: refused before it was all counted
        super().__init__(
            f"the prompt is {need} tokens, over the limit of {limit}; it is never truncated", question
        )
        self.tokens = tokens
        self.limit = limit

    @classmethod
    def for_request(
        cls, tokens: int, limit: int, counted: int, rows: int, *, at_least: bool = False
    ) -> TooManyTokens:
        """The request as a whole passes its token budget (counted up to row `counted` of `rows`;
        `at_least`: that row was not counted to its end)."""
        refusal = cls(tokens, limit)
        need = f"at least {tokens}" if counted < rows or at_least else str(tokens)
        refusal.message = (
            f"the request needs {need} tokens (the state once, plus every row's tokens after it; "
            f"{counted} of {rows} rows counted), over the per-request budget of {limit}; "
            "split it across requests"
        )
        refusal.args = (refusal.message,)
        return refusal


class AnswerBoundary(Refusal):
    """Appending an answer letter changes the prompt's tokenisation, so its logit is unreadable."""

    def __init__(self, letter: str, option: int, question: int | None = None) -> None:
        super().__init__(
            f"appending the answer {'letter' if len(letter) == 1 else 'code'} {letter!r} changes this "
            "prompt's tokenisation, so its logit cannot be read faithfully",
            question,
            option,
        )
        self.letter = letter


class TooLargeForMemory(Refusal):
    """Even one row of the call needs more memory than the cap leaves."""

    def __init__(
        self, need_bytes: int, available_bytes: int, question: int | None = None, *, row: int | None = None
    ) -> None:
        from semif_serve.domain.numerics import GIB

        super().__init__(
            f"one row of this request needs an estimated {need_bytes / GIB:.2f} GiB, more than the "
            f"{available_bytes / GIB:.2f} GiB the memory cap leaves; shorten the state",
            question,
        )
        self.need_bytes = need_bytes
        self.available_bytes = available_bytes
        self.row = row


class ImageTooLargeForMemory(TooLargeForMemory):
    """An image of the call needs more memory in the vision tower than the cap leaves."""

    def __init__(self, need_bytes: int, available_bytes: int, patches: int) -> None:
        from semif_serve.domain.numerics import GIB

        Refusal.__init__(
            self,
            f"an image of this request ({patches} patches after the processor's resize) needs an "
            f"estimated {need_bytes / GIB:.2f} GiB in the vision tower, more than the "
            f"{available_bytes / GIB:.2f} GiB the memory cap leaves; send a smaller image",
        )
        self.need_bytes = need_bytes
        self.available_bytes = available_bytes
        self.patches = patches


class UnknownWorkload(Refusal):
    """A question names a workload the calibration table does not hold."""

    def __init__(self, workload: str, known: list[str], question: int) -> None:
        names = ", ".join(known) or "none are configured"
        super().__init__(f"unknown workload {quoted(workload)}; known workloads: {names}", question)
        self.workload = workload
        self.known = known


class WorkloadOfAnotherModel(Refusal):
    """A question names a workload calibrated on another served model than the one reading it."""

    def __init__(self, workload: str, calibrated: str, reading: str, question: int) -> None:
        super().__init__(
            f"workload {quoted(workload)} is calibrated on model {calibrated!r}, and this request is read "
            f"by {reading!r}; ask that model (or name another workload)",
            question,
        )
        self.workload = workload
        self.calibrated = calibrated
        self.reading = reading


class TooManyRows(Refusal):
    """The call needs more rows (questions x orderings) than the limit."""

    def __init__(self, rows: int, limit: int) -> None:
        super().__init__(
            f"the request needs {rows} rows (decisions x orderings), over the limit of {limit}; "
            "split it across requests"
        )
        self.rows = rows
        self.limit = limit


class ReplyTooLarge(Refusal):
    """The reply would pass the reply budget (counted before it is built: every reading echoes
    every option's name, so names and orderings, not tokens, set its size)."""

    ORDERINGS = "ask fewer orderings or options, shorten the names, or split it across requests"

    def __init__(self, need_bytes: int, limit_bytes: int, remedy: str = ORDERINGS) -> None:
        super().__init__(
            f"the reply would need up to {need_bytes} bytes (every ordering's reading echoes every "
            f"option name or id), over the reply budget of {limit_bytes} bytes; {remedy}"
        )
        self.need_bytes = need_bytes
        self.limit_bytes = limit_bytes


class TooManyOptions(Refusal):
    """A question has more options than the answer alphabet has letters."""

    def __init__(self, options: int, limit: int, question: int | None = None) -> None:
        super().__init__(f"{options} options, over the limit of {limit}", question)
        self.options = options
        self.limit = limit


class Unanswerable(Refusal):
    """The model a request names cannot answer a question as it was asked (its method reads no
    such thing); refused, never approximated."""


class NotRead(Unanswerable):
    """A request sets something the method reading it does not read (images, a question type,
    a field): refused naming the field as the door calls it."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field: str | None = field


class OutOfMemory(DecisionError):
    """The device ran out of memory on this call; memory was released."""

    def __init__(self) -> None:
        super().__init__(
            "The request did not fit in the service's memory cap; memory was released. "
            "Split the decisions across smaller requests."
        )


class EngineFailure(DecisionError):
    """The engine failed unexpectedly; the service stays up."""

    def __init__(self) -> None:
        super().__init__("The service failed while answering this request.")


class ConfigurationError(Exception):
    """Invalid configuration; the message names the variable and never echoes secrets."""
