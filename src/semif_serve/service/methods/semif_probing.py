"""SemIf's method probed by `semif-serve presentation-checks` (`service.methods.probing`): every
ordering a question type allows, asked of the one served model as the question's `x_orderings`
(a workload as `x_workload`); each reply reads both scores, the answer as calibrated and the raw
log-mean of its `x_semif.readings` at T = 1 (the softmax of the mean logits, as the service
combines them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from semif_serve.domain.orderings import ALLOWED_ORDERINGS, ANSWER_TYPES, MAX_ALL_OPTIONS, NO_ORDERINGS
from semif_serve.domain.presentation import KINDS, Probe, log_mean, probes
from semif_serve.service.methods.probing import BY_COST, SCORES, Asker, Names, Reading, answered

if TYPE_CHECKING:
    from semif_serve.service.methods import DecisionMethod

BLOCK = "x_semif"
SETTING = "SEMIF_SYSTEMONE_ORDERINGS"


class SemIfProbing:
    """SemIf's method: its orderings are a question's field, its replies carry the raw readings."""

    temperatures = "the calibration file's workloads"

    def kinds(self, asked: Sequence[str] | None, model: str, options: Mapping[str, Any] | None) -> list[str]:
        """`asked`, else every kind: each reads over option slots."""
        return list(KINDS) if asked is None else list(asked)

    def orderings(self, kind: str) -> tuple[str, ...]:
        """The orderings the question type allows, cheapest first."""
        return tuple(o for o in BY_COST if o in ALLOWED_ORDERINGS[kind])

    def choices(self, kind: str) -> tuple[str, ...]:
        """Every ordering measured: SEMIF_SYSTEMONE_ORDERINGS serves any of them."""
        return self.orderings(kind)

    def question(self, probe: Probe, ordering: str, workload: str | None) -> dict[str, Any] | None:
        """The probe with `x_orderings` (and `x_workload`); `all` reads at most 4 options."""
        if ordering == "all" and probe.size > MAX_ALL_OPTIONS:
            return None
        question = {**probe.question, "x_orderings": ordering}
        if workload is not None:
            question["x_workload"] = workload
        return question

    def names(self, model: str, options: Mapping[str, Any] | None) -> Names:
        """`model` for every ordering and both scores (`x_orderings` asks for the ordering)."""
        return {(o, s): model for kind in KINDS for o in self.orderings(kind) for s in SCORES}

    def variants(self, method: DecisionMethod, model: str) -> DecisionMethod:
        """`method` as it is: the one model serves every ordering."""
        return method

    def read(self, answer: Mapping[str, Any]) -> Reading:
        """The answer as calibrated, and the log-mean of `x_semif.readings` (raw, T = 1)."""
        block = answer[BLOCK]
        readings = [reading["probabilities"] for reading in block["readings"]]
        return Reading(answered(answer), log_mean(readings), block.get("temperature"), int(block["rows"]))

    async def served_orderings(
        self, ask: Asker, model: str, state: Any, options: Mapping[str, Any] | None
    ) -> dict[str, str]:
        """One question per answer type without `x_orderings`: the orderings its replies name."""
        questions = {kind: dict(probes(kind)[0].question) for kind in ANSWER_TYPES}
        answers = await ask({"model": model, "state": state, "questions": questions})
        return {kind: answers[kind][BLOCK]["orderings"] for kind in ANSWER_TYPES}

    def setting(self, model: str, chosen: Mapping[str, str | None], served: Mapping[str, str]) -> str:
        """SEMIF_SYSTEMONE_ORDERINGS: a kind not chosen keeps the ordering served now."""
        picked = {kind: served.get(kind, NO_ORDERINGS) for kind in ANSWER_TYPES}
        picked.update({kind: ordering for kind, ordering in chosen.items() if ordering})
        if all(ordering == NO_ORDERINGS for ordering in picked.values()):
            return f"{SETTING}={NO_ORDERINGS}"
        return f"{SETTING}=" + ",".join(f"{kind}={picked[kind]}" for kind in ANSWER_TYPES)
