"""How `semif-serve presentation-checks` probes a method's models (docs/presentation-checks.md).

A method class that can be probed carries a `Probing` as its `probing` class attribute, read
without starting the method (by URL the tool knows only `/v1/models`' `x_method`): which orderings
a kind is measured under and which the recommendation chooses among, a question's fields for an
ordering, the served name that reads each (ordering, scores), how an answer is read, the
orderings served now and the setting that serves a recommendation. The tool never names a method.

Orderings are named in the one vocabulary of `domain.orderings` (`none`, `reversal`, `shifts`,
`rotations`, `all`), and `served`: a model measured as it is served, its orders no request field.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from semif_serve.domain.orderings import CORE_ORDERINGS, order_count

if TYPE_CHECKING:
    from semif_serve.domain.presentation import Probe
    from semif_serve.service.methods import DecisionMethod

Scores = str  # "calibrated" (the answer as served) or "raw" (T = 1)
SCORES: tuple[Scores, ...] = ("calibrated", "raw")
SERVED = "served"  # a model measured as it is served: its orders are not a request field
# Every ordering from the cheapest up (rows per question never fall along this order).
BY_COST = ("none", "reversal", "shifts", "rotations", "all", SERVED)
ROWS_FORMULA = {
    "none": "1",
    "reversal": "2",
    "shifts": "min(n, 4)",
    "rotations": "n",
    "all": "n!",
}
Names = dict[tuple[str, Scores], str]  # the served name that reads each (ordering, scores)
Asker = Callable[[dict[str, Any]], Awaitable[Mapping[str, Any]]]  # a System One body -> its answers


class NoSlots(Exception):
    """A kind a model reads without option slots to compare (a rating noul's nine levels): one
    line, bad input to the tool."""


@dataclass(frozen=True)
class Reading:
    """One probe's answer: probabilities by option name, calibrated (as answered) and raw (None
    where the reply cannot give them), the temperature applied and the rows it cost."""

    calibrated: dict[str, float]
    raw: dict[str, float] | None
    temperature: float | None
    rows: int


def rows_for(ordering: str, n: int) -> int:
    """Rows one question of n options costs under `ordering` (`served`: at most n)."""
    if ordering == SERVED:
        return n
    return order_count(n, CORE_ORDERINGS[ordering])


def answered(answer: Mapping[str, Any]) -> dict[str, float]:
    """A System One answer's probabilities by option name, as served (a noul's `true`/`false`)."""
    if answer["type"] == "noul":
        return {"true": float(answer["noul"]), "false": 1.0 - float(answer["noul"])}
    return {name: float(p) for name, p in answer["probabilities"].items()}


class Probing(Protocol):
    """How a method's models are probed, at class level. `options` is the SEMIF_MODELS entry's
    options in process, None by URL (where the model is measured as it is served)."""

    temperatures: str  # what sets its calibrated reads' temperatures, as a `--workloads` refusal says

    def kinds(self, asked: Sequence[str] | None, model: str, options: Mapping[str, Any] | None) -> list[str]:
        """The kinds measured: `asked`, else every kind the model reads over option slots;
        NoSlots where an asked kind has none."""
        ...

    def orderings(self, kind: str) -> tuple[str, ...]:
        """The orderings `kind` is measured under, cheapest first."""
        ...

    def choices(self, kind: str) -> tuple[str, ...]:
        """The orderings of `kind` an operator can serve, cheapest first: what the recommendation
        chooses among."""
        ...

    def question(self, probe: Probe, ordering: str, workload: str | None) -> dict[str, Any] | None:
        """`probe`'s System One question asked under `ordering` (its calibrated read at
        `workload`), or None where the probe is not asked under it."""
        ...

    def names(self, model: str, options: Mapping[str, Any] | None) -> Names:
        """The served name that reads each (ordering, scores) of `model`; one name for both scores
        of an ordering: one reply reads both."""
        ...

    def variants(self, method: DecisionMethod, model: str) -> DecisionMethod:
        """The started `method` also serving every name of `names` that is not `model` (in this
        process), each a copy of `model` read as its (ordering, scores) says."""
        ...

    def read(self, answer: Mapping[str, Any]) -> Reading:
        """One answer of a reply as probabilities, raw ones where it carries them; NoSlots where
        it has no option slots."""
        ...

    async def served_orderings(
        self, ask: Asker, model: str, state: Any, options: Mapping[str, Any] | None
    ) -> dict[str, str]:
        """The ordering each kind is served in now, asked of the service (`ask`, over `state`)
        where the entry does not say."""
        ...

    def setting(self, model: str, chosen: Mapping[str, str | None], served: Mapping[str, str]) -> str:
        """The line an operator sets to serve the `chosen` ordering per kind (`served`: the
        orderings served now)."""
        ...
