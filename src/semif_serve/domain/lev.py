"""lev's method as lev's server reads a release: manifest, prompts, codes, routes, orders, temperatures.

lev is Qwen3.5 with a LoRA adapter, a candidate head ("Mode B") and per-bucket temperatures
(GitHub `Abhinavexists/lev`, Apache-2.0). Every rule here was read from its source; `docs/lev.md`
names the file each came from. The code is this project's own. Nothing here knows torch or a
tokenizer: the engine hands in which codes are one token (`LevCodes`) and the scores it read.
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any, Literal, get_args

from semif_serve.domain.numerics import argmax, softmax
from semif_serve.domain.types import ConfigurationError, Refusal

MANIFEST_FILE = "lev_release.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
HEAD_FILE = "mode_b_head.pt"
CALIBRATION_FILE = "calibration.json"
TOKENIZER_FILE = "tokenizer.json"

PromptStyle = Literal["plain", "chat"]
NoulReadout = Literal["rating", "binary"]
ScoreOrderAverage = Literal["off", "reversed", "cyclic"]
Mode = Literal["A", "B"]
Order = tuple[int, ...] | None  # shown position j holds the option at index order[j]; None: as given

PROMPT_STYLES: tuple[str, ...] = get_args(PromptStyle)
NOUL_READOUTS: tuple[str, ...] = get_args(NoulReadout)
SCORE_ORDER_AVERAGES: tuple[str, ...] = get_args(ScoreOrderAverage)

# -- prompt text (prompt.py) -------------------------------------------------------------------

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
BINARY_NOUL_OPTIONS = ("yes", "no")
CHAT_BINARY_DEFAULTS = {"true": "the statement is true", "false": "the statement is false"}
RATING_LEVELS = 9  # digits 0..8 (labels.py NOUL_RATING_TOKENS)
RATING_TEXTS = tuple(str(i) for i in range(RATING_LEVELS))

# -- calibration buckets (calibrate.py) ---------------------------------------------------------

CHOICE_BANDS = ((8, "small"), (26, "mid"))  # above 26: "large"
BANDS = ("small", "mid", "large")
BUCKET_TYPES = ("choice", "score", "noul", "noul_binary")
MODES: tuple[str, ...] = get_args(Mode)


class LevReleaseError(ConfigurationError):
    """A release (or a setting for it) that cannot be read exactly; names the file and the key."""

    def __init__(self, file: str, key: str | None, problem: str) -> None:
        self.file = file
        self.key = key
        self.problem = problem
        super().__init__(f"{file}: {key}: {problem}" if key else f"{file}: {problem}")


class ModeBUnavailable(Refusal):
    """A question lev routes to the candidate head, on a release without one."""


# -- questions and answers ----------------------------------------------------------------------


@dataclass(frozen=True)
class LevNoul:
    """A yes/no question; `criteria` holds optional "true"/"false" descriptions."""

    instructions: Any = None
    criteria: Mapping[str, Any] | None = None
    type: Literal["noul"] = "noul"


@dataclass(frozen=True)
class LevChoice:
    """Pick one of the options; `criteria` maps option names to descriptions, in the caller's order."""

    criteria: Mapping[str, Any]
    instructions: Any = None
    type: Literal["choice"] = "choice"


@dataclass(frozen=True)
class LevScore:
    """Rate against ordered levels, low to high."""

    criteria: tuple[Any, ...]
    instructions: Any = None
    type: Literal["score"] = "score"


LevQuestion = LevNoul | LevChoice | LevScore


@dataclass(frozen=True)
class LevAnswer:
    """One question's answer as lev computes it; `probabilities` in the caller's order.

    noul: `value` is p(yes); `probabilities` the nine rating levels, or None for a binary noul
    (whose two-way distribution is `distribution`). choice: `value` the top option's name.
    score: `value` sum(i * p_i). `lev_confidence` is lev's own statistic (normalised Gini),
    kept for an extra field; System One's `confidence` is computed by the door from
    `probabilities` (see docs/lev.md).
    """

    type: Literal["noul", "choice", "score"]
    value: float | str
    probabilities: tuple[float, ...] | None
    distribution: tuple[float, ...]
    names: tuple[str, ...]
    lev_confidence: float
    mode: Mode
    bucket: str
    temperature: float
    orders: int


# -- the manifest and serving options (release.py, model.py: load) ------------------------------


@dataclass(frozen=True)
class LevManifest:
    """`lev_release.json`: what the server reads (base model, prompt style, scale) and what it checks."""

    base_model: str
    name: str | None
    prompt_style: PromptStyle | None
    noul_readout: NoulReadout | None
    lora_rank: int | None
    mode_b_head: bool | None
    calibrated: bool | None
    files: tuple[str, ...] | None
    adapter_scale: float | None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_manifest(data: object, file: str = MANIFEST_FILE) -> LevManifest:
    """Validate a parsed `lev_release.json`; every error names `file` and the key."""
    if not isinstance(data, dict):
        raise LevReleaseError(file, None, "must be a JSON object")

    def typed(key: str, check, what: str) -> Any:
        value = data.get(key)
        if value is not None and not check(value):
            raise LevReleaseError(file, key, f"must be {what}, not {value!r}")
        return value

    base = data.get("base_model")
    if not isinstance(base, str) or not base:
        raise LevReleaseError(file, "base_model", "required: the base model's name (a non-empty string)")
    rank = typed("lora_rank", lambda v: _is_int(v) and v >= 1, "a positive integer")
    scale = typed(
        "adapter_scale", lambda v: _is_number(v) and math.isfinite(v) and v > 0, "a finite number > 0"
    )
    files = typed(
        "files",
        lambda v: isinstance(v, list) and all(isinstance(f, str) and f for f in v),
        "a list of file names",
    )
    if files is not None:
        for i, name in enumerate(files):
            if "/" in name or "\\" in name or name in (".", ".."):
                raise LevReleaseError(
                    file, f"files[{i}]", f"must be a file name in the release, not {name!r}"
                )
    return LevManifest(
        base_model=base,
        name=typed("name", lambda v: isinstance(v, str), "a string"),
        prompt_style=typed("prompt_style", lambda v: v in PROMPT_STYLES, f"one of {list(PROMPT_STYLES)}"),
        noul_readout=typed("noul_readout", lambda v: v in NOUL_READOUTS, f"one of {list(NOUL_READOUTS)}"),
        lora_rank=rank,
        mode_b_head=typed("mode_b_head", lambda v: isinstance(v, bool), "true or false"),
        calibrated=typed("calibrated", lambda v: isinstance(v, bool), "true or false"),
        files=None if files is None else tuple(files),
        adapter_scale=None if scale is None else float(scale),
    )


@dataclass(frozen=True)
class LevOptions:
    """How lev's server reads a release: its flags, resolved against the manifest."""

    prompt_style: PromptStyle = "plain"
    noul_readout: NoulReadout = "rating"
    score_order_average: ScoreOrderAverage = "off"
    max_label_options: int | None = None
    order_average: bool = True
    skip_multi_token_codes: bool = True

    @property
    def label_prefix(self) -> str:
        """A space before the code after plain `Answer:`; none at the start of a chat answer."""
        return " " if self.prompt_style == "plain" else ""


def serving_options(
    manifest: LevManifest,
    *,
    prompt_style: str | None = None,
    noul_readout: str | None = None,
    score_order_average: str = "off",
    max_label_options: int | None = None,
    source: str = "settings",
) -> LevOptions:
    """lev's serving policy for a release: the manifest's prompt style, rating nouls unless told
    binary (the manifest's `noul_readout` is not read, as in lev), the operator's score orders and
    label cap. A prompt style that contradicts the manifest is refused (lev would drop it silently)."""
    if prompt_style is not None and prompt_style not in PROMPT_STYLES:
        raise LevReleaseError(
            source, "prompt_style", f"must be one of {list(PROMPT_STYLES)}, not {prompt_style!r}"
        )
    if (
        manifest.prompt_style is not None
        and prompt_style is not None
        and prompt_style != manifest.prompt_style
    ):
        raise LevReleaseError(
            source,
            "prompt_style",
            f"{prompt_style!r} contradicts {MANIFEST_FILE} prompt_style {manifest.prompt_style!r}",
        )
    if noul_readout is not None and noul_readout not in NOUL_READOUTS:
        raise LevReleaseError(
            source, "noul_readout", f"must be one of {list(NOUL_READOUTS)}, not {noul_readout!r}"
        )
    if score_order_average not in SCORE_ORDER_AVERAGES:
        raise LevReleaseError(
            source,
            "score_order_average",
            f"must be one of {list(SCORE_ORDER_AVERAGES)}, not {score_order_average!r}",
        )
    if max_label_options is not None and not (_is_int(max_label_options) and max_label_options >= 1):
        raise LevReleaseError(
            source, "max_label_options", f"must be an integer >= 1, not {max_label_options!r}"
        )
    style = manifest.prompt_style or prompt_style or "plain"
    return LevOptions(
        prompt_style=style,  # type: ignore[arg-type]
        noul_readout=noul_readout or "rating",  # type: ignore[arg-type]
        score_order_average=score_order_average,  # type: ignore[arg-type]
        max_label_options=max_label_options,
    )


# -- calibration (calibrate.py) -----------------------------------------------------------------


def option_band(n_options: int) -> str:
    """lev's choice band by option count: small <= 8, mid <= 26, large above."""
    for upper, name in CHOICE_BANDS:
        if n_options <= upper:
            return name
    return "large"


def bucket_key(bucket_type: str, mode: str, n_options: int | None = None) -> str:
    """`{type}:{mode}[:{band}]`; only choice is banded."""
    band = option_band(n_options) if bucket_type == "choice" and n_options is not None else None
    return f"{bucket_type}:{mode}" + (f":{band}" if band else "")


@dataclass(frozen=True)
class LevCalibration:
    """`calibration.json`: one temperature per bucket; an absent bucket falls back."""

    temperatures: Mapping[str, float]
    fitted_on: str = ""
    n_samples: Mapping[str, int] | None = None

    def temperature(self, bucket_type: str, mode: str, n_options: int) -> tuple[str, float]:
        """The bucket used and its T: banded, else unbanded, else 1.0 (lev's lookup)."""
        banded = bucket_key(bucket_type, mode, n_options)
        plain = bucket_key(bucket_type, mode)
        if banded in self.temperatures:
            return banded, self.temperatures[banded]
        if plain in self.temperatures:
            return plain, self.temperatures[plain]
        return "default", 1.0


UNCALIBRATED = LevCalibration(temperatures={})


def _valid_bucket(key: str) -> bool:
    parts = key.split(":")
    if len(parts) not in (2, 3) or parts[0] not in BUCKET_TYPES or parts[1] not in MODES:
        return False
    return len(parts) == 2 or parts[2] in BANDS


def parse_calibration(data: object, file: str = CALIBRATION_FILE) -> LevCalibration:
    """Validate a parsed `calibration.json` (`temperatures`, `fitted_on`, `n_samples`)."""
    if not isinstance(data, dict):
        raise LevReleaseError(file, None, "must be a JSON object")
    temperatures = data.get("temperatures")
    if not isinstance(temperatures, dict):
        raise LevReleaseError(file, "temperatures", "required: an object of bucket -> temperature")
    table: dict[str, float] = {}
    for key, value in temperatures.items():
        if not _valid_bucket(key):
            raise LevReleaseError(
                file,
                f"temperatures.{key}",
                "is not a bucket {type}:{mode}[:{band}] (types "
                f"{list(BUCKET_TYPES)}, modes {list(MODES)}, bands {list(BANDS)})",
            )
        if not (_is_number(value) and math.isfinite(value) and value > 0):
            raise LevReleaseError(file, f"temperatures.{key}", f"must be a finite number > 0, not {value!r}")
        table[key] = float(value)
    fitted_on = data.get("fitted_on", "")
    if not isinstance(fitted_on, str):
        raise LevReleaseError(file, "fitted_on", f"must be a string, not {fitted_on!r}")
    n_samples = data.get("n_samples", {})
    if not isinstance(n_samples, dict) or not all(_is_int(v) for v in n_samples.values()):
        raise LevReleaseError(file, "n_samples", "must be an object of bucket -> count")
    return LevCalibration(temperatures=table, fitted_on=fitted_on, n_samples=dict(n_samples))


# -- label codes (labels.py) --------------------------------------------------------------------


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
        if options.score_order_average == "reversed":
            return (None, reverse)
        if options.score_order_average == "cyclic":
            return (None, *(tuple((j + r) % n for j in range(n)) for r in range(1, n)))
        return (None,)
    if isinstance(question, LevNoul) and not chosen.binary_noul:
        return (None,)
    return (None, reverse)


# -- rendering (prompt.py) ----------------------------------------------------------------------


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


# -- the plan of one request, and its readout (model.py) ----------------------------------------


@dataclass(frozen=True)
class LevRow:
    """One forward row: the prefix (encoded with special tokens) then this suffix (without),
    joined as ids; read at the last token: `label_ids` (Mode A) or the head (Mode B)."""

    question_id: str
    order: Order
    suffix: str
    label_ids: tuple[int, ...] | None


@dataclass(frozen=True)
class LevPlan:
    """A request as lev serves it: one prefix, the rows of every question in request order."""

    prefix: str
    rows: tuple[LevRow, ...]
    questions: Mapping[str, LevQuestion]
    routes: Mapping[str, LevRoute]

    @property
    def needs_head(self) -> bool:
        """Whether any question reads the candidate head (and so wants hidden states)."""
        return any(r.mode == "B" for r in self.routes.values())


def plan_request(
    state: Any,
    questions: Mapping[str, LevQuestion],
    codes: LevCodes,
    options: LevOptions,
    has_head: bool = True,
) -> LevPlan:
    """Route every question, choose its orders and render its rows; refuses Mode B without a head."""
    if codes.prefix != options.label_prefix:
        raise ValueError(
            f"codes were verified with prefix {codes.prefix!r}, the style reads {options.label_prefix!r}"
        )
    routes = {qid: route(q, codes, options) for qid, q in questions.items()}
    if not has_head:
        for position, (qid, r) in enumerate(routes.items()):
            if r.mode == "B":
                raise ModeBUnavailable(
                    f"question {qid!r} needs lev's candidate head ({r.reason}), and this release has no "
                    f"{HEAD_FILE}",
                    question=position,
                )
    rows = tuple(
        LevRow(
            qid,
            order,
            render_suffix(qid, q, routes[qid].codes, order, options.prompt_style),
            routes[qid].token_ids,
        )
        for qid, q in questions.items()
        for order in question_orders(q, routes[qid], options)
    )
    return LevPlan(render_prefix(state, options.prompt_style), rows, dict(questions), routes)


def average_orders(prob_rows: Sequence[Sequence[float]], orders: Sequence[Order]) -> list[float]:
    """Each order's probabilities put back in the caller's order, then their mean (lev averages
    probabilities, not logits)."""
    total = [0.0] * len(prob_rows[0])
    for probs, order in zip(prob_rows, orders, strict=True):
        for j, p in enumerate(probs):
            total[j if order is None else order[j]] += p
    return [t / len(prob_rows) for t in total]


def gini_confidence(probs: Sequence[float]) -> float:
    """lev's `confidence`: (K sum p^2 - 1) / (K - 1) (not System One's)."""
    k = len(probs)
    if k <= 1:
        return 1.0
    return (k * sum(p * p for p in probs) - 1.0) / (k - 1)


def read_question(
    question: LevQuestion,
    chosen: LevRoute,
    scores: Sequence[Sequence[float]],
    orders: Sequence[Order],
    calibration: LevCalibration,
) -> LevAnswer:
    """One question's answer from its rows' scores: each row's softmax(scores / T) with its
    bucket's temperature, averaged over the orders, then the type's value."""
    bucket_type = "noul_binary" if chosen.binary_noul else question.type
    bucket, temperature = calibration.temperature(bucket_type, chosen.mode, len(scores[0]))
    probs = average_orders([softmax(s, temperature) for s in scores], orders)
    value: float | str
    shown: tuple[float, ...] | None = tuple(probs)
    if isinstance(question, LevChoice):
        names = tuple(question.criteria)
        value = names[argmax(probs)]
    elif isinstance(question, LevScore):
        names = tuple(str(i) for i in range(len(probs)))
        value = sum(level * p for level, p in enumerate(probs))
    elif chosen.binary_noul:
        names, value, shown = BINARY_NOUL_OPTIONS, probs[0], None
    else:
        names = RATING_TEXTS
        value = sum((level / (RATING_LEVELS - 1)) * p for level, p in enumerate(probs))
    return LevAnswer(
        type=question.type,
        value=value,
        probabilities=shown,
        distribution=tuple(probs),
        names=names,
        lev_confidence=gini_confidence(probs),
        mode=chosen.mode,
        bucket=bucket,
        temperature=temperature,
        orders=len(orders),
    )


def read_plan(
    plan: LevPlan, row_scores: Sequence[Sequence[float]], calibration: LevCalibration
) -> dict[str, LevAnswer]:
    """Every question's answer, from one score list per row of `plan` (in row order)."""
    if len(row_scores) != len(plan.rows):
        raise ValueError(f"{len(plan.rows)} rows planned, {len(row_scores)} read")
    by_question: dict[str, tuple[list[Sequence[float]], list[Order]]] = {
        qid: ([], []) for qid in plan.questions
    }
    for row, scores in zip(plan.rows, row_scores, strict=True):
        by_question[row.question_id][0].append(scores)
        by_question[row.question_id][1].append(row.order)
    return {
        qid: read_question(q, plan.routes[qid], by_question[qid][0], by_question[qid][1], calibration)
        for qid, q in plan.questions.items()
    }
