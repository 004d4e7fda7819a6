"""Every kind of model the service serves over one base, for tests that hold a guarantee on each:
the base (SemIf's method), a PEFT LoRA adapter (SemIf's method), a lev release, the base read
with lev's method, and the base read by a third method that is a plug-in defined in a test
(tests/service/test_third_method.py, registered by SEMIF_METHODS), written into one SEMIF_MODELS
file, with a valid System One body for each."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from semif_serve.service.startup import Service
from semif_serve.tools.lev_builder import write_lev_release
from tests.support import decision, make_settings


@dataclass(frozen=True)
class Served:
    """One served model as a client names it, and the method that reads it."""

    id: str  # the test's id
    model: str  # the `model` a request names
    method: str  # its method's name, as /v1/models' x_method lists it
    adapter: bool  # something is loaded over the base (a PEFT adapter or a release's)
    kinds: tuple[str, ...] = ("noul", "choice", "score")  # the System One types it answers

    def asks(self, kind: str) -> bool:
        """Whether it answers questions of `kind`."""
        return kind in self.kinds


BASE = Served("base", "jev-latest", "semif", adapter=False)
# The third method: a plug-in defined in a test module, named by its import path.
THIRD_METHOD_PLUG_IN = "tests.service.test_third_method:YesMinusNo"
THIRD_METHOD = Served("third-method", "yes-no", "yes-no", adapter=False, kinds=("noul",))
SERVED = (
    BASE,
    Served("adapter", "triage", "semif", adapter=True),
    Served("lev-release", "lev-tiny", "lev", adapter=True),
    Served("lev-base", "lev-base", "lev", adapter=False),
    THIRD_METHOD,
)
SERVED_IDS = [served.id for served in SERVED]
LORA_TARGETS = ["q_proj", "v_proj", "up_proj", "in_proj_qkv"]  # both of Qwen3.5's layer kinds


def write_models_file(checkpoint: Path, root: Path, *, third_method: bool = True) -> Path:
    """A SEMIF_MODELS file under `root` serving every entry of SERVED over `checkpoint` (the third
    method's only where `third_method`: it needs SEMIF_METHODS): the adapter written by PEFT
    itself, the release by lev's release writer."""
    from tests.engine.test_adapters import write_adapter

    write_adapter(checkpoint, root / "triage", 31, r=4, lora_alpha=8, target_modules=LORA_TARGETS)
    write_lev_release(root / "plain", checkpoint, prompt_style="plain", seed=3)
    models = root / "models.toml"
    models.write_text(
        '[models.triage]\nadapter = "triage"\n'
        '[models.lev-tiny]\nrelease = "plain"\n'
        '[models.lev-base]\nmethod = "lev"\n'
        + (f'[models.{THIRD_METHOD.model}]\nmethod = "{THIRD_METHOD.method}"\n' if third_method else "")
    )
    return models


@contextmanager
def serving(engine, checkpoint: Path, models: Path, **settings) -> Iterator[Service]:
    """A service over the session's engine serving `models` (the third method registered); its
    adapters' hooks are removed after, so the engine reads the plain base again."""
    settings.setdefault("methods", [THIRD_METHOD_PLUG_IN])
    service = Service.start(make_settings(checkpoint, models=models, **settings), engine=engine)
    try:
        yield service
    finally:
        service.engine.adapters.close()


def noul(served: Served, instructions: str) -> dict:
    """A yes/no question; SemIf's method asks it once (the others read their own orders and
    refuse `x_orderings`)."""
    question = {"type": "noul", "instructions": instructions}
    return {**question, "x_orderings": "none"} if served.method == "semif" else question


def systemone_body(served: Served, state: str, questions: dict[str, dict] | None = None) -> dict:
    """A valid System One body for `served`: `questions` as given, or one noul about the state."""
    asked = questions if questions is not None else {"q": noul(served, "Was the invoice paid twice?")}
    return {"model": served.model, "state": state, "questions": asked}


def native_decision(served: Served, state: str) -> dict | None:
    """A valid native `/decide` body reading `served` (the base: no `model`), or None for a model
    whose method answers no question over options on the native door (lev's)."""
    if served.method == "lev":
        return None
    chosen = {} if served is BASE else {"model": served.model}
    return decision(state=state, **chosen)
