"""Fixtures the engine's tests share: the base loaded for lev's releases, the adapter bank they are
entries of, and a recorder of every packed forward's segments."""

from __future__ import annotations

import pytest

from semif_serve.engine.adapters import AdapterBank
from semif_serve.engine.lanes import ForwardLanes
from semif_serve.engine.loader import CheckpointSpec, load_model
from semif_serve.tools.demo import DEMO_REVISION
from semif_serve.tools.lev_builder import DEFAULT_BASE_NAME


@pytest.fixture(scope="module")
def base(checkpoint):
    """The tiny checkpoint in float32, named as lev's releases name their base."""
    spec = CheckpointSpec(
        directory=checkpoint, revision=DEMO_REVISION, source=DEFAULT_BASE_NAME, dtype="float32", device="cpu"
    )
    return load_model(spec)


@pytest.fixture(scope="module")
def bank(base):
    """The adapter bank the releases are entries of (their adapters read once, by its rules)."""
    bank = AdapterBank(base.model)
    yield bank
    bank.close()


@pytest.fixture
def forwards(monkeypatch) -> list[list]:
    """Every packed forward's segments, as the engine hands them to its lanes (one forward,
    however many lanes run its shares)."""
    seen: list[list] = []
    real = ForwardLanes.forward

    def recording(self, model, segments, adapters=None):
        seen.append(list(segments))
        return real(self, model, segments, adapters)

    monkeypatch.setattr(ForwardLanes, "forward", recording)
    return seen
