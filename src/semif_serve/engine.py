"""The engine: loads the checkpoint, and scores rows (one question + ordered options) over a state.

A row's score is SemIf's readout: the full-vocabulary logits at the last prompt position,
in float32, restricted to the answer slots. Rows that share a state run through one path:
prefill the state prefix once, replicate its cache over the rows, run every suffix in one
right-padded forward and read each row at its last real position, whose
hidden state alone goes through the vocabulary projection.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .domain import BatchTiming, DecisionError, PromptRow, TooLargeForMemory
from .memory import CudaMemory, DeviceMemory, HostMemory, MemoryEstimate
from .prompt import EncodedPrompt, PromptCodec
from .settings import ConfigurationError, Settings

log = logging.getLogger("semif_serve.engine")

QWEN35_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
DIRECT_READOUT = "native full-vocabulary last-position logits restricted to declared answer slots"
SHARED_READOUT = "native selected suffix-position logits"
SHARED_SERVING_CONFIG = "native-state-prefix-parallel-v1"
DEMO_NOTE = "random weights: the answers carry no meaning"


class CheckpointError(Exception):
    """The checkpoint cannot be served as it is; the message says why."""


@dataclass(frozen=True)
class ModelIdentity:
    """What results and /health report about the loaded model; `demo` is the one truth for demo."""

    source: str
    revision: str
    dtype: str
    device: str
    demo: bool

    def as_dict(self) -> dict[str, str]:
        """The `model` block of every result, keys in upstream's order."""
        info = {
            "source": self.source,
            "revision": self.revision,
            "dtype": self.dtype,
            "device": self.device,
            "torch_version": _torch_version(),
            "transformers_version": _transformers_version(),
        }
        if self.demo:
            info["demo"] = DEMO_NOTE
        return info


@dataclass(frozen=True)
class RowReadout:
    """SemIf's readout of one row."""

    option_logits: list[float]
    probabilities: list[float]
    input_tokens: int
    prompt_sha256: str


@dataclass(frozen=True)
class Readout:
    """The readouts of a batch of rows, in order, and how they were computed."""

    rows: list[RowReadout]
    shared: bool
    forward_seconds: float
    total_seconds: float
    timing: BatchTiming | None  # None on the direct path


def checkpoint_tensor_names(directory: Path) -> list[str]:
    """Every tensor name stored in the directory's safetensors files."""
    from safetensors import safe_open

    names: list[str] = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            names.extend(fh.keys())
    return names


class TorchEngine:
    """A loaded model and tokenizer that reads rows; owned by one worker thread.

    `headroom_bytes` (bytes between the warm baseline and the cap; None where the device has
    no cap or splitting is off) decides when a shared batch is split across forwards.
    """

    def __init__(
        self,
        model: Any,
        codec: PromptCodec,
        identity: ModelIdentity,
        memory: DeviceMemory,
        headroom_bytes: int | None = None,
        skipped_tensors: int = 0,
    ) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.codec = codec
        self.identity = identity
        self.memory = memory
        self.headroom_bytes = headroom_bytes
        self.skipped_tensors = skipped_tensors
        self.device = torch.device(identity.device)
        self.slot_ids = torch.tensor(codec.slots, device=self.device)
        self.decoder = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.estimate = MemoryEstimate(model.config, torch.tensor([], dtype=model.dtype).element_size())
        tokenizer = codec.tokenizer
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (tokenizer.eos_token_id or 0)
        self.model_info = identity.as_dict()

    def with_memory(self, memory: DeviceMemory, headroom_bytes: int | None = None) -> TorchEngine:
        """The same weights and codec on another memory view and headroom (a new engine)."""
        return TorchEngine(
            self.model, self.codec, self.identity, memory, headroom_bytes, self.skipped_tensors
        )

    @classmethod
    def load(cls, settings: Settings, memory: DeviceMemory | None = None) -> TorchEngine:
        """Load a local Qwen3.5 checkpoint; refuse anything that cannot be served faithfully.

        Never downloads. Requires a revision string; checks the architecture and the device;
        refuses missing or mismatched weights and loader errors; skips the multimodal
        checkpoint's unused vision and MTP weights (logged once). A checkpoint with DEMO.json
        is a demo model whatever SEMIF_DEMO says. The tokenizer's answer codes (alphabet.py) are
        computed here; the first 16 are always A..P, so native prompts never change.
        """
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForCausalLM

        directory = settings.require_model()
        if memory is None:
            memory = _device_memory(settings, torch)
        if isinstance(memory, CudaMemory):
            memory.apply_cap()
        try:
            config = AutoConfig.from_pretrained(
                str(directory), local_files_only=True, trust_remote_code=False
            )
        except Exception as exc:
            raise CheckpointError(f"cannot read {directory}/config.json: {exc}") from None
        model_cls: Any
        if config.model_type in QWEN35_MODEL_TYPES:
            model_cls, model_config = Qwen3_5ForCausalLM, config.get_text_config()
        elif settings.allow_any_architecture:
            model_cls, model_config = AutoModelForCausalLM, config
        else:
            raise CheckpointError(
                f"model_type {config.model_type!r} is not a Qwen3.5 text model; set "
                "SEMIF_ALLOW_ANY_ARCHITECTURE=true to serve it anyway"
            )
        dtype = getattr(torch, settings.dtype or "float32")
        try:
            model, info = model_cls.from_pretrained(
                str(directory),
                config=model_config,
                dtype=dtype,
                local_files_only=True,
                trust_remote_code=False,
                output_loading_info=True,
                # Report wrong-shaped tensors in `mismatched_keys` (refused below, by name) instead
                # of transformers' bare "ignore_mismatched_sizes is False" error.
                ignore_mismatched_sizes=True,
            )
        except Exception as exc:
            raise CheckpointError(f"the checkpoint failed to load: {exc}") from None
        problems = {k: list(info.get(k) or []) for k in ("missing_keys", "mismatched_keys", "error_msgs")}
        if any(problems.values()):
            detail = "; ".join(f"{k}: {v[:5]}" for k, v in problems.items() if v)
            raise CheckpointError(f"the checkpoint is incomplete or mismatched ({detail})")
        used = sum(1 for _ in model.named_parameters())
        skipped = max(0, len(checkpoint_tensor_names(directory)) - used)
        if skipped:
            log.info("skipped %d checkpoint tensors the text model does not use", skipped)
        model.to(settings.device)
        model.eval()
        tokenizer = AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=False
        )
        assert settings.dtype is not None  # Settings fills the device's default
        identity = ModelIdentity(
            source=settings.model_source,
            revision=settings.model_revision,
            dtype=settings.dtype,
            device=settings.device,
            demo=settings.demo or (directory / "DEMO.json").exists(),
        )
        codec = PromptCodec(tokenizer)
        return cls(model, codec, identity, memory, skipped_tensors=skipped)

    # -- reading ------------------------------------------------------------------------------

    def score(self, state: Any, rows: Sequence[PromptRow], *, shared: bool, max_input_tokens: int) -> Readout:
        """Read rows over one state. `shared=False` with one row runs SemIf's plain forward;
        otherwise the state prefix is prefilled once and the rows run in right-padded batches
        (split where the memory headroom says one batch would not fit).

        Raises TooManyTokens, AnswerBoundary or TooLargeForMemory with `row` set to the
        position of the row concerned.
        """
        started = time.perf_counter()
        prompts = [self._encode(state, row, i, max_input_tokens) for i, row in enumerate(rows)]
        timing: BatchTiming | None = None
        if not shared and len(rows) == 1:
            readout, forward_seconds = self._direct(prompts[0].ids, len(rows[0].descriptions))
            per_row = [readout]
        else:
            prefix = shared_token_prefix(self.codec.state_prefix(state, prompts[0]), prompts)
            rows_per_forward = self._rows_that_fit(len(prefix), [p.ids for p in prompts])
            per_row, timing = self._shared(prefix, [p.ids for p in prompts], rows, rows_per_forward)
            forward_seconds = (
                timing.prefill_seconds + timing.replicate_seconds + timing.suffix_forward_seconds
            )
        total = time.perf_counter() - started
        readouts = [
            RowReadout(logits, probs, len(p.ids), p.sha256)
            for (logits, probs), p in zip(per_row, prompts, strict=True)
        ]
        return Readout(readouts, timing is not None, forward_seconds, total, timing)

    def _encode(self, state: Any, row: PromptRow, index: int, max_input_tokens: int) -> EncodedPrompt:
        try:
            return self.codec.encode_prompt(state, row.question, row.descriptions, max_input_tokens)
        except DecisionError as exc:
            exc.row = index
            raise

    def _rows_that_fit(self, n_prefix: int, prompts: list[list[int]]) -> int | None:
        """Split a batch that would not fit under the headroom; refuse one whose single row cannot."""
        if self.headroom_bytes is None:
            return None
        width = max(len(ids) for ids in prompts) - n_prefix
        fit = self.estimate.rows_per_forward(self.headroom_bytes, n_prefix, width)
        if fit == 0:
            need = self.estimate.prefill_bytes(n_prefix) + self.estimate.row_bytes(n_prefix, width)
            refusal = TooLargeForMemory(need, self.headroom_bytes)
            refusal.row = 0
            raise refusal
        return fit if fit < len(prompts) else None

    def _readout(self, last_logits: Any, n_options: int) -> tuple[list[float], list[float]]:
        """Full-vocabulary float32 logits of one position -> (slot logits, their softmax)."""
        option = last_logits.float()[self.slot_ids[:n_options]]
        return option.tolist(), self.torch.softmax(option, dim=-1).tolist()

    def _direct(self, ids: list[int], n_options: int) -> tuple[tuple[list[float], list[float]], float]:
        torch = self.torch
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device), use_cache=False, logits_to_keep=1
            )
            readout = self._readout(out.logits[0, -1], n_options)
        self.memory.synchronize()
        return readout, time.perf_counter() - t0

    def _shared(
        self,
        prefix: list[int],
        prompts: list[list[int]],
        rows: Sequence[PromptRow],
        rows_per_forward: int | None,
    ) -> tuple[list[tuple[list[float], list[float]]], BatchTiming]:
        torch = self.torch
        n_prefix = len(prefix)
        prefill_seconds = replicate_seconds = suffix_seconds = 0.0
        tokens = _SuffixTokens()
        batches = 0
        with torch.inference_mode():
            cache = None
            if n_prefix:
                t0 = time.perf_counter()
                cache = self.decoder(
                    input_ids=torch.tensor([prefix], device=self.device), use_cache=True
                ).past_key_values
                self.memory.synchronize()
                prefill_seconds = time.perf_counter() - t0
            step = rows_per_forward or len(prompts)
            results: list[tuple[list[float], list[float]]] = []
            for start in range(0, len(prompts), step):
                chunk = prompts[start : start + step]
                last = start + step >= len(prompts)
                t1 = time.perf_counter()
                batch_cache = None
                if cache is not None:
                    # The last chunk may consume the prefilled cache; earlier ones replicate a copy.
                    batch_cache = cache if last else copy.deepcopy(cache)
                    batch_cache.reorder_cache(torch.zeros(len(chunk), dtype=torch.long, device=self.device))
                self.memory.synchronize()
                t2 = time.perf_counter()
                results.extend(
                    self._suffix_forward(batch_cache, n_prefix, chunk, rows[start : start + step], tokens)
                )
                del batch_cache
                self.memory.synchronize()
                replicate_seconds += t2 - t1
                suffix_seconds += time.perf_counter() - t2
                batches += 1
            del cache
        timing = BatchTiming(
            prefix_tokens=n_prefix,
            prefill_seconds=prefill_seconds,
            replicate_seconds=replicate_seconds,
            suffix_forward_seconds=suffix_seconds,
            batch_size=len(prompts),
            true_suffix_tokens=tokens.true,
            padded_suffix_tokens=tokens.padded,
            forward_batches=batches,
        )
        return results, timing

    def _suffix_forward(
        self,
        cache: Any,
        n_prefix: int,
        chunk: list[list[int]],
        rows: Sequence[PromptRow],
        tokens: _SuffixTokens,
    ) -> list[tuple[list[float], list[float]]]:
        torch = self.torch
        suffixes = [ids[n_prefix:] for ids in chunk]
        lengths = [len(s) for s in suffixes]
        width = max(lengths)
        input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), n_prefix + width), dtype=torch.long)
        mask[:, :n_prefix] = 1
        for i, suffix in enumerate(suffixes):
            input_ids[i, : len(suffix)] = torch.tensor(suffix, dtype=torch.long)
            mask[i, n_prefix : n_prefix + len(suffix)] = 1
        positions = (torch.arange(width, dtype=torch.long) + n_prefix).expand(len(chunk), width)
        last = torch.tensor([n - 1 for n in lengths], device=self.device)
        hidden = self.decoder(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            position_ids=positions.to(self.device),
            past_key_values=cache,
            use_cache=cache is not None,
        ).last_hidden_state
        # Only each row's last real position goes through the vocabulary projection.
        logits = self.lm_head(hidden[torch.arange(len(chunk), device=self.device), last])
        del hidden
        readout = [self._readout(logits[i], len(row.descriptions)) for i, row in enumerate(rows)]
        tokens.true += sum(lengths)
        tokens.padded += width * len(chunk)
        return readout


@dataclass
class _SuffixTokens:
    """Real and padded suffix tokens counted across a batch's forwards."""

    true: int = 0
    padded: int = 0


def shared_token_prefix(state_prefix: list[int], prompts: Sequence[EncodedPrompt]) -> list[int]:
    """The tokens to prefill once: the state prefix, cut back to what every prompt starts with,
    then, for several rows, extended over whatever they all still share (the question, for
    the orderings of one decision). Any common token prefix is exact: the model is causal.

    Upstream's rule (drop the prefix's last token) covers a tokenizer that merges JSON
    punctuation into one token; one that merges deeper needs the cut-back. Every row keeps at
    least its last token, whose position is read.
    """
    limit = min(len(p.ids) for p in prompts) - 1
    length = min(len(state_prefix), limit)
    while length and any(p.ids[:length] != state_prefix[:length] for p in prompts):
        length -= 1
    if length < len(state_prefix):
        log.debug("state prefix cut from %d to %d tokens", len(state_prefix), length)
    first = prompts[0].ids
    if len(prompts) > 1 and length == len(state_prefix):
        while length < limit and all(p.ids[length] == first[length] for p in prompts):
            length += 1
    return first[:length]


def _device_memory(settings: Settings, torch: Any) -> DeviceMemory:
    if settings.device == "cpu":
        return HostMemory()
    if not torch.cuda.is_available():
        raise ConfigurationError("SEMIF_DEVICE=cuda but no CUDA device is visible")
    if torch.cuda.device_count() != 1:
        raise ConfigurationError(
            f"SEMIF_DEVICE=cuda needs exactly one visible GPU, found {torch.cuda.device_count()} "
            "(set CUDA_VISIBLE_DEVICES)"
        )
    return CudaMemory(settings.vram_cap_gib)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _torch_version() -> str:
    import torch

    return str(torch.__version__)
