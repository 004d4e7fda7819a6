"""The answer-code alphabet SemIf's spec describes: `A`-`Z`, then the two-letter codes that are one token.

Slots 1-26 are the letters `A`-`Z`; each must be one exact round-trip token with its own id, or
the tokenizer is refused. Then come `AA`..`ZZ` in lexicographic order, keeping only the codes
that are one exact round-trip token whose id no earlier code holds. The first 16 codes are
`A`..`P`, SemIf's native letters, so prompts of up to 16 options stay SemIf's.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

SINGLE_LETTERS = string.ascii_uppercase
NATIVE_CODES = tuple(SINGLE_LETTERS[:16])  # A..P: SemIf's own letters


class TokenizerContractError(Exception):
    """The tokenizer cannot give a faithful readout (slots or boundary); never served silently."""


@dataclass(frozen=True)
class AnswerAlphabet:
    """Answer codes in slot order and the token id the readout takes for each."""

    codes: tuple[str, ...]
    token_ids: tuple[int, ...]

    @property
    def capacity(self) -> int:
        """How many options one prompt can letter with this tokenizer."""
        return len(self.codes)

    def first(self, n: int) -> AnswerAlphabet:
        """The codes of a question with `n` options; more than `capacity` is a ValueError."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"{n} options need {n} answer codes; this tokenizer has {self.capacity}")
        return AnswerAlphabet(self.codes[:n], self.token_ids[:n])


def single_token(tokenizer, code: str) -> int | None:
    """The id of `code` when it encodes to exactly one token that decodes back to `code`."""
    ids = tokenizer.encode(code, add_special_tokens=False)
    if len(ids) == 1 and tokenizer.decode(ids) == code:
        return ids[0]
    return None


def answer_codes(tokenizer) -> AnswerAlphabet:
    """Every answer code `tokenizer` can read out, in slot order; refuses a tokenizer whose letters break."""
    codes: list[str] = []
    token_ids: list[int] = []
    for letter in SINGLE_LETTERS:
        token_id = single_token(tokenizer, letter)
        if token_id is None:
            ids = tokenizer.encode(letter, add_special_tokens=False)
            raise TokenizerContractError(
                f"answer letter {letter!r} is not one token that decodes back to itself "
                f"(encodes to {len(ids)} token(s), decodes to {tokenizer.decode(ids)!r})"
            )
        if token_id in token_ids:
            raise TokenizerContractError(
                f"answer letter {letter!r} shares token {token_id} with {codes[token_ids.index(token_id)]!r}"
            )
        codes.append(letter)
        token_ids.append(token_id)
    for first in SINGLE_LETTERS:
        for second in SINGLE_LETTERS:
            code = first + second
            token_id = single_token(tokenizer, code)
            if token_id is not None and token_id not in token_ids:
                codes.append(code)
                token_ids.append(token_id)
    return AnswerAlphabet(tuple(codes), tuple(token_ids))
