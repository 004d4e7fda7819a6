"""PEFT LoRA adapters over the shared base weights, and a batched LoRA: rows of different
adapters (and of the base) in one forward, each row equal to its model alone.

`AdapterBank(model)` owns the adapters served over one loaded model. `add` reads a PEFT
adapter directory (`adapter_config.json`, `adapter_model.safetensors`) once, checks it
against the base (its named base, every target module is one of the base's Linear layers,
A and B shaped to that layer and the rank) and refuses what it cannot read exactly, naming
the file and key. `rows(adapters)` selects, for the forwards run inside it, which adapter
each batch row reads (an index from `add`, or `BASE` = -1); without a selection every
forward is the plain base.

The batched LoRA (docs/adapters.md): one forward hook per targeted Linear adds each row's
`B(A(x)) * scale` to the base output, the way PEFT's LoRA layer computes it. The rows are
taken as contiguous runs of one adapter (the engine orders a forward's rows by adapter), so a
run is a view of the batch and costs one low-rank product pair; base rows cost nothing
beyond the base. A/B stay per adapter (no padding to a common rank, no per-row gather).
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from semif_serve.domain.peft_files import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, PEFT_PREFIX
from semif_serve.domain.requests import BASE
from semif_serve.engine.loader import CheckpointError

VL_TEXT_PREFIX = "model.language_model."  # an adapter saved over the vision-language class
LINEAR_STATES = ("conv_states", "recurrent_states")  # a linear-attention cache layer's per-row states
TENSOR_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
# Settings PEFT saves that would change the forward away from plain LoRA: each must be off.
MUST_BE_OFF = (
    "use_dora",
    "use_qalora",
    "use_bdlora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "trainable_token_indices",
    "target_parameters",
    "layer_replication",
    "alora_invocation_tokens",
    "arrow_config",
    "megatron_config",
    "kasa_config",
    "velora_config",
    "monteclora_config",
    "rank_pattern",
    "alpha_pattern",
)


class AdapterError(CheckpointError):
    """An adapter that cannot be served exactly over the base; the message names the file and key."""


@dataclass(frozen=True)
class LoraWeights:
    """One adapter's tensors, on the base's device and dtype: module name -> (A, B)."""

    directory: Path
    rank: int
    alpha: float
    rslora: bool
    base_model: str | None
    modules: dict[str, tuple[Any, Any]]
    nbytes: int

    @property
    def trained_scale(self) -> float:
        """PEFT's scaling: lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass(frozen=True)
class ServedAdapter:
    """An adapter as one model serves it: its weights and the scale each row applies."""

    name: str
    weights: LoraWeights
    multiplier: float  # the serving-time multiplier (lev's adapter_scale); 1.0 by default

    @property
    def scale(self) -> float:
        """The factor on B(A(x)): PEFT's scaling times the serving multiplier."""
        return self.weights.trained_scale * self.multiplier


@dataclass
class _Selection:
    """Which adapter the rows of the forwards now running read: one for all, or runs of rows."""

    every: int = BASE
    runs: tuple[tuple[int, int, int], ...] = ()  # (adapter, start, stop), adapters only
    rows: int = 0


@dataclass
class AdapterBank:
    """The adapters served over one model, loaded once, and the per-forward row selection (each
    thread's own: a forward's lanes run at once on threads of their own, `engine.lanes`)."""

    model: Any
    adapters: list[ServedAdapter] = field(default_factory=list)
    _loaded: dict[Path, LoraWeights] = field(default_factory=dict)
    _tables: dict[str, dict[int, tuple[Any, Any, float]]] = field(default_factory=dict)
    _handles: list[Any] = field(default_factory=list)
    _selected: threading.local = field(default_factory=threading.local)

    @property
    def _selection(self) -> _Selection | None:
        return getattr(self._selected, "selection", None)

    @_selection.setter
    def _selection(self, selection: _Selection | None) -> None:
        self._selected.selection = selection

    @property
    def nbytes(self) -> int:
        """Bytes of every distinct adapter's tensors (each directory counted once)."""
        return sum(w.nbytes for w in self._loaded.values())

    def index(self, name: str) -> int:
        """The index of the adapter served under `name` (KeyError when there is none)."""
        for i, served in enumerate(self.adapters):
            if served.name == name:
                return i
        raise KeyError(name)

    def add(
        self, name: str, directory: Path, *, multiplier: float = 1.0, base_names: Sequence[str] = ()
    ) -> int:
        """Serve the PEFT adapter in `directory` as `name`, scaled by `multiplier`; its index
        (`read`, then `serve`). Raises AdapterError naming the file and key."""
        return self.serve(name, self.read(directory, base_names), multiplier=multiplier)

    def read(self, directory: Path, base_names: Sequence[str] = ()) -> LoraWeights:
        """The adapter in `directory`, read and checked once (`read_adapter`); a directory already
        read (another model over the same adapter) gives its tensors again, read once.
        `base_names`: the names the base answers to (its source, its directory); an adapter whose
        `base_model_name_or_path` names another base is refused (empty: not checked)."""
        key = Path(directory).resolve()
        weights = self._loaded.get(key)
        if weights is None:
            weights = read_adapter(Path(directory), self.model, base_names)
            self._loaded[key] = weights
        return weights

    def serve(self, name: str, weights: LoraWeights, *, multiplier: float = 1.0) -> int:
        """Serve `weights` (from `read`) as `name`, each row scaled by `multiplier`; its index."""
        if any(served.name == name for served in self.adapters):
            raise ValueError(f"adapter {name!r} is already served")
        if not (multiplier > 0 and math.isfinite(multiplier)):
            raise AdapterError(
                f"{weights.directory}: the scale must be a positive number, not {multiplier!r}"
            )
        served = ServedAdapter(name, weights, multiplier)
        index = len(self.adapters)
        self.adapters.append(served)
        modules = dict(self.model.named_modules())
        for module_name, (a, b) in weights.modules.items():
            table = self._tables.get(module_name)
            if table is None:
                table = self._tables[module_name] = {}
                self._handles.append(
                    modules[module_name].register_forward_hook(self._hook(table), with_kwargs=True)
                )
            table[index] = (a, b, served.scale)
        return index

    @contextmanager
    def rows(self, adapters: int | Sequence[int]) -> Iterator[None]:
        """Inside it, every forward reads adapter `adapters` in each row (an int), or adapter
        `adapters[i]` in batch row i (a sequence as long as the batch; BASE for the base)."""
        if isinstance(adapters, int):
            self._check(adapters)
            selection = _Selection(every=adapters)
        else:
            for adapter in adapters:
                self._check(adapter)
            distinct = set(adapters)
            if len(distinct) == 1:
                selection = _Selection(every=adapters[0], rows=len(adapters))
            else:
                selection = _Selection(runs=tuple(_runs(adapters)), rows=len(adapters))
        if self._selection is not None:
            raise RuntimeError("adapter rows are already selected")
        self._selection = selection
        try:
            yield
        finally:
            self._selection = None

    def close(self) -> None:
        """Remove every hook: the model is the plain base again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._tables.clear()

    def _check(self, adapter: int) -> None:
        if adapter != BASE and not 0 <= adapter < len(self.adapters):
            raise IndexError(f"no adapter {adapter} (serving {len(self.adapters)})")

    def _hook(self, table: dict[int, tuple[Any, Any, float]]) -> Any:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
            selection = self._selection
            if selection is None:
                return None
            x = args[0] if args else kwargs["input"]
            if selection.rows and x.shape[0] != selection.rows:
                raise RuntimeError(f"a forward of {x.shape[0]} rows under a selection of {selection.rows}")
            if not selection.runs:
                weights = table.get(selection.every)
                if weights is None:
                    return None  # the base, or an adapter that leaves this layer alone
                _add_lora(output, x, *weights)
                return output
            for adapter, start, stop in selection.runs:
                weights = table.get(adapter)
                if weights is not None:
                    _add_lora(output[start:stop], x[start:stop], *weights)
            return output

        return hook


def _add_lora(output: Any, x: Any, a: Any, b: Any, scale: float) -> None:
    """`output += B(A(x)) * scale` in place (PEFT's LoRA term): the scale on the rank-r
    product, and B's product accumulated into the output by one GEMM (no pass over it)."""
    low = (x.reshape(-1, x.shape[-1]) @ a.T).mul_(scale)
    output.view(-1, output.shape[-1]).addmm_(low, b.T)


def stacked_fork(states: Sequence[tuple[Any, int]]) -> Any:
    """One cache for a forward whose rows read several adapters' states: `n` rows of each
    `(state, n)` in turn (each a `StoredState` over the same tokens, prefilled under its own
    adapter), consumable like `StoredState.fork`; the states themselves are left unchanged."""
    import torch

    lengths = {len(state) for state, _ in states}
    if len(lengths) != 1:
        raise ValueError(f"stacked states must cover the same number of tokens, not {sorted(lengths)}")
    forks = [state.fork(n) for state, n in states]
    first = forks[0]
    for i, layer in enumerate(first.layers):
        others = [fork.layers[i] for fork in forks[1:]]
        for name in ("keys", "values"):
            tensor = getattr(layer, name, None)
            if tensor is not None and tensor.numel():
                setattr(layer, name, torch.cat([tensor, *(getattr(o, name) for o in others)]))
        for name in LINEAR_STATES:
            tensors = getattr(layer, name, None) or {}
            for idx, tensor in tensors.items():
                if tensor is not None:
                    tensors[idx] = torch.cat([tensor, *(getattr(o, name)[idx] for o in others)])
    return first


def _runs(adapters: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Contiguous runs of one adapter in `adapters` (base rows left out)."""
    start = 0
    for i in range(1, len(adapters) + 1):
        if i == len(adapters) or adapters[i] != adapters[start]:
            if adapters[start] != BASE:
                yield adapters[start], start, i
            start = i


def read_adapter(directory: Path, model: Any, base_names: Sequence[str] = ()) -> LoraWeights:
    """Read and check one PEFT LoRA adapter against `model`'s Linear layers (module names as
    the text model names them); its tensors on the model's device and dtype.

    Raises AdapterError naming the file and key: a missing file, not LoRA, a setting that
    changes the forward (DoRA, biases, saved modules, rank or alpha patterns, ...), another
    base, a target the base lacks, a tensor that is not a LoRA A/B of a Linear layer, shapes
    that do not fit the layer or the rank, a module with A and not B."""
    import torch

    config_path = directory / ADAPTER_CONFIG_FILE
    weights_path = directory / ADAPTER_WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise AdapterError(f"{path}: missing (a PEFT LoRA adapter directory holds {path.name})")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{config_path}: cannot read: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: not a JSON object")
    rank, alpha, rslora = _lora_settings(config_path, config)
    base_model = config.get("base_model_name_or_path") or None
    if base_names and base_model is not None and base_model not in base_names:
        raise AdapterError(
            f"{config_path}: base_model_name_or_path {base_model!r} is not the served base "
            f"({', '.join(repr(n) for n in base_names)})"
        )
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    _targets_exist(config_path, config.get("target_modules"), linears)
    tensors = _read_tensors(weights_path)
    parts: dict[str, dict[str, Any]] = {}
    for key, tensor in tensors.items():
        match = TENSOR_NAME.match(key)
        if match is None:
            raise AdapterError(f"{weights_path}: {key}: not a LoRA A/B weight (only plain LoRA is served)")
        module = module_name(match["module"])
        if module not in linears:
            raise AdapterError(f"{weights_path}: {key}: the base has no Linear layer {module!r}")
        parts.setdefault(module, {})[match["part"]] = tensor
    if not parts:
        raise AdapterError(f"{weights_path}: holds no LoRA weights")
    modules: dict[str, tuple[Any, Any]] = {}
    nbytes = 0
    for module, ab in sorted(parts.items()):
        layer = linears[module]
        for part in ("A", "B"):
            if part not in ab:
                raise AdapterError(f"{weights_path}: {PEFT_PREFIX}{module}.lora_{part}.weight: missing")
        a, b = ab["A"], ab["B"]
        want_a, want_b = (rank, layer.in_features), (layer.out_features, rank)
        for part, tensor, want in (("A", a, want_a), ("B", b, want_b)):
            if tuple(tensor.shape) != want:
                raise AdapterError(
                    f"{weights_path}: {PEFT_PREFIX}{module}.lora_{part}.weight: shape "
                    f"{tuple(tensor.shape)}, the base's {module} with r={rank} needs {want}"
                )
            if not tensor.is_floating_point():
                raise AdapterError(
                    f"{weights_path}: {PEFT_PREFIX}{module}.lora_{part}.weight: not floating point"
                )
            if not bool(tensor.isfinite().all()):
                raise AdapterError(
                    f"{weights_path}: {PEFT_PREFIX}{module}.lora_{part}.weight: holds a non-finite value"
                )
        a = a.to(device=layer.weight.device, dtype=layer.weight.dtype).contiguous()
        b = b.to(device=layer.weight.device, dtype=layer.weight.dtype).contiguous()
        modules[module] = (a, b)
        nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
    return LoraWeights(
        directory=directory,
        rank=rank,
        alpha=alpha,
        rslora=rslora,
        base_model=base_model,
        modules=modules,
        nbytes=nbytes,
    )


def module_name(peft_module: str) -> str:
    """A saved tensor's module as the text model names it: PEFT's wrapper prefix removed, and an
    adapter saved over the vision-language class mapped onto its language model."""
    name = peft_module.removeprefix(PEFT_PREFIX)
    if name.startswith(VL_TEXT_PREFIX):
        name = "model." + name.removeprefix(VL_TEXT_PREFIX)
    return name


def _lora_settings(path: Path, config: dict[str, Any]) -> tuple[int, float, bool]:
    """(r, lora_alpha, use_rslora) of a plain LoRA config; refuses anything else by key."""
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type is {config.get('peft_type')!r}, not 'LORA'")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{path}: r must be a positive integer, not {rank!r}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise AdapterError(f"{path}: lora_alpha must be a number, not {alpha!r}")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError(f"{path}: use_rslora must be true or false, not {rslora!r}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise AdapterError(f"{path}: bias is {bias!r}; only 'none' is served (no bias tensors)")
    for key in MUST_BE_OFF:
        if config.get(key):
            raise AdapterError(f"{path}: {key} is set ({config[key]!r}); only plain LoRA is served exactly")
    return rank, float(alpha), rslora


def _targets_exist(path: Path, targets: Any, linears: dict[str, Any]) -> None:
    """Every target the config names matches one of the base's Linear layers (PEFT's rules: a
    list matches a module name or its last dotted parts; a string is a full regex match)."""
    names = list(linears)
    # A regex written for the vision-language class names the language model's layers so.
    vl_names = [VL_TEXT_PREFIX + n.removeprefix("model.") for n in names if n.startswith("model.")]
    if targets is None:
        return
    if isinstance(targets, str):
        if targets == "all-linear":
            return
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise AdapterError(f"{path}: target_modules: not a regular expression: {exc}") from None
        if not any(pattern.fullmatch(n) for n in (*names, *vl_names)):
            raise AdapterError(f"{path}: target_modules {targets!r} matches no Linear layer of the base")
        return
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError(f"{path}: target_modules must be a list of names or a regex string")
    for target in map(module_name, targets):
        if not any(n == target or n.endswith("." + target) for n in names):
            raise AdapterError(f"{path}: target_modules: {target!r} is not a Linear layer of the base")


def _read_tensors(path: Path) -> dict[str, Any]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as fh:
            return {key: fh.get_tensor(key) for key in fh.keys()}  # noqa: SIM118 (safe_open has no iter)
    except (SafetensorError, OSError) as exc:
        raise AdapterError(f"{path}: cannot read: {exc}") from None
