"""SemIf's `direct-options-v1` prompt: rendering over the answer codes, the answer boundary, the state prefix.

Every rule here reproduces upstream exactly, so `prompt_sha256` and `input_tokens` equal SemIf's
for the same tokenizer and decision.

`encode_prompts` encodes the rows of one request over one state with the state tokenised
once: every prompt over a state starts with the same text up to the comma after the state
(`...{"evidence": <state>,`), and where the tokenizer never merges a token across that comma
and the space after it (checked once per tokenizer on probes; Qwen's pre-tokenizer splits
there whatever precedes it) the ids of the whole prompt are the ids of that head followed by
the ids of the rest. Otherwise every prompt is encoded whole, as before.

Every encoding of a row's text runs under what the row may still hold (its token limit, and
what is left of the request's budget): a text proved past it is refused before the rest of it
is tokenised (`tokens.BoundedEncoder`), with the refusal the limit gives (`TooManyTokens`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from semif_serve.domain.alphabet import NATIVE_CODES, AnswerAlphabet, answer_codes
from semif_serve.domain.alphabet import TokenizerContractError as TokenizerContractError
from semif_serve.domain.tokens import BoundedEncoder, PastLimit
from semif_serve.domain.types import AnswerBoundary, DecisionError, PromptRow, TooManyOptions, TooManyTokens

PROMPT_VERSION = "direct-options-v1"
SYSTEM_PROMPT = (
    "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
    "Respond with only its uppercase letter, with no explanation or reasoning."
)
NATIVE_ALPHABET_SIZE = len(NATIVE_CODES)  # the native door's option limit
LETTERS = NATIVE_CODES


@dataclass(frozen=True)
class ImageSpan:
    """What one image placeholder becomes in a prompt's ids: the vision start token, one id per
    image token (the same negative id throughout, derived from the image's digest, so that two
    images never share a prefix key), the vision end token."""

    placeholder: str  # as the request's strings hold it
    token_ids: tuple[int, ...]
    sha256: str


@dataclass(frozen=True)
class EncodedPrompt:
    """One rendered prompt: its text, token ids and SHA-256 (of the UTF-8 text)."""

    text: str
    ids: list[int]
    sha256: str
    user_offset: int  # where the user turn's JSON starts in `text`
    head_chars: int = 0  # with head_tokens: `text[:head_chars]` (the state's head) is `ids[:head_tokens]`
    head_tokens: int = 0


def user_message(
    state: Any, question: str, descriptions: Sequence[str], codes: Sequence[str] = LETTERS
) -> str:
    """The user turn: evidence, criterion and lettered options; option ids are never shown."""
    options = [{"letter": codes[i], "description": d} for i, d in enumerate(descriptions)]
    return json.dumps({"evidence": state, "criterion": question, "options": options}, ensure_ascii=False)


USER_OPENING = '{"evidence": '
# Where a prompt is cut for encoding its state once: after the comma that ends the state's value.
AFTER_STATE = ' "criterion": "'
# States whose heads, with what follows them, probe the tokenizer's split at the cut.
SPLIT_PROBES: tuple[Any, ...] = (
    "x",
    "ends with a space ",
    "Zo\u00eb \u6570\u5b57 \U0001f600",
    "it's",
    "tab\tnew\nline",
    "12",
    {"a": 1},
    {"k": [1, 2.5, None, True]},
    [1, 2],
    ["a", {"b": "c"}],
    '"quoted"',
    "",
)


def user_message_after_state(question: str, descriptions: Sequence[str], codes: Sequence[str]) -> str:
    """What follows `{"evidence": <state>,` in `user_message`: the same JSON, the state left out."""
    options = [{"letter": codes[i], "description": d} for i, d in enumerate(descriptions)]
    return " " + json.dumps({"criterion": question, "options": options}, ensure_ascii=False)[1:]


@dataclass(frozen=True)
class StateHead:
    """What every prompt over one state shares: the text up to the comma after the state, its
    ids, and the chat template's text after the user turn."""

    text: str
    ids: list[int]
    closing: str


def question_independent_opening(state: Any) -> str:
    """`{"evidence": <state>, "criterion": "`: the part of the user turn every question over
    `state` shares (upstream cuts after the state; the key that follows is shared too)."""
    return json.dumps({"evidence": state, "criterion": ""}, ensure_ascii=False)[:-2]


def probed_opening(encode: Callable[[Any], Sequence[int]]) -> tuple[int, ...]:
    """The ids a method's prompts start with whatever their state (its preamble): the ids that
    `encode(state)` gives for every probe state (`SPLIT_PROBES`), less the last shared one (a token
    can merge across the cut where the state begins)."""
    return tuple(os.path.commonprefix([list(encode(state)) for state in SPLIT_PROBES])[:-1])


class PromptCodec:
    """Renders and tokenises SemIf prompts for one tokenizer over its answer codes (alphabet.py:
    A..Z, then the two-letter codes that are one exact token), with every readout check.

    `capacity` (the most options one prompt can hold) is the tokenizer's, computed once here.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.bounded = BoundedEncoder(tokenizer)
        self.alphabet: AnswerAlphabet = answer_codes(tokenizer)
        self.codes = self.alphabet.codes
        self.slots = list(self.alphabet.token_ids)
        # Per answer tail: how many codes were checked, and the first whose boundary breaks.
        self._tail_checks: dict[str, tuple[int, int | None]] = {}
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self._boundary_tokens = [t.content for t in added.values() if not getattr(t, "rstrip", False)]
        self._splits_after_state: bool | None = None
        self._preamble: tuple[int, ...] | None = None
        self._spans: dict[str, ImageSpan] = {}  # placeholder as rendered in JSON -> its image
        self._span_pattern: re.Pattern[str] | None = None

    def with_images(self, spans: Sequence[ImageSpan]) -> PromptCodec:
        """This codec for one request's images: every placeholder (as the rendered JSON shows it)
        is encoded as its image's span, and each prompt's SHA-256 covers the images it shows.
        Shares the tokenizer checks already made."""
        _ = self.splits_after_state  # probed once, on the shared codec
        view = copy.copy(self)
        view._spans = {json.dumps(s.placeholder, ensure_ascii=False)[1:-1]: s for s in spans}
        alternatives = sorted(view._spans, key=len, reverse=True)  # a longer placeholder wins
        view._span_pattern = re.compile("|".join(re.escape(a) for a in alternatives)) if spans else None
        return view

    @property
    def capacity(self) -> int:
        """How many options one prompt can hold with this tokenizer."""
        return self.alphabet.capacity

    @property
    def splits_after_state(self) -> bool:
        """Whether a prompt's ids are its state head's ids followed by the rest's (probed once)."""
        if self._splits_after_state is None:
            self._splits_after_state = all(self._split_is_exact(state) for state in SPLIT_PROBES)
        return self._splits_after_state

    @property
    def preamble(self) -> tuple[int, ...]:
        """The ids every prompt starts with, whatever its state, question and options (the system
        turn and the user turn up to its state): the ids the probe states' prompts all share,
        less the last (a token can merge across the cut). Computed once."""
        if self._preamble is None:
            self._preamble = probed_opening(
                lambda state: self.encode(self.render_prompt(state, "Did it?", ("Yes.", "No.")))
            )
        return self._preamble

    def _split_is_exact(self, state: Any) -> bool:
        head: StateHead | None = None
        for question, descriptions in (("Did it?", ("Yes.", "No.")), ("'s \u00e9 1", (" a", '"b"'))):
            row = PromptRow(question, descriptions)
            text = self.render_prompt(state, question, descriptions)
            head = head or self._head(state, row)
            if head is None or self._row_text(head, row) != text:
                return False
            if self.encode(text) != head.ids + self.encode(text[len(head.text) :]):
                return False
        return True

    def _state_cut(self, text: str, state: Any, question: str, descriptions: Sequence[str]) -> int | None:
        """The offset just after the comma that ends the state's value in `text` (None: not found)."""
        user = user_message(state, question, descriptions, self.codes)
        at = text.find(user)
        if at < 0:
            return None
        cut = at + len(question_independent_opening(state)) - len(AFTER_STATE)
        return cut if text[cut - 1] == "," and text.startswith(AFTER_STATE, cut) else None

    def encode_prompts(
        self,
        state: Any,
        rows: Sequence[PromptRow],
        max_input_tokens: int,
        max_request_tokens: int | None = None,
    ) -> list[EncodedPrompt]:
        """`encode_prompt` for every row over `state`, the state's head tokenised once.

        Raises as `encode_prompt` does (with `row` set), and TooManyTokens for the request as a
        whole once the state's tokens plus every row's tokens after the state pass
        `max_request_tokens` (counted as the rows are encoded: refused at the first row past it).
        """
        head: StateHead | None = None
        prompts: list[EncodedPrompt] = []
        total = shared = 0
        for index, row in enumerate(rows):
            added = total - shared  # the request's tokens so far, less the state the row repeats
            room = (
                max_input_tokens
                if max_request_tokens is None
                else min(max_input_tokens, max_request_tokens - added)
            )
            try:
                if head is None and self.splits_after_state:
                    head = self._head(state, row, room)
                prompt = self._encode_row(state, row, max_input_tokens, head, room)
            except PastLimit as past:
                refusal = TooManyTokens(past.tokens, max_input_tokens, at_least=True)
                if past.tokens <= max_input_tokens and max_request_tokens is not None:
                    need = added + past.tokens  # within the row's limit: past what the request has left
                    refusal = TooManyTokens.for_request(
                        need, max_request_tokens, index + 1, len(rows), at_least=True
                    )
                raise refusal.located(row=index) from None
            except DecisionError as exc:
                raise exc.located(row=index) from exc
            if not prompts:
                shared = prompt.head_tokens or len(self.state_prefix(state, prompt))
                total = shared  # the state counts once; every row adds what follows it
            total += len(prompt.ids) - shared  # at most the budget: each row is encoded under what is left
            prompts.append(prompt)
        return prompts

    def _head(self, state: Any, row: PromptRow, room: int | None = None) -> StateHead | None:
        """What every prompt over `state` shares, from one rendering (None: no cut found);
        PastLimit once a row over it (one more token at least) is proved past `room`."""
        text = self.render_prompt(state, row.question, row.descriptions)
        user = user_message(state, row.question, row.descriptions, self.codes)
        cut = self._state_cut(text, state, row.question, row.descriptions)
        if cut is None:
            return None
        try:
            ids = self.encode(text[:cut], None if room is None else room - 1)
        except PastLimit as past:
            raise PastLimit(past.tokens + 1) from None
        return StateHead(text[:cut], ids, text[text.find(user) + len(user) :])

    def _row_text(self, head: StateHead, row: PromptRow) -> str:
        """The chat-template rendering of `row` over the head's state, spliced (not re-rendered)."""
        return head.text + user_message_after_state(row.question, row.descriptions, self.codes) + head.closing

    def _encode_row(
        self, state: Any, row: PromptRow, max_input_tokens: int, head: StateHead | None, room: int
    ) -> EncodedPrompt:
        """One row's prompt, encoded under `room` tokens (PastLimit past it)."""
        if len(row.descriptions) > self.capacity:
            raise TooManyOptions(len(row.descriptions), self.capacity)
        if head is None:
            text = self.render_prompt(state, row.question, row.descriptions)
            return self._checked(text, self.encode(text, room), row.descriptions, max_input_tokens)
        text = self._row_text(head, row)
        try:
            ids = head.ids + self.encode(text[len(head.text) :], room - len(head.ids))
        except PastLimit as past:
            raise PastLimit(len(head.ids) + past.tokens) from None
        return self._checked(text, ids, row.descriptions, max_input_tokens, len(head.text), len(head.ids))

    def render_prompt(self, state: Any, question: str, descriptions: Sequence[str]) -> str:
        """The chat-template rendering of the system and user turns, ready for the answer code."""
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user_message(state, question, descriptions, self.codes)},
        ]
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """Token ids without special tokens added, as SemIf encodes; an image placeholder becomes
        its span (the tokenizer splits at special tokens before anything else, so this equals
        encoding the text with the image's vision tokens written in). With `limit`, PastLimit
        as soon as the ids are proved more than `limit`."""
        if self._span_pattern is None:
            return self.bounded.encode(text, limit)
        ids: list[int] = []
        at = 0
        for match in self._span_pattern.finditer(text):
            ids += self._encode_within(text[at : match.start()], limit, len(ids))
            ids += self._spans[match[0]].token_ids
            at = match.end()
        ids += self._encode_within(text[at:], limit, len(ids))
        if limit is not None and len(ids) > limit:
            raise PastLimit(len(ids))
        return ids

    def _encode_within(self, text: str, limit: int | None, before: int) -> list[int]:
        """`text`'s ids after `before` ids of the same prompt, under what `limit` leaves."""
        try:
            return self.bounded.encode(text, None if limit is None else limit - before)
        except PastLimit as past:
            raise PastLimit(before + past.tokens) from None

    def digest(self, text: str) -> str:
        """A prompt's `prompt_sha256`: of its UTF-8 text, then of each image's SHA-256 (hex) in the
        order the text shows them (two prompts that differ only in an image differ here)."""
        h = hashlib.sha256(text.encode("utf-8"))
        if self._span_pattern is not None:
            for match in self._span_pattern.finditer(text):
                h.update(self._spans[match[0]].sha256.encode("ascii"))
        return h.hexdigest()

    def encode_prompt(
        self, state: Any, question: str, descriptions: Sequence[str], max_input_tokens: int
    ) -> EncodedPrompt:
        """Render, tokenise and check one prompt; raise TooManyTokens past `max_input_tokens`
        and AnswerBoundary (option = the slot asked) where a code's logit is unreadable."""
        try:
            return self._encode_row(
                state, PromptRow(question, tuple(descriptions)), max_input_tokens, None, max_input_tokens
            )
        except PastLimit as past:
            raise TooManyTokens(past.tokens, max_input_tokens, at_least=True) from None

    def _checked(
        self,
        text: str,
        ids: list[int],
        descriptions: Sequence[str],
        max_input_tokens: int,
        head_chars: int = 0,
        head_tokens: int = 0,
    ) -> EncodedPrompt:
        if len(ids) > max_input_tokens:
            raise TooManyTokens(len(ids), max_input_tokens)
        broken = self._first_broken_code(text, ids, len(descriptions), head_chars)
        if broken is not None:
            raise AnswerBoundary(self.codes[broken], broken)
        digest = self.digest(text)
        user_offset = text.index(USER_OPENING)  # the system turn before it is fixed text
        return EncodedPrompt(text, ids, digest, user_offset, head_chars, head_tokens)

    def _first_broken_code(self, text: str, ids: list[int], n_codes: int, start: int = 0) -> int | None:
        """SemIf's boundary check, `encode(prompt + code) == ids + [slot]`, for the first n codes.

        The tokenizer never merges across an added token, so only the text after the prompt's
        last one can interact with the code: the check runs once per distinct tail (the chat
        template's fixed ending) and code, extended only as far as a prompt's options reach.
        """
        tail = self._answer_tail(text, start)
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

    def _answer_tail(self, text: str, start: int = 0) -> str | None:
        """The text after the last added token that cannot absorb what follows it, if any
        (looked for after `start` first: a state's head need not be searched again)."""
        cut = -1
        for token in self._boundary_tokens:
            at = text.rfind(token, start)
            if at >= 0:
                cut = max(cut, at + len(token))
        if cut < 0 and start:
            return self._answer_tail(text)
        return text[cut:] if cut >= 0 else None

    def state_prefix(self, state: Any, prompt: EncodedPrompt) -> list[int]:
        """Token ids every prompt over `state` starts with: the text up to
        `{"evidence": <state>, "criterion": "`, tokenised, minus its last token (punctuation
        can merge across the cut)."""
        cut = prompt.user_offset + len(question_independent_opening(state))
        if prompt.head_tokens:
            rest = self.encode(prompt.text[prompt.head_chars : cut])
            return prompt.ids[: prompt.head_tokens] + rest[:-1]
        return self.encode(prompt.text[:cut])[:-1]
