"""A lev release directory read exactly as lev reads it, checked against the base it will run on.

`load_lev_release` reads `lev_release.json`, the PEFT LoRA adapter (`adapter_config.json`,
`adapter_model.safetensors`), the candidate head (`mode_b_head.pt`), `calibration.json` and the
release's tokenizer, and refuses (`LevReleaseError`, naming the file and the key) anything it
cannot serve exactly: another base, a shape the base does not have, a missing file, a LoRA
feature beyond plain LoRA. `score_lev` answers one request with one release alone: a plain full
forward per row with the adapter applied (`lora_applied`), the way lev's own server computes it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from semif_serve.domain.lev import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    CALIBRATION_FILE,
    CODE_COUNT,
    HEAD_FILE,
    MANIFEST_FILE,
    TOKENIZER_FILE,
    UNCALIBRATED,
    LevAnswer,
    LevCalibration,
    LevCodes,
    LevManifest,
    LevOptions,
    LevPlan,
    LevQuestion,
    LevReleaseError,
    all_codes,
    candidate_texts,
    parse_calibration,
    parse_manifest,
    plan_request,
    read_plan,
    serving_options,
)
from semif_serve.domain.types import BatchTiming

PEFT_PREFIX = "base_model.model."  # PEFT's saved keys: base_model.model.<module>.lora_A.weight
HEAD_HEADS = 8  # lev's head has 8 attention heads; the file does not store it (readout/mode_b.py)
CANDIDATE_MAX_TOKENS = 64  # lev truncates each Mode B candidate to 64 tokens (model.py)
# PEFT settings that change the forward beyond W x + s B A x; a release using one is refused.
_UNSUPPORTED_CONFIG = {
    "use_dora": False,
    "lora_bias": False,
    "modules_to_save": None,
    "layer_replication": None,
    "trainable_token_indices": None,
}


@dataclass(frozen=True)
class LoraModule:
    """One adapted projection: `W x + scaling * B (A x)`; `scaling` includes `adapter_scale`."""

    name: str  # the module's path in the base causal LM, e.g. model.layers.3.mlp.down_proj
    a: Any  # (r, in_features)
    b: Any  # (out_features, r)
    scaling: float


@dataclass(frozen=True)
class LevRelease:
    """A release ready to serve over a base: what the engine needs, each part checked."""

    directory: Path
    manifest: LevManifest
    options: LevOptions
    adapter_config: Mapping[str, Any]  # PEFT's adapter_config.json, as saved
    adapter_weights: Mapping[str, Any]  # adapter_model.safetensors, as saved (PEFT's key names)
    adapter_scale: float  # the serving-time multiplier: the operator's, else the manifest's, else 1.0
    modules: tuple[LoraModule, ...]
    head: Any | None  # LevHead in float32, or None (Mode A only)
    calibration: LevCalibration
    tokenizer: Any  # the release's own tokenizer when it ships tokenizer.json, else the base's
    codes: LevCodes  # the codes that are one token after the style's label prefix

    @property
    def name(self) -> str:
        """The release's name from its manifest (its directory's name when absent)."""
        return self.manifest.name or self.directory.name

    @property
    def frozen_base(self) -> bool:
        """lev's method over the base alone (`base_release`): no adapter, no head, no calibration."""
        return not self.adapter_config


def _head_class() -> Any:
    import torch
    from torch import nn

    class LevHead(nn.Module):
        """lev's candidate head: projections, set attention over the candidates, norm, score."""

        def __init__(self, hidden_size: int, proj_dim: int) -> None:
            super().__init__()
            self.question_proj = nn.Linear(hidden_size, proj_dim, bias=False)
            self.candidate_proj = nn.Linear(hidden_size, proj_dim, bias=False)
            self.set_attention = nn.MultiheadAttention(proj_dim, HEAD_HEADS, batch_first=True, dropout=0.0)
            self.norm = nn.LayerNorm(proj_dim)
            self.score = nn.Linear(proj_dim, 1, bias=False)

        def forward(self, question: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
            """Scores (B, K) from a question state (B, H) and candidate states (B, K, H)."""
            q = self.question_proj(question).unsqueeze(1)
            c = self.candidate_proj(candidates)
            attended, _ = self.set_attention(c, c, c)
            return self.score(self.norm(attended + q)).squeeze(-1)

    return LevHead


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LevReleaseError(str(path), None, "missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LevReleaseError(str(path), None, f"is not readable JSON ({exc})") from None


def _base_geometry(model: Any) -> tuple[dict[str, Any], int]:
    """The base's linear modules by path, and its hidden size."""
    from torch import nn

    linears = {name: module for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    return linears, int(model.config.hidden_size)


def _check_adapter_config(config: Any, file: str, manifest: LevManifest, base_name: str | None) -> dict:
    if not isinstance(config, dict):
        raise LevReleaseError(file, None, "must be a JSON object")
    if config.get("peft_type") != "LORA":
        raise LevReleaseError(file, "peft_type", f"must be 'LORA', not {config.get('peft_type')!r}")
    for key, plain in _UNSUPPORTED_CONFIG.items():
        if config.get(key) not in (plain, [], {}):
            raise LevReleaseError(
                file, key, f"{config.get(key)!r} is not plain LoRA; only plain LoRA is served"
            )
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LevReleaseError(file, key, "per-module ranks or alphas are not served; it must be empty")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1):
        raise LevReleaseError(file, "r", f"must be a positive integer, not {r!r}")
    if not (isinstance(alpha, int | float) and not isinstance(alpha, bool) and math.isfinite(alpha)):
        raise LevReleaseError(file, "lora_alpha", f"must be a finite number, not {alpha!r}")
    named = config.get("base_model_name_or_path")
    if named != manifest.base_model:
        raise LevReleaseError(
            file,
            "base_model_name_or_path",
            f"{named!r} differs from {MANIFEST_FILE} base_model {manifest.base_model!r}",
        )
    if base_name is not None and manifest.base_model != base_name:
        raise LevReleaseError(
            file.replace(ADAPTER_CONFIG_FILE, MANIFEST_FILE),
            "base_model",
            f"the release is for {manifest.base_model!r}; this service's base is {base_name!r}",
        )
    if manifest.lora_rank is not None and manifest.lora_rank != r:
        raise LevReleaseError(
            file.replace(ADAPTER_CONFIG_FILE, MANIFEST_FILE),
            "lora_rank",
            f"{manifest.lora_rank} differs from {ADAPTER_CONFIG_FILE} r {r}",
        )
    return config


def _lora_modules(
    weights: Mapping[str, Any], config: dict, scale: float, model: Any, file: str
) -> tuple[LoraModule, ...]:
    """Pair every lora_A with its lora_B and check both against the base module's shape."""
    linears, _ = _base_geometry(model)
    r = int(config["r"])
    scaling = float(config["lora_alpha"]) / (math.sqrt(r) if config.get("use_rslora") else r) * scale
    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in weights.items():
        for part in ("lora_A", "lora_B"):
            tail = f".{part}.weight"
            if key.startswith(PEFT_PREFIX) and key.endswith(tail):
                pairs.setdefault(key[len(PEFT_PREFIX) : -len(tail)], {})[part] = tensor
                break
        else:
            raise LevReleaseError(
                file, key, "is not a LoRA A or B weight of a base module (only plain LoRA is served)"
            )
    if not pairs:
        raise LevReleaseError(file, None, "holds no LoRA weights")
    modules = []
    for name in sorted(pairs):
        parts = pairs[name]
        for part in ("lora_A", "lora_B"):
            if part not in parts:
                raise LevReleaseError(
                    file, f"{PEFT_PREFIX}{name}.{part}.weight", "missing (each module needs A and B)"
                )
        module = linears.get(name)
        if module is None:
            raise LevReleaseError(
                file, f"{PEFT_PREFIX}{name}.lora_A.weight", f"the base has no linear module {name!r}"
            )
        a, b = parts["lora_A"], parts["lora_B"]
        want_a, want_b = (r, module.in_features), (module.out_features, r)
        for part, tensor, want in (("lora_A", a, want_a), ("lora_B", b, want_b)):
            if tuple(tensor.shape) != want:
                raise LevReleaseError(
                    file,
                    f"{PEFT_PREFIX}{name}.{part}.weight",
                    f"shape {tuple(tensor.shape)} does not fit the base's {name} (needs {want})",
                )
            if not bool(tensor.isfinite().all()):
                raise LevReleaseError(file, f"{PEFT_PREFIX}{name}.{part}.weight", "holds a non-finite value")
        modules.append(LoraModule(name, a, b, scaling))
    return tuple(modules)


def _load_head(path: Path, hidden_size: int) -> Any:
    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise LevReleaseError(str(path), None, f"is not a readable torch state dict ({exc})") from None
    if not isinstance(state, dict):
        raise LevReleaseError(str(path), None, "must hold a state dict")
    proj = state.get("question_proj.weight")
    if proj is None or getattr(proj, "ndim", 0) != 2:
        raise LevReleaseError(str(path), "question_proj.weight", "missing or not a matrix")
    proj_dim, width = (int(d) for d in proj.shape)
    if width != hidden_size:
        raise LevReleaseError(
            str(path), "question_proj.weight", f"reads hidden size {width}; the base's is {hidden_size}"
        )
    if proj_dim % HEAD_HEADS:
        raise LevReleaseError(
            str(path),
            "question_proj.weight",
            f"projection {proj_dim} is not divisible by lev's {HEAD_HEADS} heads",
        )
    head = _head_class()(hidden_size, proj_dim)
    expected = head.state_dict()
    for key in state:
        if key not in expected:
            raise LevReleaseError(str(path), key, "is not a parameter of lev's candidate head")
    for key, tensor in expected.items():
        got = state.get(key)
        if got is None:
            raise LevReleaseError(str(path), key, "missing")
        if tuple(got.shape) != tuple(tensor.shape):
            raise LevReleaseError(str(path), key, f"shape {tuple(got.shape)}, needs {tuple(tensor.shape)}")
        if not bool(got.isfinite().all()):
            raise LevReleaseError(str(path), key, "holds a non-finite value")
    head.load_state_dict(state, strict=True)
    return head.to(dtype=torch.float32).eval()


def label_codes_for(tokenizer: Any, prefix: str) -> LevCodes:
    """For every code of lev's scheme, its one token after `prefix`, or None where it splits."""
    texts = [prefix + code for code in all_codes()]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    ids = tuple(row[0] if len(row) == 1 else None for row in encoded)
    assert len(ids) == CODE_COUNT
    return LevCodes(prefix, ids)


def _same_files(directory: Path, base_dir: Path | None) -> bool:
    """Whether the release's tokenizer files are byte for byte the base's (then it is the base's)."""
    if base_dir is None:
        return False
    names = {p.name for p in directory.glob("tokenizer*")} | {p.name for p in base_dir.glob("tokenizer*")}
    return all(
        (directory / n).is_file()
        and (base_dir / n).is_file()
        and (directory / n).read_bytes() == (base_dir / n).read_bytes()
        for n in names
    )


def _load_tokenizer(directory: Path, base_tokenizer: Any, base_dir: Path | None, vocab_rows: int) -> Any:
    if not (directory / TOKENIZER_FILE).is_file() or _same_files(directory, base_dir):
        return base_tokenizer  # as lev: the base's tokenizer when the release ships none
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:
        raise LevReleaseError(str(directory / TOKENIZER_FILE), None, f"does not load ({exc})") from None
    if len(tokenizer) > vocab_rows:
        raise LevReleaseError(
            str(directory / TOKENIZER_FILE),
            None,
            f"has {len(tokenizer)} tokens; the base embeds {vocab_rows}",
        )
    return tokenizer


def load_lev_release(
    directory: Path | str,
    model: Any,
    base_tokenizer: Any,
    *,
    base_name: str | None = None,
    prompt_style: str | None = None,
    noul_readout: str | None = None,
    score_order_average: str = "off",
    max_label_options: int | None = None,
    settings_source: str = "settings",
    base_directory: Path | None = None,
    adapter_scale: float | None = None,
) -> LevRelease:
    """Read a lev release for the base `model` (its causal LM); refuse what cannot be read exactly.

    `base_name` is the service's base model name (compared with the manifest's `base_model`);
    the keyword settings are lev's server flags (`settings_source` names where they came from in
    errors). `base_directory` (the base checkpoint) lets a release whose tokenizer files are the
    base's own reuse `base_tokenizer` instead of loading them again. `adapter_scale` is the
    operator's serving multiplier; it replaces the manifest's `adapter_scale` (None: the
    manifest's, 1.0 where it has none). Tensors stay on the CPU.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    if not directory.is_dir():
        raise LevReleaseError(str(directory), None, "is not a directory")
    manifest_path = directory / MANIFEST_FILE
    manifest = parse_manifest(_read_json(manifest_path), str(manifest_path))
    for i, name in enumerate(manifest.files or ()):
        if not (directory / name).is_file():
            raise LevReleaseError(
                str(manifest_path), f"files[{i}]", f"lists {name!r}, which the release lacks"
            )
    for key, flag, file in (
        ("mode_b_head", manifest.mode_b_head, HEAD_FILE),
        ("calibrated", manifest.calibrated, CALIBRATION_FILE),
    ):
        if flag and not (directory / file).is_file():
            raise LevReleaseError(str(manifest_path), key, f"is true, and the release has no {file}")
    options = serving_options(
        manifest,
        prompt_style=prompt_style,
        noul_readout=noul_readout,
        score_order_average=score_order_average,
        max_label_options=max_label_options,
        source=settings_source,
    )
    config_path = directory / ADAPTER_CONFIG_FILE
    config = _check_adapter_config(_read_json(config_path), str(config_path), manifest, base_name)
    weights_path = directory / ADAPTER_WEIGHTS_FILE
    if not weights_path.is_file():
        raise LevReleaseError(str(weights_path), None, "missing")
    try:
        weights = load_file(str(weights_path))
    except Exception as exc:
        raise LevReleaseError(
            str(weights_path), None, f"is not a readable safetensors file ({exc})"
        ) from None
    if adapter_scale is not None and not (math.isfinite(adapter_scale) and adapter_scale > 0):
        raise LevReleaseError(settings_source, "scale", f"must be a finite number > 0, not {adapter_scale!r}")
    scale = adapter_scale if adapter_scale is not None else (manifest.adapter_scale or 1.0)
    modules = _lora_modules(weights, config, scale, model, str(weights_path))
    _, hidden_size = _base_geometry(model)
    head_path = directory / HEAD_FILE
    head = _load_head(head_path, hidden_size) if head_path.is_file() else None  # lev: loaded when present
    calibration_path = directory / CALIBRATION_FILE
    calibration = (
        parse_calibration(_read_json(calibration_path), str(calibration_path))
        if calibration_path.is_file()
        else UNCALIBRATED
    )
    vocab_rows = int(model.get_input_embeddings().weight.shape[0])
    tokenizer = _load_tokenizer(directory, base_tokenizer, base_directory, vocab_rows)
    return LevRelease(
        directory=directory,
        manifest=manifest,
        options=options,
        adapter_config=config,
        adapter_weights=weights,
        adapter_scale=scale,
        modules=modules,
        head=head,
        calibration=calibration,
        tokenizer=tokenizer,
        codes=label_codes_for(tokenizer, options.label_prefix),
    )


def base_release(
    directory: Path, base_tokenizer: Any, *, base_name: str, settings_source: str = "settings", **flags: Any
) -> LevRelease:
    """The frozen base read with lev's method, as lev's server reads it without a checkpoint
    (`lev serve --model`): lev's prompt, label codes and orders over the base's own weights and
    tokenizer, no adapter, no candidate head, every temperature 1.0. `directory` is the base
    checkpoint; `flags` are lev's server flags, as `load_lev_release` takes them (`prompt_style`,
    `noul_readout`, `score_order_average`, `max_label_options`)."""
    manifest = LevManifest(base_name, None, None, None, None, False, False, None, None)
    options = serving_options(manifest, source=settings_source, **flags)
    return LevRelease(
        directory=Path(directory),
        manifest=manifest,
        options=options,
        adapter_config={},
        adapter_weights={},
        adapter_scale=1.0,
        modules=(),
        head=None,
        calibration=UNCALIBRATED,
        tokenizer=base_tokenizer,
        codes=label_codes_for(base_tokenizer, options.label_prefix),
    )


def served_release(release: LevRelease, model: Any) -> LevRelease:
    """The release as the serving engine holds it: its head on the base's device (float32, moved
    once at startup, so a request copies nothing and the memory baseline counts it), its LoRA
    matrices and saved tensors dropped: the engine's AdapterBank holds the adapter's one copy
    (`score_lev_on` reads through it; `lora_applied` and `score_lev` need the loaded release)."""
    head = release.head
    if head is not None:
        head = head.to(device=next(model.parameters()).device)
    return replace(release, modules=(), adapter_weights={}, head=head)


@contextmanager
def lora_applied(model: Any, release: LevRelease) -> Iterator[None]:
    """The release's adapter on `model` for the duration: each adapted module's output gains
    `scaling * B (A x)`; the base weights are never changed, so the base still serves."""
    modules = dict(model.named_modules())
    handles = []

    def hook_for(lora: LoraModule, weight: Any) -> Any:
        a = lora.a.to(device=weight.device, dtype=weight.dtype)
        b = lora.b.to(device=weight.device, dtype=weight.dtype)

        def hook(_module: Any, inputs: tuple, output: Any) -> Any:
            x = inputs[0]
            return output + (x.to(a.dtype) @ a.T @ b.T * lora.scaling).to(output.dtype)

        return hook

    try:
        for lora in release.modules:
            target = modules[lora.name]
            handles.append(target.register_forward_hook(hook_for(lora, target.weight)))
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class LevReply:
    """One request's answers with one release, and lev's token counts."""

    answers: dict[str, LevAnswer]
    input_tokens: int  # the prefix once, plus every row's suffix
    cached_input_tokens: int  # the prefix
    timing: BatchTiming | None = None  # how the engine ran the rows (`score_lev_on`; None per row)


def score_lev(release: LevRelease, model: Any, state: Any, questions: Mapping[str, LevQuestion]) -> LevReply:
    """Answer `questions` about `state` with `release` over the base `model`, as lev's server does:
    each row the prefix (encoded with special tokens) joined to its suffix (without), one full
    forward per row with the adapter applied, the label logits or the head at the last token."""
    import torch

    plan = plan_request(state, questions, release.codes, release.options, has_head=release.head is not None)
    tokenizer = release.tokenizer
    prefix_ids = tokenizer.encode(plan.prefix, add_special_tokens=True)
    suffixes = [tokenizer.encode(row.suffix, add_special_tokens=False) for row in plan.rows]
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    device = next(model.parameters()).device
    scores: list[list[float]] = []
    with torch.no_grad(), lora_applied(model, release):
        candidates = _candidate_states(plan, tokenizer, decoder, device)
        for row, suffix_ids in zip(plan.rows, suffixes, strict=True):
            ids = torch.tensor([prefix_ids + suffix_ids], device=device)
            last = decoder(input_ids=ids, use_cache=False).last_hidden_state[0, -1]
            if row.label_ids is not None:
                logits = lm_head(last.unsqueeze(0))[0]
                scores.append(logits[list(row.label_ids)].float().tolist())
            else:
                head = release.head.to(device)  # type: ignore[union-attr]
                read = head(last.float().unsqueeze(0), candidates[row.question_id].float().unsqueeze(0))
                scores.append(read[0].float().tolist())
    answers = read_plan(plan, scores, release.calibration)
    return LevReply(answers, len(prefix_ids) + sum(len(s) for s in suffixes), len(prefix_ids))


def score_lev_on(
    release: LevRelease, engine: Any, model: int, state: Any, questions: Mapping[str, LevQuestion]
) -> LevReply:
    """`score_lev`'s answers through the serving engine (a `TorchEngine` whose adapter bank
    serves the release's adapter as `model`): the same prefix and suffix ids, the prefix
    prefilled once (kept in the state cache under the release's model where it is long enough)
    and the rows batched over it (`TorchEngine.read_ids`); equal to lev's per-row forwards
    within float32's rounding (the tests hold both to PEFT's own forward, 1e-5)."""
    plan = plan_request(state, questions, release.codes, release.options, has_head=release.head is not None)
    tokenizer = release.tokenizer
    prefix_ids = tokenizer.encode(plan.prefix, add_special_tokens=True)
    suffixes = [tokenizer.encode(row.suffix, add_special_tokens=False) for row in plan.rows]
    scores: list[list[float]] = [[] for _ in plan.rows]
    by_labels = [i for i, row in enumerate(plan.rows) if row.label_ids is not None]
    by_head = [i for i, row in enumerate(plan.rows) if row.label_ids is None]
    runs: list[BatchTiming] = []
    # One decision for all the request's rows (label rows and head rows run apart).
    shared = engine.shares_prefix(prefix_ids, model, len(suffixes), max(len(s) for s in suffixes))
    if by_labels:
        read = sorted({t for i in by_labels for t in plan.rows[i].label_ids or ()})  # never the vocabulary
        column = {token: at for at, token in enumerate(read)}
        logits = engine.read_ids(
            prefix_ids, [suffixes[i] for i in by_labels], model, columns=read, runs=runs, shared=shared
        )
        for k, i in enumerate(by_labels):
            scores[i] = logits[k, [column[t] for t in plan.rows[i].label_ids or ()]].float().tolist()
    if by_head:
        heads = head_scores(release, engine, model, plan, prefix_ids, suffixes, by_head, runs, shared)
        for i, got in zip(by_head, heads, strict=True):
            scores[i] = got
    answers = read_plan(plan, scores, release.calibration)
    return LevReply(answers, len(prefix_ids) + sum(len(s) for s in suffixes), len(prefix_ids), joined(runs))


def head_scores(
    release: LevRelease,
    engine: Any,
    model: int,
    plan: LevPlan,
    prefix_ids: list[int],
    suffixes: Sequence[Sequence[int]],
    rows: Sequence[int],
    runs: list[BatchTiming],
    shared: bool | None = None,
) -> list[list[float]]:
    """Mode B's scores of the plan's `rows` (the candidate head over each row's last hidden state
    and the candidates' states), on the engine thread; how they ran appended to `runs`."""
    import torch

    last = engine.read_ids(
        prefix_ids, [suffixes[i] for i in rows], model, hidden=True, runs=runs, shared=shared
    )
    decoder = engine.model.get_decoder()
    scores = []
    with torch.inference_mode(), engine.adapters.rows(model):
        candidates = _candidate_states(plan, release.tokenizer, decoder, engine.device)
        head = release.head.to(engine.device)  # type: ignore[union-attr]
        for k, i in enumerate(rows):
            shown = candidates[plan.rows[i].question_id].float().unsqueeze(0)
            scores.append(head(last[k].float().unsqueeze(0), shown)[0].float().tolist())
    return scores


def joined(runs: Sequence[BatchTiming]) -> BatchTiming:
    """One request's timing from its reads (label rows and head rows run apart): seconds, rows,
    tokens and forwards added up; the prefix and where it came from, of the read that ran over it."""
    over = [run for run in runs if run.prefill != "none"] or list(runs)
    return BatchTiming(
        prefix_tokens=max(run.prefix_tokens for run in runs),
        prefill_seconds=sum(run.prefill_seconds for run in runs),
        replicate_seconds=sum(run.replicate_seconds for run in runs),
        suffix_forward_seconds=sum(run.suffix_forward_seconds for run in runs),
        batch_size=sum(run.batch_size for run in runs),
        true_suffix_tokens=sum(run.true_suffix_tokens for run in runs),
        padded_suffix_tokens=sum(run.padded_suffix_tokens for run in runs),
        forward_batches=sum(run.forward_batches for run in runs),
        prefill=over[0].prefill,
    )


def _candidate_states(plan: LevPlan, tokenizer: Any, decoder: Any, device: Any) -> dict[str, Any]:
    """Mode B's candidate states as lev computes them: the candidate strings as one padded batch
    (each cut at 64 tokens, no special tokens), the decoder's last state at each last real token."""
    import torch

    states: dict[str, Any] = {}
    for qid, question in plan.questions.items():
        if plan.routes[qid].mode != "B":
            continue
        encoded = tokenizer(
            list(candidate_texts(question)),
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=CANDIDATE_MAX_TOKENS,
            add_special_tokens=False,
        )
        ids, mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
        hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        last = mask.sum(dim=1).long() - 1
        states[qid] = hidden[torch.arange(hidden.size(0), device=device), last]
    return states
