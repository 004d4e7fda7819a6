"""lev's label codes (`labels.py`) and its router (`router.py`): which codes are one token, and
whether a question reads its labels (Mode A) or the candidate head (Mode B), in which orders."""

from __future__ import annotations

import string
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import product

from semif_serve.domain.lev.release import LevOptions
from semif_serve.domain.lev.types import RATING_LEVELS, LevNoul, LevQuestion, LevScore, Mode, Order


def all_codes() -> Iterator[str]:
    """A..Z, then AA..ZZ, then AAA..ZZZ, in that order."""
    yield from string.ascii_uppercase
    for width in (2, 3):
        for letters in product(string.ascii_uppercase, repeat=width):
            yield "".join(letters)


CODE_COUNT = 26 + 26**2 + 26**3


@dataclass(frozen=True)
class LevCodes:
    """Which codes are one token with the style's prefix (`prefix + code`), and that token.

    `token_ids[i]` is the id of code i of `all_codes()`, or None where it encodes to more than
    one token. The engine fills it from the tokenizer once per (tokenizer, prefix).
    """

    prefix: str
    token_ids: tuple[int | None, ...]

    def __post_init__(self) -> None:
        if len(self.token_ids) != CODE_COUNT:
            raise ValueError(f"need one entry per code ({CODE_COUNT}), got {len(self.token_ids)}")

    def pick(self, n: int, skip_split: bool) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
        """n codes and their ids: the first n (all single tokens, else None), or with `skip_split`
        the first n single-token codes, passing over split ones (None if there are fewer)."""
        if n < 1 or n > CODE_COUNT:
            return None
        codes: list[str] = []
        ids: list[int] = []
        for code, token_id in zip(all_codes(), self.token_ids, strict=True):
            if token_id is None:
                if not skip_split:
                    return None
                continue
            codes.append(code)
            ids.append(token_id)
            if len(codes) == n:
                return tuple(codes), tuple(ids)
        return None

    @property
    def capacity(self) -> int:
        """How many options Mode A can letter with split codes skipped."""
        return sum(1 for t in self.token_ids if t is not None)


# -- routing (router.py) ------------------------------------------------------------------------


@dataclass(frozen=True)
class LevRoute:
    """Mode A (label codes) or Mode B (the candidate head) for one question, and why."""

    mode: Mode
    codes: tuple[str, ...] | None
    token_ids: tuple[int, ...] | None
    binary_noul: bool
    reason: str


def candidate_count(question: LevQuestion) -> int:
    """Options a question is read over: its criteria, or the nine rating levels of a noul."""
    if isinstance(question, LevNoul):
        return RATING_LEVELS
    return len(question.criteria)


def route(question: LevQuestion, codes: LevCodes, options: LevOptions) -> LevRoute:
    """lev's router: the label cap first, then a binary noul's two codes, a rating noul's nine
    (first codes, never skipped), a choice or score's codes (split ones skipped); else Mode B."""
    n = candidate_count(question)
    cap = options.max_label_options
    if cap is not None and n > cap:
        return LevRoute("B", None, None, False, f"{n} options over the label cap {cap}")
    if isinstance(question, LevNoul):
        if options.noul_readout == "binary":
            picked = codes.pick(2, skip_split=False)
            if picked is not None:
                return LevRoute("A", picked[0], picked[1], True, "binary yes/no")
        picked = codes.pick(n, skip_split=False)
        if picked is None:
            return LevRoute("B", None, None, False, "rating codes are not single tokens")
        return LevRoute("A", picked[0], picked[1], False, "rating scale")
    picked = codes.pick(n, skip_split=options.skip_multi_token_codes)
    if picked is None:
        return LevRoute("B", None, None, False, f"{n} options exceed the single-token codes")
    return LevRoute("A", picked[0], picked[1], False, f"{n} options fit single-token codes")


def question_orders(question: LevQuestion, chosen: LevRoute, options: LevOptions) -> tuple[Order, ...]:
    """The option orders lev reads a question in: choice and binary noul as given and reversed;
    score per `score_order_average`; a rating noul and Mode B once."""
    if not options.order_average or chosen.mode != "A":
        return (None,)
    n = len(chosen.codes or ())
    if n < 2:
        return (None,)
    reverse = tuple(reversed(range(n)))
    if isinstance(question, LevScore):
        if options.score_order_average == "reversal":
            return (None, reverse)
        if options.score_order_average == "rotations":
            return (None, *(tuple((j + r) % n for j in range(n)) for r in range(1, n)))
        return (None,)
    if isinstance(question, LevNoul) and not chosen.binary_noul:
        return (None,)
    return (None, reverse)
