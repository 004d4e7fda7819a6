"""The models a request may name, each resolved once into what serves it (`Served`: its method,
its adapter in the engine's bank, its entry), the way vLLM's `OpenAIServingModels` resolves a
request's model before anything else reads it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from semif_serve.domain.requests import BASE
from semif_serve.service.methods import DecisionMethod, Served
from semif_serve.service.models import ModelSet


@dataclass(frozen=True)
class ServedModels:
    """Every served model by name (the base first, then SEMIF_MODELS' in its order) with what
    serves it, and the file's names and aliases (`models`)."""

    models: ModelSet
    served: Mapping[str, Served]

    @classmethod
    def over(
        cls, models: ModelSet, methods: Mapping[str, DecisionMethod], adapters: Mapping[str, int]
    ) -> ServedModels:
        """Each entry of `models` with its started method and its adapter's index in the bank
        (`adapters`; a model with none reads the base weights alone)."""
        served = {
            name: Served(
                name,
                methods[entry.method],
                adapters.get(name, BASE),
                entry,
                is_base=models.is_base(entry),
            )
            for name, entry in models.models.items()
        }
        return cls(models, served)

    @property
    def base(self) -> Served:
        """The base itself."""
        return self.served[self.models.base]

    @property
    def over_base(self) -> list[Served]:
        """Every model besides the base, in the file's order."""
        return [s for s in self.served.values() if not s.is_base]

    def resolve(self, name: str, *, jev_aliases: bool = True) -> Served | None:
        """What serves a request naming `name` (a model's name or an alias), or None when
        unknown; `jev_aliases=False` leaves the Jev names unknown unless `[aliases]` declares
        them (SEMIF_SYSTEMONE_ALLOW_ALIASES off)."""
        entry = self.models.resolve(name, jev_aliases=jev_aliases)
        return None if entry is None else self.served[entry.name]

    def names(self) -> list[str]:
        """Every model's name and every alias, as a refusal lists them."""
        return [*self.models.models, *self.models.aliases]
