"""SemIf's `direct-options-v1` prompt: rendering over the answer codes, the answer boundary, the state prefix.

Every rule here reproduces upstream exactly, so `prompt_sha256` and `input_tokens` equal SemIf's
for the same tokenizer and decision.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from semif_serve.domain.alphabet import NATIVE_CODES, AnswerAlphabet, answer_codes
from semif_serve.domain.alphabet import TokenizerContractError as TokenizerContractError
from semif_serve.domain.types import AnswerBoundary, TooManyOptions, TooManyTokens

PROMPT_VERSION = "direct-options-v1"
SYSTEM_PROMPT = (
    "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
    "Respond with only its uppercase letter, with no explanation or reasoning."
)
NATIVE_ALPHABET_SIZE = len(NATIVE_CODES)  # the native door's option limit
LETTERS = NATIVE_CODES


@dataclass(frozen=True)
class EncodedPrompt:
    """One rendered prompt: its text, token ids and SHA-256 (of the UTF-8 text)."""

    text: str
    ids: list[int]
    sha256: str
    user_offset: int  # where the user turn's JSON starts in `text`


def user_message(
    state: Any, question: str, descriptions: Sequence[str], codes: Sequence[str] = LETTERS
) -> str:
    """The user turn: evidence, criterion and lettered options; option ids are never shown."""
    options = [{"letter": codes[i], "description": d} for i, d in enumerate(descriptions)]
    return json.dumps({"evidence": state, "criterion": question, "options": options}, ensure_ascii=False)


def question_independent_opening(state: Any) -> str:
    """`{"evidence": <state>, "criterion": "`: the part of the user turn every question over
    `state` shares (upstream cuts after the state; the key that follows is shared too)."""
    return json.dumps({"evidence": state, "criterion": ""}, ensure_ascii=False)[:-2]


class PromptCodec:
    """Renders and tokenises SemIf prompts for one tokenizer over its answer codes (alphabet.py:
    A..Z, then the two-letter codes that are one exact token), with every readout check.

    `capacity` (the most options one prompt can hold) is the tokenizer's, computed once here.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.alphabet: AnswerAlphabet = answer_codes(tokenizer)
        self.codes = self.alphabet.codes
        self.slots = list(self.alphabet.token_ids)
        # Per answer tail: how many codes were checked, and the first whose boundary breaks.
        self._tail_checks: dict[str, tuple[int, int | None]] = {}
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._boundary_tokens = [t.content for t in added.values() if not getattr(t, "rstrip", False)]

    @property
    def capacity(self) -> int:
        """How many options one prompt can hold with this tokenizer."""
        return self.alphabet.capacity

    def render_prompt(self, state: Any, question: str, descriptions: Sequence[str]) -> str:
        """The chat-template rendering of the system and user turns, ready for the answer code."""
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user_message(state, question, descriptions, self.codes)},
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
        and AnswerBoundary (option = the slot asked) where a code's logit is unreadable."""
        if len(descriptions) > self.capacity:
            raise TooManyOptions(len(descriptions), self.capacity)
        text = self.render_prompt(state, question, descriptions)
        user_offset = text.index(user_message(state, question, descriptions, self.codes))
        ids = self.encode(text)
        if len(ids) > max_input_tokens:
            raise TooManyTokens(len(ids), max_input_tokens)
        broken = self._first_broken_code(text, ids, len(descriptions))
        if broken is not None:
            raise AnswerBoundary(self.codes[broken], broken)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        return EncodedPrompt(text, ids, digest, user_offset)

    def _first_broken_code(self, text: str, ids: list[int], n_codes: int) -> int | None:
        """SemIf's boundary check, `encode(prompt + code) == ids + [slot]`, for the first n codes.

        The tokenizer never merges across an added token, so only the text after the prompt's
        last one can interact with the code: the check runs once per distinct tail (the chat
        template's fixed ending) and code, extended only as far as a prompt's options reach.
        """
        tail = self._answer_tail(text)
        if tail is None:
            return self._first_mismatch(text, ids, 0, n_codes)
        checked, broken = self._tail_checks.get(tail, (0, None))
        if broken is None and checked < n_codes:
            broken = self._first_mismatch(tail, self.encode(tail), checked, n_codes)
            checked = n_codes
            self._tail_checks[tail] = (checked, broken)
        return broken if broken is not None and broken < n_codes else None

    def _first_mismatch(self, text: str, ids: list[int], start: int, stop: int) -> int | None:
        return next(
            (i for i in range(start, stop) if self.encode(text + self.codes[i]) != ids + [self.slots[i]]),
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
