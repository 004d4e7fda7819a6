"""Shared fixtures: a tiny random-weight Qwen3.5 checkpoint on disk, loaded through the real loader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The service processes the tests start share compiled bytecode: with PYTHONDONTWRITEBYTECODE set
# (and no `uv sync --compile-bytecode`), each would compile torch and transformers from source again.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from semif_serve.app import create_app  # noqa: E402
from semif_serve.engine.runner import TorchEngine  # noqa: E402
from semif_serve.service.startup import Service, load_engine  # noqa: E402
from semif_serve.tools.demo import write_checkpoint  # noqa: E402
from tests.support import in_process_client, make_settings  # noqa: E402
from tests.support.memory_report import MemoryReport  # noqa: E402
from tests.support.tls_context import install as share_default_tls_context  # noqa: E402

# httpx builds a TLS context per client (30-70 ms); the suite's thousand loopback calls share one.
share_default_tls_context()

LAYERS = ("domain", "engine", "http", "doors", "service", "batch", "deploy", "docs")
# What a module needs beyond Python, so `-m "not browser"` (or `-m proxy`) picks by it.
NEEDS = {
    "test_playground": ("browser",),
    "test_playground_workbench": ("browser", "slow"),
    "test_gateway": ("proxy", "slow"),
    "test_nginx_proxy": ("proxy",),
    "test_k8s_chart": ("proxy",),
    "test_k8s_controlplane": ("proxy", "slow"),
    "test_stacks": ("docker", "proxy", "slow"),
    "test_no_stalls": ("slow",),
    "test_prometheus_live": ("slow",),
    "test_fuzz": ("slow",),
    "test_acceptance": ("slow",),
    "test_conformance": ("slow",),
    "test_run_batch": ("slow",),
    "test_ray_batch": ("slow",),
}


MEMORY = MemoryReport()


def pytest_runtest_setup(item):
    """Account resident memory by module (printed at the end of the run)."""
    MEMORY.enter(item.nodeid.split("::")[0])
    MEMORY.before_test()


def pytest_runtest_teardown(item):
    """See the processes a test started while they still run, and whether it raised the peak."""
    MEMORY.after_test(item.nodeid)
    MEMORY.watch_children()


MEMORY_LIMIT_GIB = float(os.environ.get("SEMIF_TEST_MEMORY_GIB", "6"))  # CI's bound (issue 49)


def pytest_sessionfinish(session):
    """A run whose test process, or any process it started, passed MEMORY_LIMIT_GIB fails."""
    MEMORY.leave()
    if MEMORY.peak_gib() > MEMORY_LIMIT_GIB:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    """The run's peak resident memory and the modules that left the most behind."""
    terminalreporter.section("memory")
    for line in MEMORY.lines():
        terminalreporter.write_line(line)
    if MEMORY.peak_gib() > MEMORY_LIMIT_GIB:
        terminalreporter.write_line(
            f"FAILED: the run passed its memory bound of {MEMORY_LIMIT_GIB} GiB", red=True
        )


def pytest_collection_modifyitems(config, items):
    """Each test is marked with its layer (its folder) and what its module needs; the control-plane
    suite runs last, so that CI's build of it (started beside the tests) has the whole run to finish."""
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name in LAYERS:
            item.add_marker(path.parent.name)
        for name in NEEDS.get(path.stem, ()):
            item.add_marker(name)
    items.sort(key=lambda item: item.get_closest_marker("k8s_controlplane") is not None)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    """The checkpoint's tokenizer (Qwen3.5's real vocabulary) as transformers loads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="session")
def engine(checkpoint) -> TorchEngine:
    return load_engine(make_settings(checkpoint))


@pytest.fixture(scope="session")
def service(engine, checkpoint) -> Service:
    return Service.start(make_settings(checkpoint), engine=engine)


@pytest.fixture(scope="session")
def served_models(checkpoint, tmp_path_factory) -> Path:
    """A SEMIF_MODELS file serving every kind of model over `checkpoint` (tests/support/served_models.py)."""
    from tests.support.served_models import write_models_file

    return write_models_file(checkpoint, tmp_path_factory.mktemp("served-models"))


@pytest.fixture(scope="session")
def vision_checkpoint(tmp_path_factory) -> Path:
    """The demo's checkpoint: the tiny Qwen3.5 with a vision tower."""
    return write_checkpoint(tmp_path_factory.mktemp("vision-model"), multimodal=True)


@pytest.fixture(scope="session")
def vision_engine(vision_checkpoint) -> TorchEngine:
    return load_engine(make_settings(vision_checkpoint))


@pytest.fixture(scope="session")
def vision_service(vision_engine, vision_checkpoint) -> Service:
    return Service.start(make_settings(vision_checkpoint), engine=vision_engine)


@pytest.fixture(scope="session")
def vision_reference(vision_checkpoint):
    """The vision checkpoint as transformers' own classes load it (the independent side)."""
    from tests.support.vision_reference import load_reference

    return load_reference(vision_checkpoint)


@pytest.fixture(scope="module")
def app(service):
    """The real app over the session's service (a module that needs another defines its own)."""
    return create_app(service)


@pytest.fixture(scope="module")
def server(app):
    """`app` behind a real uvicorn on a loopback port, with the service's own server settings."""
    from tests.http.test_hardening import HardenedServer

    with HardenedServer(app) as running:
        yield running


@pytest.fixture
def client(service):
    """An in-process client of the real app (admission included)."""
    return in_process_client(create_app(service))
