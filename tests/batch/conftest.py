"""The batch tests' fixtures: the demo's two models (its checkpoint with a vision tower and its
lev release) and the same settings for the service and the batch, in this process and as
environment variables for a child process."""

from __future__ import annotations

from pathlib import Path

import pytest

from semif_serve.tools.demo import DEMO_REVISION, ensure_demo_models
from tests.support import TOKEN, make_settings
from tests.support.batch import LIMITS, child_env


@pytest.fixture(scope="session")
def demo_models(vision_checkpoint) -> tuple[Path, Path]:
    """The demo's checkpoint (with a vision tower) and its SEMIF_MODELS file (the lev release)."""
    return vision_checkpoint, ensure_demo_models(vision_checkpoint)


@pytest.fixture(scope="session")
def batch_settings(demo_models):
    """The settings both sides read (in this process)."""
    checkpoint, models = demo_models
    return make_settings(checkpoint, models=models, dtype="float32", **LIMITS)


@pytest.fixture(scope="session")
def batch_env(demo_models) -> dict[str, str]:
    """The same settings as environment variables, for a service or a batch in a child process."""
    checkpoint, models = demo_models
    return child_env(
        SEMIF_MODEL_PATH=str(checkpoint),
        SEMIF_MODEL_REVISION=DEMO_REVISION,
        SEMIF_MODELS=str(models),
        SEMIF_DEVICE="cpu",
        SEMIF_DTYPE="float32",
        SEMIF_API_TOKEN=TOKEN,
        **{f"SEMIF_{k.upper()}": str(v) for k, v in LIMITS.items()},
    )
