"""SemIf's `direct-options-v1` prompt: rendering, answer slots, the answer boundary, the state prefix.

Every rule here reproduces upstream exactly, so `prompt_sha256` and `input_tokens` equal SemIf's
for the same tokenizer and decision.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .domain import AnswerBoundary, TooManyTokens

PROMPT_VERSION = "direct-options-v1"
SYSTEM_PROMPT = (
    "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
    "Respond with only its uppercase letter, with no explanation or reasoning."
)
NATIVE_ALPHABET_SIZE = 16  # A..P: SemIf's letters, and the native door's option limit
MAX_ALPHABET_SIZE = 26 + 26 * 26  # A..Z, then AA..ZZ


def answer_letters(count: int) -> tuple[str, ...]:
    """The first `count` answer letters: A..Z, then AA, AB, .. ZZ."""
    if not 1 <= count <= MAX_ALPHABET_SIZE:
        raise ValueError(f"an answer alphabet has 1..{MAX_ALPHABET_SIZE} letters, not {count}")
    singles = [chr(ord("A") + i) for i in range(26)]
    doubles = [a + b for a in singles for b in singles]
    return tuple((singles + doubles)[:count])


LETTERS = answer_letters(NATIVE_ALPHABET_SIZE)


class TokenizerContractError(Exception):
    """The tokenizer cannot give a faithful readout (slots or boundary); never served silently."""


@dataclass(frozen=True)
class EncodedPrompt:
    """One rendered prompt: its text, token ids and SHA-256 (of the UTF-8 text)."""

    text: str
    ids: list[int]
    sha256: str
    user_offset: int  # where the user turn's JSON starts in `text`


def user_message(
    state: Any, question: str, descriptions: Sequence[str], letters: Sequence[str] = LETTERS
) -> str:
    """The user turn: evidence, criterion and lettered options; option ids are never shown."""
    options = [{"letter": letters[i], "description": d} for i, d in enumerate(descriptions)]
    return json.dumps({"evidence": state, "criterion": question, "options": options}, ensure_ascii=False)


def question_independent_opening(state: Any) -> str:
    """`{"evidence": <state>, "criterion": "`: the part of the user turn every question over
    `state` shares (upstream cuts after the state; the key that follows is shared too)."""
    return json.dumps({"evidence": state, "criterion": ""}, ensure_ascii=False)[:-2]


def answer_slots(tokenizer: Any, letters: Sequence[str] = LETTERS) -> list[int]:
    """The token id of each answer letter; each must be one token that decodes to itself, all distinct."""
    slots: list[int] = []
    for letter in letters:
        ids = tokenizer.encode(letter, add_special_tokens=False)
        if len(ids) != 1:
            raise TokenizerContractError(
                f"answer letter {letter!r} encodes to {len(ids)} tokens, not exactly one"
            )
        if tokenizer.decode(ids) != letter:
            raise TokenizerContractError(
                f"answer letter {letter!r} does not decode back to itself (got {tokenizer.decode(ids)!r})"
            )
        if ids[0] in slots:
            raise TokenizerContractError(
                f"answer letter {letter!r} collides with {letters[slots.index(ids[0])]!r}"
            )
        slots.append(ids[0])
    return slots


class PromptCodec:
    """Renders and tokenises SemIf prompts for one tokenizer over an answer alphabet of
    `alphabet_size` letters (the most options a prompt can hold), with every readout check."""

    def __init__(self, tokenizer: Any, alphabet_size: int = NATIVE_ALPHABET_SIZE) -> None:
        self.tokenizer = tokenizer
        self.letters = answer_letters(alphabet_size)
        self.slots = answer_slots(tokenizer, self.letters)
        self._tail_checks: dict[str, int | None] = {}
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._boundary_tokens = [t.content for t in added.values() if not getattr(t, "rstrip", False)]

    def render_prompt(self, state: Any, question: str, descriptions: Sequence[str]) -> str:
        """The chat-template rendering of the system and user turns, ready for the answer letter."""
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user_message(state, question, descriptions, self.letters)},
        ]
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )

    def encode(self, text: str) -> list[int]:
        """Token ids without special tokens added, as SemIf encodes."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_prompt(
        self, state: Any, question: str, descriptions: Sequence[str], max_input_tokens: int
    ) -> EncodedPrompt:
        """Render, tokenise and check one prompt; raise TooManyTokens past `max_input_tokens`
        and AnswerBoundary (option = the slot asked) where a letter's logit is unreadable."""
        text = self.render_prompt(state, question, descriptions)
        user_offset = text.index(user_message(state, question, descriptions, self.letters))
        ids = self.encode(text)
        if len(ids) > max_input_tokens:
            raise TooManyTokens(len(ids), max_input_tokens)
        broken = self._first_broken_letter(text, ids, len(descriptions))
        if broken is not None:
            raise AnswerBoundary(self.letters[broken], broken)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        return EncodedPrompt(text, ids, digest, user_offset)

    def _first_broken_letter(self, text: str, ids: list[int], n_letters: int) -> int | None:
        """SemIf's boundary check, `encode(prompt + letter) == ids + [slot]`, for the first n letters.

        The tokenizer never merges across an added token, so only the text after the prompt's
        last one can interact with the letter: the check runs once per distinct tail (the chat
        template's fixed ending) instead of re-encoding every prompt once per letter.
        """
        tail = self._answer_tail(text)
        if tail is None:
            return self._first_mismatch(text, ids, n_letters)
        if tail not in self._tail_checks:
            self._tail_checks[tail] = self._first_mismatch(tail, self.encode(tail), len(self.letters))
        broken = self._tail_checks[tail]
        return broken if broken is not None and broken < n_letters else None

    def _first_mismatch(self, text: str, ids: list[int], n_letters: int) -> int | None:
        return next(
            (i for i in range(n_letters) if self.encode(text + self.letters[i]) != ids + [self.slots[i]]),
            None,
        )

    def _answer_tail(self, text: str) -> str | None:
        """The text after the last added token that cannot absorb what follows it, if any."""
        cut = -1
        for token in self._boundary_tokens:
            at = text.rfind(token)
            if at >= 0:
                cut = max(cut, at + len(token))
        return text[cut:] if cut >= 0 else None

    def state_prefix(self, state: Any, prompt: EncodedPrompt) -> list[int]:
        """Token ids every prompt over `state` starts with: the text up to
        `{"evidence": <state>, "criterion": "`, tokenised, minus its last token (punctuation
        can merge across the cut)."""
        cut = prompt.user_offset + len(question_independent_opening(state))
        return self.encode(prompt.text[:cut])[:-1]
