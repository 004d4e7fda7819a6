"""lev's prompt as its `prompt.py` renders it: the plain and chat layouts of the state (the
prefix every row shares) and of each question in each order (the row's suffix)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from semif_serve.domain.lev.types import (
    BINARY_NOUL_OPTIONS,
    CHAT_BINARY_DEFAULTS,
    RATING_TEXTS,
    LevChoice,
    LevNoul,
    LevQuestion,
    LevScore,
    Order,
    PromptStyle,
)

ANSWER_CUE = "Answer:"
CHAT_SYSTEM_PROMPT = (
    "You are a System One decision model. You read the Evidence and answer each "
    "Criterion by choosing exactly one of the listed options. You never explain. "
    "You answer with the single option label only."
)
CHAT_HEAD = f"<|im_start|>system\n{CHAT_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
CHAT_TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CHAT_ASK = {
    "choice": "Respond with only the letter of the best option.",
    "score": "Respond with only the letter of the level that best matches.",
    "noul": "Respond with only a digit from 0 to 8.",
}
RATING_PLAIN = "Rate 0-8 how strongly this is true (0 = certainly no, 8 = certainly yes)."
RATING_CHAT = "0 = certainly no ... 8 = certainly yes"


def render_state(state: Any) -> str:
    """A string as it is; anything else as sorted-key JSON, non-ASCII kept."""
    if isinstance(state, str):
        return state
    return json.dumps(state, sort_keys=True, ensure_ascii=False, indent=None)


def render_content(value: Any) -> str:
    """A description: a string as it is; anything else as sorted-key JSON, non-ASCII escaped."""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


def _title(name: str, question: LevQuestion) -> str:
    # lev formats the instructions with an f-string: a structured value appears as Python's repr
    return f"{question.instructions or name}"


def _ordered(items: list, order: Order) -> list:
    return items if order is None else [items[i] for i in order]


def render_question(
    name: str, question: LevQuestion, codes: Sequence[str] | None, order: Order, style: PromptStyle
) -> str:
    """The question block of one row: plain `Question:` lines, or chat `# Criterion` sections."""
    if style == "chat":
        return _render_chat(name, question, codes, order)
    lines = [f"Question: {_title(name, question)}"]
    if isinstance(question, LevChoice):
        if codes:
            lines.append("Options:")
            items = _ordered(list(question.criteria.items()), order)
            for code, (key, desc) in zip(codes, items, strict=False):
                lines.append(f"  {code}: {key}" + (f" - {render_content(desc)}" if desc else ""))
        else:
            lines.append(f"Choose the best of the {len(question.criteria)} candidates given.")
    elif isinstance(question, LevScore):
        if codes:
            lines.append("Levels:")
            for code, desc in zip(codes, _ordered(list(question.criteria), order), strict=False):
                lines.append(f"  {code}: {render_content(desc)}")
        else:
            lines.append(f"Choose the best of the {len(question.criteria)} levels given.")
    elif codes and len(codes) == len(BINARY_NOUL_OPTIONS):
        lines.append("Options:")
        described = {"yes": "true", "no": "false"}
        for code, option in zip(codes, _ordered(list(BINARY_NOUL_OPTIONS), order), strict=True):
            desc = (question.criteria or {}).get(described[option])
            lines.append(f"  {code}: {option}" + (f" - {render_content(desc)}" if desc else ""))
    else:
        lines.append(RATING_PLAIN)
        if question.criteria:
            for key in ("true", "false"):
                if (desc := question.criteria.get(key)) is not None:
                    lines.append(f"  {key}: {render_content(desc)}")
    return "\n".join(lines)


def _render_chat(name: str, question: LevQuestion, codes: Sequence[str] | None, order: Order) -> str:
    lines = [f"# Criterion\n{_title(name, question)}\n"]
    if isinstance(question, LevChoice):
        if codes:
            lines.append("# Options")
            for code, (key, desc) in zip(
                codes, _ordered(list(question.criteria.items()), order), strict=False
            ):
                lines.append(f"{code}. {key}" + (f": {render_content(desc)}" if desc else ""))
            lines.append(f"\n{CHAT_ASK['choice']}")
        else:
            lines.append(f"Choose the best of the {len(question.criteria)} candidates given.")
    elif isinstance(question, LevScore):
        top = len(question.criteria) - 1
        if codes:
            lines.append("# Options")
            levels = _ordered(list(enumerate(question.criteria)), order)
            for code, (level, desc) in zip(codes, levels, strict=False):
                lines.append(f"{code}. (level {level} of {top}) {render_content(desc)}")
            lines.append(f"\n{CHAT_ASK['score']}")
        else:
            lines.append(f"Choose the best of the {len(question.criteria)} levels given.")
    else:
        criteria = question.criteria or {}
        if codes and len(codes) == len(BINARY_NOUL_OPTIONS):
            pair = [
                (option, render_content(criteria.get(key) or CHAT_BINARY_DEFAULTS[key]))
                for option, key in zip(BINARY_NOUL_OPTIONS, ("true", "false"), strict=True)
            ]
            lines.append("# Options")
            for code, (option, desc) in zip(codes, _ordered(pair, order), strict=True):
                lines.append(f"{code}. {option}: {desc}")
            lines.append(f"\n{CHAT_ASK['choice']}")
        else:
            lines.append("# Scale")
            lines.append(RATING_CHAT)
            for key, label in (("true", "yes"), ("false", "no")):
                if (desc := criteria.get(key)) is not None:
                    lines.append(f"{label}: {render_content(desc)}")
            lines.append(f"\n{CHAT_ASK['noul']}")
    return "\n".join(lines)


def render_prefix(state: Any, style: PromptStyle) -> str:
    """The shared prefix of every row of a request (the state)."""
    if style == "chat":
        return f"{CHAT_HEAD}# Evidence\n{render_state(state)}\n\n"
    return f"Context:\n{render_state(state)}\n\n"


def render_suffix(
    name: str, question: LevQuestion, codes: Sequence[str] | None, order: Order, style: PromptStyle
) -> str:
    """One row's suffix: the question block and the answer boundary."""
    block = render_question(name, question, codes, order, style)
    return f"{block}\n{CHAT_TAIL}" if style == "chat" else f"{block}\n{ANSWER_CUE}"


def candidate_texts(question: LevQuestion) -> tuple[str, ...]:
    """Mode B's candidate strings: option names, rendered levels, or the digits 0..8."""
    if isinstance(question, LevNoul):
        return RATING_TEXTS
    if isinstance(question, LevScore):
        return tuple(render_content(level) for level in question.criteria)
    return tuple(question.criteria)
