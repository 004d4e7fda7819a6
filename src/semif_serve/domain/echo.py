"""How much of a client's text a reply may echo: the one rule for every error message.

A message names what it refuses by a bounded prefix of the client's value (`quoted`, `clipped`),
never the whole value, the repr of an object, a heap address or a path; `bounded_message` is
the backstop each door's error serialisation applies, so no message is longer than
MESSAGE_CHARS whatever a rule forgot.
"""

from __future__ import annotations

from typing import Any

ECHO_CHARS = 256  # characters of a client's value a reply echoes (a key, a name, a location)
MESSAGE_CHARS = 1024  # the longest error message any door sends
NAME_CHARS = 256  # the longest workload name /calibrate takes (it is echoed in its report)


def clipped(value: Any, limit: int = ECHO_CHARS) -> Any:
    """A string cut to `limit` characters (saying how long it was); anything else as it is."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]}... ({len(value)} characters)"
    return value


def quoted(value: object, limit: int = ECHO_CHARS) -> str:
    """`value` as a message quotes it: the repr of a string cut to `limit` characters (saying
    how long it was); a non-string by its type's name, never its repr."""
    if not isinstance(value, str):
        return f"a {type(value).__name__}"
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def bounded_message(message: str) -> str:
    """`message` cut to MESSAGE_CHARS characters (the backstop behind `quoted`)."""
    return clipped(message, MESSAGE_CHARS - 32)
