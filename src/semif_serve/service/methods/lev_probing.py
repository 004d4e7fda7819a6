"""lev's method probed by `semif-serve presentation-checks` (`service.methods.probing`).

lev reads its release's own orders and temperatures and refuses SemIf's `x_orderings` and
`x_workload`, so in this process each ordering and scores is a copy of the release served under a
name of its own, over the same engine, adapter and head: `none` reads every question once (lev's
single order, which its own identical check reads), `reversal` as given and reversed (a score
too), `rotations` a score in every rotation; `raw` drops the release's temperatures (lev's
`--raw`). By URL a lev model is measured as it is served, calibrated only. A release reads nouls
as a rating (nine levels, no option slots) unless its `noul_readout` is binary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from semif_serve.domain.lev.calibration import UNCALIBRATED
from semif_serve.domain.lev.types import SCORE_ORDER_AVERAGES
from semif_serve.domain.presentation import KINDS, Probe
from semif_serve.service.methods.probing import SCORES, SERVED, Asker, Names, NoSlots, Reading, answered

if TYPE_CHECKING:
    from semif_serve.domain.lev.types import ScoreOrderAverage
    from semif_serve.engine.lev_release import LevRelease
    from semif_serve.service.methods import DecisionMethod

VARIANT_MARK = ":presentation:"  # a copy is served as <model>:presentation:<ordering>:<scores>
SINGLE = "none"  # lev's single order: no order averaging at all
SERVED_PAIR = "reversal"  # lev serves choice and a binary noul as given and reversed: not a setting
# Choice and a binary noul are read once or as lev serves them; a score in each score_order_average.
KIND_ORDERINGS = {
    "choice": (SINGLE, SERVED_PAIR),
    "score": SCORE_ORDER_AVERAGES,
    "noul": (SINGLE, SERVED_PAIR),
}


@runtime_checkable
class ServesReleases(Protocol):
    """A started lev method as its probing widens it (its releases by served name)."""

    releases: Mapping[str, LevRelease]

    def with_releases(self, releases: Mapping[str, LevRelease]) -> DecisionMethod:
        """The method serving `releases` besides its own."""
        ...


def copy_names(model: str) -> Names:
    """The served name of `model`'s copy for each of lev's orders and scores."""
    return {(o, s): f"{model}{VARIANT_MARK}{o}:{s}" for o in SCORE_ORDER_AVERAGES for s in SCORES}


def binary_noul(options: Mapping[str, Any] | None) -> bool:
    """Whether the entry reads nouls binary (two slots); by URL (None) only a reply can tell."""
    return options is not None and options.get("noul_readout", "rating") == "binary"


class LevProbing:
    """lev's method: each ordering and scores a served copy of the release, or as served by URL."""

    temperatures = "its release's own temperatures"

    def kinds(self, asked: Sequence[str] | None, model: str, options: Mapping[str, Any] | None) -> list[str]:
        """`asked`, else every kind but a rating noul (by URL: noul only when asked, its reply says)."""
        if asked is None:
            return [k for k in KINDS if k != "noul" or binary_noul(options)]
        if options is not None and not binary_noul(options) and "noul" in asked:
            raise NoSlots(
                f"--kinds noul: the lev model {model!r} reads nouls as a rating (nine levels, no option "
                'slots); the check needs its noul_readout = "binary"'
            )
        return list(asked)

    def orderings(self, kind: str) -> tuple[str, ...]:
        """lev's orders of `kind`, cheapest first."""
        return KIND_ORDERINGS[kind]

    def choices(self, kind: str) -> tuple[str, ...]:
        """A score's orders; choice and a noul only as lev serves them."""
        return self.orderings(kind) if kind == "score" else (SERVED_PAIR,)

    def question(self, probe: Probe, ordering: str, workload: str | None) -> dict[str, Any] | None:
        """The probe as it is: the served copy reads the ordering."""
        return dict(probe.question)

    def names(self, model: str, options: Mapping[str, Any] | None) -> Names:
        """A copy per order and scores in this process; by URL the model as served, calibrated."""
        return {(SERVED, "calibrated"): model} if options is None else copy_names(model)

    def variants(self, method: DecisionMethod, model: str) -> DecisionMethod:
        """`method` also serving each copy of the release `model`: its orders set, and for raw
        scores no calibration."""
        assert isinstance(method, ServesReleases)  # only lev's method carries this probing
        release = method.releases[model]
        copies = {}
        for (ordering, scores), name in copy_names(model).items():
            order = cast("ScoreOrderAverage", ordering)  # copy_names' orders are SCORE_ORDER_AVERAGES
            options = dataclasses.replace(
                release.options, order_average=order != SINGLE, score_order_average=order
            )
            calibration = release.calibration if scores == "calibrated" else UNCALIBRATED
            copies[name] = dataclasses.replace(release, options=options, calibration=calibration)
        return method.with_releases(copies)

    def read(self, answer: Mapping[str, Any]) -> Reading:
        """The answer as served, its temperature and orders from `x_lev` (no raw reading)."""
        if answer["type"] == "noul" and answer.get("probabilities") is not None:
            raise NoSlots(
                "the lev model reads nouls as a rating (nine levels, no option slots); the noul check "
                'needs noul_readout = "binary" (or leave noul out of --kinds)'
            )
        block = answer["x_lev"]
        return Reading(answered(answer), None, float(block["temperature"]), int(block["orders"]))

    async def served_orderings(
        self, ask: Asker, model: str, state: Any, options: Mapping[str, Any] | None
    ) -> dict[str, str]:
        """From the entry: choice and noul reversed, a score by its `score_order_average`."""
        if options is None:
            return dict.fromkeys(KINDS, SERVED)
        return {**dict.fromkeys(KINDS, SERVED_PAIR), "score": options.get("score_order_average", SINGLE)}

    def setting(self, model: str, chosen: Mapping[str, str | None], served: Mapping[str, str]) -> str:
        """The entry's `score_order_average` (measured as served: run in process to choose)."""
        score = chosen.get("score")
        if score in SCORE_ORDER_AVERAGES:
            return f'[models.{model}] score_order_average = "{score}"'
        return (
            f"[models.{model}]: measured as served; run in process (SEMIF_MODELS) to compare "
            "lev's orders and read its raw scores"
        )
