"""Tokenising with the work bounded by a token limit, not by the text's length (docs/tokenising.md).

Two facts about the loaded tokenizer, found once:

- `max_token_bytes` (L): the most bytes one token covers (the vocabulary's longest, or an added
  token's content). Every token covers at most L bytes of the NFC text, so a text of b bytes
  is at least ceil(b / L) tokens: a text that proves itself past the limit is refused before
  any of it is tokenised.
- `slices_exact`: whether the tokenizer is byte-level BPE behind a pre-tokenizer pattern none of
  whose matches holds a non-whitespace character followed by a space (Qwen's), with an NFC (or
  no) normalizer and no added token holding whitespace or stripping it. Then every space that
  follows a non-whitespace character starts a pre-tokenized piece whatever surrounds it, BPE
  never merges across pieces, and NFC never composes a space with what precedes it: the text
  cut before such spaces encodes, slice by slice, to exactly the ids of the whole text.

`BoundedEncoder.encode(text, limit)` encodes slices of about SLICE_CHARS characters in turn and
stops at the first slice past `limit` (`PastLimit`), so a too-long text costs about `limit`
tokens' worth of tokenising; a slice whose bytes alone prove it past what is left is refused
before it is tokenised (a long stretch without such a space is one slice, at most L x limit
bytes).

Every tokenizer call of at most two slices takes a turn (`Turns`): calls run in the order they
ask, at most TURNS at once (a core is left to the event loop), so a request's encoding waits for
at most one slice of each request encoding before it, never for a whole large one. A stretch
that cannot be cut runs beside the turns, sharing the CPU rather than holding everyone's turn.
"""

from __future__ import annotations

import json
import os
import re
import threading
import unicodedata
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

SLICE_CHARS = 16_384  # one slice of a long text: what one tokenizer call covers
TURNS = max(1, (os.cpu_count() or 2) - 1)  # tokenizer calls at once: a core stays with the event loop
# Pre-tokenizer patterns (Qwen2/3 and Qwen3.5) in which no match holds a non-whitespace character
# followed by a space: a space may only open a match, or belong to a run of whitespace.
SPACE_SPLIT_PATTERNS = frozenset(
    {
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)
CUT = re.compile(r"(?<=\S) ")  # a space after a non-whitespace character (Python's \s covers Unicode's)
# Texts whose slices must encode to the ids of the whole (probed once per tokenizer, small slices).
SLICE_PROBES = (
    "It's  a  test,\twith (spaces)   and\n\n  newlines \u00e9 e\u0301 \u6570\u5b57 12 345 <|im_end|> x",
    '{"evidence": {"k": [1, 2.5, null, "a  b"]}, "criterion": "Zo\u00eb \U0001f600 ok?"}',
)


class PastLimit(Exception):
    """A text is longer than the limit it was encoded under: `tokens` is how many it is at least."""

    def __init__(self, tokens: int) -> None:
        super().__init__(f"at least {tokens} tokens")
        self.tokens = tokens


class Turns:
    """A lock that `width` holders may hold at once, granted in the order it was asked for."""

    def __init__(self, width: int = TURNS) -> None:
        self.width = width
        self._changed = threading.Condition()
        self._waiting: deque[object] = deque()
        self._holders = 0

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold one of the turns for the body of the `with`, after everyone who asked before."""
        ticket = object()
        with self._changed:
            self._waiting.append(ticket)
            self._changed.wait_for(lambda: self._waiting[0] is ticket and self._holders < self.width)
            self._waiting.popleft()
            self._holders += 1
            self._changed.notify_all()
        try:
            yield
        finally:
            with self._changed:
                self._holders -= 1
                self._changed.notify_all()


class BoundedEncoder:
    """Encodes text for one tokenizer (ids as `tokenizer.encode(text, add_special_tokens=False)`),
    stopping as soon as the text is proved past a limit."""

    def __init__(self, tokenizer: Any, slice_chars: int = SLICE_CHARS, turns: Turns | None = None) -> None:
        self.tokenizer = tokenizer
        self.slice_chars = slice_chars
        self.turns = turns or Turns()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.max_token_bytes = _max_token_bytes(tokenizer, backend)
        self.slices_exact = backend is not None and _splits_before_spaces(tokenizer, backend)
        if self.slices_exact:
            self.slices_exact = all(self._probe(text) for text in SLICE_PROBES)

    def _probe(self, text: str) -> bool:
        whole = self._encode(text)
        return all(
            [i for piece in _slices(text, size) for i in self._encode(piece)] == whole for size in (1, 7)
        )

    def at_least(self, text: str) -> int:
        """A lower bound on the tokens of `text`: its NFC bytes over the longest token's (0: unknown)."""
        if not self.max_token_bytes:
            return 0
        size = len(unicodedata.normalize("NFC", text).encode("utf-8"))
        return -(-size // self.max_token_bytes)

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """The ids of `text`; with `limit`, raises PastLimit as soon as they are proved more than
        `limit` (by the bytes of what is left, or by the ids of the slices encoded so far)."""
        if limit is None:
            return self._encode(text)
        if self.at_least(text) > limit:
            raise PastLimit(self.at_least(text))
        if not self.slices_exact or len(text) <= self.slice_chars:
            ids = self._encode(text)
            if len(ids) > limit:
                raise PastLimit(len(ids))
            return ids
        ids = []
        for piece in _slices(text, self.slice_chars):
            bound = len(ids) + self.at_least(piece)
            if bound > limit:
                raise PastLimit(bound)
            ids += self._encode(piece)
            if len(ids) > limit:
                raise PastLimit(len(ids))
        return ids

    def _encode(self, text: str) -> list[int]:
        if len(text) > 2 * self.slice_chars:  # a stretch that cannot be cut: beside the turns
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        with self.turns.turn():
            return list(self.tokenizer.encode(text, add_special_tokens=False))


def _slices(text: str, size: int) -> Iterator[str]:
    """`text` cut before a space that follows a non-whitespace character, about every `size`
    characters (a stretch without one stays whole)."""
    start = 0
    while len(text) - start > size:
        cut = CUT.search(text, start + size)
        if cut is None:
            break
        yield text[start : cut.start()]
        start = cut.start()
    yield text[start:]


def _max_token_bytes(tokenizer: Any, backend: Any) -> int:
    """The most bytes one token covers (0: not known, for a vocabulary that is not byte-level)."""
    if backend is None or not _is_byte_level(backend):
        return 0
    longest = max(len(token) for token in backend.get_vocab(with_added_tokens=False))  # a char per byte
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return max([longest, *(len(t.content.encode("utf-8")) for t in added.values())])


def _state(component: Any) -> dict[str, Any] | None:
    return json.loads(component.__getstate__()) if component is not None else None


def _is_byte_level(backend: Any) -> bool:
    pre = _state(backend.pre_tokenizer) or {}
    steps = pre.get("pretokenizers", [pre])
    return type(backend.model).__name__ == "BPE" and any(s.get("type") == "ByteLevel" for s in steps)


def _splits_before_spaces(tokenizer: Any, backend: Any) -> bool:
    """Whether the tokenizer is one whose text cut before a space after a non-whitespace
    character encodes, piece by piece, to the ids of the whole (see the module docstring)."""
    pre = _state(backend.pre_tokenizer) or {}
    steps = pre.get("pretokenizers", [])
    if pre.get("type") != "Sequence" or len(steps) != 2:
        return False
    split, byte_level = steps
    if not (
        split.get("type") == "Split"
        and split.get("pattern", {}).get("Regex") in SPACE_SPLIT_PATTERNS
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("use_regex")
        and not byte_level.get("add_prefix_space")
    ):
        return False
    normalizer = _state(backend.normalizer)
    if normalizer is not None and normalizer.get("type") != "NFC":
        return False
    if type(backend.model).__name__ != "BPE" or getattr(backend.model, "dropout", None):
        return False
    added = (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()
    return not any(
        any(c.isspace() for c in t.content) or t.lstrip or t.rstrip or t.single_word for t in added
    )
