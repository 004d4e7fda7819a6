"""A reply's size, counted before it is built: JSON's own framing over sizes that are exact for
text and bounded for numbers, so that a door can refuse a reply past SEMIF_MAX_REPLY_BYTES
before any engine work (a reading echoes every option's name: names, not tokens, set the size).

Every size is of the reply as it is sent: compact JSON (`,` and `:` with no spaces), UTF-8,
non-ASCII kept, as Starlette's `JSONResponse` renders it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, get_args

from pydantic import BaseModel

from semif_serve.domain.orderings import MODES
from semif_serve.engine.rows import PREFILL_KINDS

# The longest repr of a finite float64 (`-2.2250738585072014e-308`) and of a 64-bit int.
FLOAT_BYTES = 24
INT_BYTES = 20
BOOL_BYTES = len("false")
NULL_BYTES = len("null")
SHA256_BYTES = 64 + 2  # a hex digest as a JSON string


def text_bytes(text: str) -> int:
    """The exact size of `text` as a JSON string in the reply (quotes and escapes included)."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8"))


def longest_text(texts: Iterable[str]) -> int:
    """The size of the longest of `texts` as a JSON string (one of them will be echoed)."""
    return max(text_bytes(t) for t in texts)


def map_bytes(keys: int, values: int, count: int) -> int:
    """A JSON object of `count` entries whose keys (as JSON strings) total `keys` bytes and whose
    values total `values` bytes."""
    return 2 + keys + count + values + max(count - 1, 0)


def array_bytes(items: int, count: int) -> int:
    """A JSON array of `count` items totalling `items` bytes."""
    return 2 + items + max(count - 1, 0)


def object_bytes(model: type[BaseModel], sizes: Mapping[str, int]) -> int:
    """A reply model as a JSON object: the fields named in `sizes` (the rest left unset), each
    value of its given size; a name that is not one of the model's fields is a bug here."""
    # A model open to extra fields takes a plug-in method's own block (`x_<method>`) beside its fields.
    open_to = "x_" if model.model_config.get("extra") == "allow" else None
    unknown = {n for n in sizes if n not in model.model_fields and not (open_to and n.startswith(open_to))}
    if unknown:
        raise KeyError(f"{model.__name__} has no field {sorted(unknown)}")
    return map_bytes(sum(text_bytes(name) for name in sizes), sum(sizes.values()), len(sizes))


def scalars_bytes(model: type[BaseModel], texts: Mapping[str, int] | None = None) -> int:
    """A model of numbers and flags (every field set) as a JSON object; `texts` bounds its
    string fields."""
    bounds: dict[Any, int] = {bool: BOOL_BYTES, int: INT_BYTES, float: FLOAT_BYTES}
    texts = texts or {}

    def bound(annotation: Any) -> int:  # an optional number counts as set: the larger
        kinds = [kind for kind in get_args(annotation) if kind is not type(None)] or [annotation]
        return max(bounds[kind] for kind in kinds)

    return object_bytes(
        model,
        {
            name: texts[name] if name in texts else bound(field.annotation)
            for name, field in model.model_fields.items()
        },
    )


# A request's `prefill` in a timing block: the costliest of its groups', or none.
PREFILL_BYTES = longest_text((*PREFILL_KINDS, "none"))
# A calibrated block's `temperature_mode`: the mode whose temperature applied.
TEMPERATURE_MODE_BYTES = longest_text(MODES)
