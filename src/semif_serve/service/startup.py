"""Startup in one place: settings -> calibration -> weights manifest -> engine -> warm-up
-> baseline -> a `Service`.

Startup fails closed: any error here stops the process before the port is bound.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

from semif_serve.domain.calibration import CalibrationTable, load_calibration
from semif_serve.domain.images import ImageAsset, read_image
from semif_serve.domain.numerics import MIB
from semif_serve.domain.requests import RowsRequest
from semif_serve.domain.types import ConfigurationError, PromptRow
from semif_serve.engine.adapters import AdapterBank
from semif_serve.engine.batching import Bounds
from semif_serve.engine.checkpoint_files import Verification, verify_checkpoint
from semif_serve.engine.loader import CheckpointSpec, load_model
from semif_serve.engine.memory import DeviceMemory, ReleasePolicy
from semif_serve.engine.runner import TorchEngine
from semif_serve.engine.state_cache import StateCache
from semif_serve.engine.threads import ThreadPolicy
from semif_serve.engine.worker import EngineWorker
from semif_serve.service.decisions import Decisions, ReplyCount
from semif_serve.service.methods import Ask, Decided, DecisionMethod, MethodRegistry, MethodStart
from semif_serve.service.models import ModelSet, load_models
from semif_serve.service.served import ServedModels
from semif_serve.service.settings import Settings

WARM_UP_STATE = {"service": "semif-serve", "check": "warm-up"}
WARM_UP_ROWS = (
    PromptRow("Is this a warm-up request?", ("Yes.", "No.")),
    PromptRow("Which option is listed first?", ("The first.", "The second.", "The third.")),
)


@dataclass
class Service:
    """A loaded, warmed-up process: its settings, the engine and its worker, the methods it serves
    models with (by name) and the models a request may name, each resolved to what serves it."""

    settings: Settings
    engine: TorchEngine
    worker: EngineWorker
    methods: Mapping[str, DecisionMethod]
    models: ServedModels
    calibration: CalibrationTable  # the workload temperatures of the calibration file
    token: str
    weights: Verification
    ready: bool = False

    @property
    def demo(self) -> bool:
        """Whether the loaded model is the random-weight demo (the one truth for demo)."""
        return self.engine.identity.demo

    async def decide(self, ask: Ask, reply_bytes: ReplyCount | None = None) -> Decided:
        """Answer one call with the method of the model it names (`service.decisions`)."""
        return await Decisions(self.worker).decide(ask, reply_bytes)

    @classmethod
    def start(cls, settings: Settings, engine: TorchEngine | None = None) -> Service:
        """Validate the token and calibration, load the engine, start every method over it (their
        adapters and heads loaded), warm it up and mark the baseline.

        The state cache is created here (empty, its budget from the settings) and counted in
        the baseline, so the headroom left for forwards is cap - warm floor - cache budget.
        Raises ConfigurationError, CalibrationFileError, CheckpointError or DecisionError;
        the caller exits non-zero on any of them (startup fails closed).
        """
        token = settings.token()
        calibration = load_calibration(settings.calibration)
        unknown = sorted(set(settings.systemone_workloads.values()) - set(calibration.names()))
        if unknown:
            raise ConfigurationError(
                f"SEMIF_SYSTEMONE_WORKLOADS: {', '.join(unknown)} not in the calibration file"
            )
        registry = MethodRegistry.of(settings.methods)
        models = served_models(settings, registry)
        calibration = calibration.with_models(workload_models(calibration, models, registry, settings))
        weights = verify_checkpoint(settings.require_model(), settings.model_manifest)
        if engine is None:
            engine = load_engine(settings)
        # Every method's adapters go into one bank, read before warm-up so the baseline counts them.
        engine = engine.with_adapters(AdapterBank(engine.model))
        context = MethodStart(engine, settings, calibration, models.base, models.source)
        methods = start_methods(registry, models, context)
        adapters = {served.name: index for index, served in enumerate(engine.adapters.adapters)}
        engine = engine.with_options(
            cache=StateCache(settings.state_cache_mib * MIB),
            prefill_chunk_tokens=settings.prefill_chunk_tokens,
            direct_path=settings.direct_path,
            keep_state_tokens=settings.keep_state_tokens,
            threads=ThreadPolicy.of_machine(settings.torch_threads),
            forward_lanes=settings.forward_lanes,
        )
        policy = ReleasePolicy(engine.memory, settings.release_margin_mib * MIB, engine.cache)
        bounds = Bounds(
            settings.max_batch_rows,
            settings.max_batch_tokens,
            settings.max_forward_tokens,
            settings.max_gather_seconds,
        )
        warming = EngineWorker(engine, policy, bounds, encoders=1)
        try:
            warm_up(warming, settings.max_input_tokens)
        finally:
            warming.shutdown()  # its engine thread exits, and OpenMP's threads of that thread with it
        baseline = policy.mark_baseline()
        cap = engine.memory.cap_bytes()
        if cap is not None and settings.split_batches:
            engine = engine.with_options(headroom_bytes=cap - baseline)
        worker = EngineWorker(
            engine, policy, bounds, encoders=settings.max_queue
        )  # a thread per admitted request
        return cls(
            settings=settings,
            engine=engine,
            worker=worker,
            methods=methods,
            models=ServedModels.over(models, methods, adapters),
            calibration=calibration,
            token=token,
            weights=weights,
            ready=True,
        )


def served_models(settings: Settings, registry: MethodRegistry | None = None) -> ModelSet:
    """The SEMIF_MODELS file, read and checked before the weights load: the base, its aliases and
    each model's entry, read by its method (`registry`; None: the built-in methods and
    SEMIF_METHODS')."""
    registry = registry or MethodRegistry.of(settings.methods)
    return load_models(settings.models, f"{settings.model_source}@{settings.model_revision}", registry)


def start_methods(
    registry: MethodRegistry, models: ModelSet, context: MethodStart
) -> dict[str, DecisionMethod]:
    """Every method that serves a model of `models`, started over `context.engine` with its
    entries (in the file's order); a method that fails closes the bank (the engine reads the plain
    base again) and stops startup."""
    try:
        return {
            name: method.start([e for e in models.models.values() if e.method == name], context)
            for name, method in registry.methods.items()
            if any(e.method == name for e in models.models.values())
        }
    except BaseException:
        context.engine.adapters.close()
        raise


def workload_models(
    calibration: CalibrationTable, models: ModelSet, registry: MethodRegistry, settings: Settings
) -> dict[str, str | None]:
    """The served model each calibration workload names (`"model"`): a model's name, or None for
    the base. A name that is no served model, or a model whose method reads its own calibration
    (a lev release), refuses to start, naming the file and the workload."""
    resolved: dict[str, str | None] = {}
    for workload, name in calibration.models.items():
        if name is None:
            continue  # already resolved: the base
        entry = models.resolve(name)
        where = f'{settings.calibration}: workload "{workload}": model {name!r}'
        if entry is None:
            known = ", ".join(repr(n) for n in [*models.models, *models.aliases])
            raise ConfigurationError(f"{where} is not a served model (served: {known})")
        method = registry.methods[entry.method]
        if not method.workloads:
            raise ConfigurationError(f"{where} is {method.noun}, which reads its own calibration.json")
        resolved[workload] = None if models.is_base(entry) else entry.name
    return resolved


def checkpoint_spec(settings: Settings) -> CheckpointSpec:
    """The engine's view of the settings: what to load, in which dtype, on which device."""
    directory = settings.require_model()
    assert settings.dtype is not None  # Settings fills the device's default
    return CheckpointSpec(
        directory=directory,
        revision=settings.model_revision,
        source=settings.model_source,
        dtype=settings.dtype,
        device=settings.device,
        demo=settings.demo,
        allow_any_architecture=settings.allow_any_architecture,
        vram_cap_gib=settings.vram_cap_gib,
        cpu_kernels=settings.cpu_kernels,
    )


def load_engine(settings: Settings, memory: DeviceMemory | None = None) -> TorchEngine:
    """Load the configured checkpoint (never downloads) into an engine with no state cache yet."""
    return TorchEngine.over(load_model(checkpoint_spec(settings), memory))


def warm_up(worker: EngineWorker, max_input_tokens: int) -> None:
    """Read a real decision on both paths through the worker's guard, and one over an image
    where the model reads images (the tower's kernels are warm before the first request)."""
    engine = worker.engine
    for request in (
        RowsRequest.of(WARM_UP_STATE, WARM_UP_ROWS[:1], shared=False, max_input_tokens=max_input_tokens),
        RowsRequest.of(WARM_UP_STATE, WARM_UP_ROWS, shared=True, max_input_tokens=max_input_tokens),
    ):
        worker.run_now(partial(engine.read, request))
    if engine.reads_images:
        image = warm_up_image()
        state = {**WARM_UP_STATE, "image": image.placeholder}
        request = RowsRequest.of(
            state, WARM_UP_ROWS[:1], shared=True, max_input_tokens=max_input_tokens, images=[image]
        )
        worker.run_now(lambda: engine.read(request))


def warm_up_image() -> ImageAsset:
    """A 64 x 64 grey PNG, made here (nothing is downloaded)."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 64), (128, 128, 128)).save(out, format="PNG")
    return read_image("<image:warm-up>", out.getvalue(), claimed="png", max_pixels=64 * 64)
