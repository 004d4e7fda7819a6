"""Device memory behind one small interface: the hard cap, what is reserved, and the release policy.

`CudaMemory` is the only code that touches `torch.cuda`; the CPU tests drive the same
`ReleasePolicy` through a simulated allocator.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
from typing import Protocol

from semif_serve.domain.numerics import GIB
from semif_serve.domain.types import ConfigurationError, ImageTooLargeForMemory, TooLargeForMemory

log = logging.getLogger("semif_serve.memory")


class DeviceMemory(Protocol):
    """What the engine needs to know and do about its device's memory."""

    def cap_bytes(self) -> int | None:
        """The hard cap in bytes, or None where the device has none (CPU)."""

    def reserved_bytes(self) -> int:
        """Memory currently held by the process's allocator."""

    def release(self) -> None:
        """Return cached, unused memory to the device."""

    def synchronize(self) -> None:
        """Wait for queued device work, so timings measure it."""


class CudaMemory:
    """One CUDA device with a per-process memory fraction set before the weights load."""

    def __init__(self, cap_gib: float, cuda=None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self.cap_gib = cap_gib

    def apply_cap(self) -> float:
        """Turn the cap into `set_per_process_memory_fraction(cap / total)`; returns the fraction."""
        if not self.cap_gib > 0:
            raise ConfigurationError("SEMIF_VRAM_CAP_GIB must be > 0 (0 never means uncapped)")
        total = self._cuda.get_device_properties(0).total_memory
        cap = int(self.cap_gib * GIB)
        if cap > total:
            raise ConfigurationError(
                f"SEMIF_VRAM_CAP_GIB: {self.cap_gib} GiB is more than the card's {total / GIB:.2f} GiB"
            )
        fraction = cap / total
        self._cuda.set_per_process_memory_fraction(fraction, 0)
        return fraction

    def cap_bytes(self) -> int | None:
        return int(self.cap_gib * GIB)

    def reserved_bytes(self) -> int:
        return int(self._cuda.memory_reserved(0))

    def release(self) -> None:
        self._cuda.empty_cache()

    def synchronize(self) -> None:
        self._cuda.synchronize()


class HostMemory:
    """The CPU: no cap; 'reserved' is the resident set size; the allocator keeps its own pages."""

    def cap_bytes(self) -> int | None:
        return None

    def reserved_bytes(self) -> int:
        try:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def release(self) -> None:
        # glibc keeps freed pages; malloc_trim hands them back to the system.
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

    def synchronize(self) -> None:
        return None


class StateStore(Protocol):
    """What the release policy needs of the state cache: its budget, and dropping states."""

    budget_bytes: int

    def clear(self) -> int:
        """Drop every state; the bytes freed."""


class ReleasePolicy:
    """Gives a burst's memory back: after a request that left reserved memory past baseline +
    margin, and after every failure that is not a refusal of the request.

    The state cache's budget is part of the baseline (what the cache may hold is not a burst),
    and the cache is the first thing released after a failure: its states are dropped before
    the allocator's cached memory is returned.
    """

    def __init__(self, memory: DeviceMemory, margin_bytes: int, cache: StateStore | None = None) -> None:
        self.memory = memory
        self.margin_bytes = margin_bytes
        self.cache = cache
        self.baseline_bytes: int | None = None
        self.releases = 0
        self.cache_clears = 0

    def mark_baseline(self) -> int:
        """Record reserved memory after warm-up (released first, so it is the floor) plus the
        state cache's budget."""
        self._release()
        budget = self.cache.budget_bytes if self.cache is not None else 0
        self.baseline_bytes = self.memory.reserved_bytes() + budget
        return self.baseline_bytes

    def after_success(self) -> bool:
        """Release when the request left reserved memory above baseline + margin."""
        if self.baseline_bytes is None:
            return False
        if self.memory.reserved_bytes() > self.baseline_bytes + self.margin_bytes:
            self._release()
            return True
        return False

    def after_failure(self) -> None:
        """Drop the cached states, break the failed forward's reference cycles, then release;
        never raises."""
        if self.cache is not None and self.cache.clear():
            self.cache_clears += 1
        gc.collect()
        self._release()

    def _release(self) -> None:
        try:
            self.memory.release()
            self.releases += 1
        except Exception as exc:  # noqa: BLE001 - a failed release must not mask the request's error
            log.warning("memory release failed: %s", type(exc).__name__)


class MemoryEstimate:
    """Bytes a shared-path forward needs, from the model's geometry (see docs/memory.md).

    per row  = (cache_per_token + sdpa_copy_per_token) * (prefix + width) + state_per_row
               + act_per_token * min(width, chunk) + logits_per_row
    prefill  = 2 * (cache_per_token * prefix + state_per_row) + sdpa_copy_per_token * prefix
               + act_per_token * min(prefix, chunk)
    Each is multiplied by SAFETY, because the allocator rounds and fragments. Attention
    scores are not counted: the cap exists only on CUDA, where SDPA does not materialise them.
    `sdpa_copy_per_token`: with a mask (every suffix forward, every prefill chunk after the
    first) transformers' SDPA path repeats one layer's keys and values over the query heads.
    """

    SAFETY = 1.25

    def __init__(self, config, element_bytes: int) -> None:
        layer_types = list(
            getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        )
        n_full = layer_types.count("full_attention")
        n_linear = len(layer_types) - n_full
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cache_per_token = n_full * 2 * config.num_key_value_heads * head_dim * element_bytes
        # transformers' sdpa_attention_forward calls repeat_kv whenever a mask is passed: keys and
        # values of one layer copied from kv_heads to attention heads (GQA only without a mask).
        groups = config.num_attention_heads // config.num_key_value_heads
        self.sdpa_copy_per_token = (
            2 * config.num_attention_heads * head_dim * element_bytes if groups > 1 else 0
        )
        key_dim = getattr(config, "linear_num_key_heads", 0) * getattr(config, "linear_key_head_dim", 0)
        v_heads = getattr(config, "linear_num_value_heads", 0)
        v_dim = getattr(config, "linear_value_head_dim", 0)
        conv_dim = 2 * key_dim + v_heads * v_dim
        kernel = getattr(config, "linear_conv_kernel_dim", 4)
        recurrent = v_heads * getattr(config, "linear_key_head_dim", 0) * v_dim * 4  # float32 state
        self.state_per_row = n_linear * (conv_dim * kernel * element_bytes + recurrent)
        # One layer's working set per token: residual stream, MLP and linear-attention projections.
        self.act_per_token = element_bytes * (
            4 * config.hidden_size + 3 * config.intermediate_size + 2 * conv_dim
        )
        self.logits_per_row = config.vocab_size * (element_bytes + 4)
        self.element_bytes = element_bytes

    def row_bytes(self, prefix_tokens: int, width: int, chunk_tokens: int | None = None) -> int:
        """Estimated bytes one more row adds to a suffix forward (run `chunk_tokens` columns at
        a time past that width; None: all at once)."""
        step = min(width, chunk_tokens) if chunk_tokens else width
        raw = (
            (self.cache_per_token + self.sdpa_copy_per_token) * (prefix_tokens + width)
            + self.state_per_row
            + self.act_per_token * step
            + self.logits_per_row
        )
        return int(raw * self.SAFETY)

    def prefill_bytes(self, prefix_tokens: int, chunk_tokens: int | None = None) -> int:
        """Estimated bytes of prefilling the state prefix once, `chunk_tokens` per forward (None:
        all at once): the state, the copy a growing cache makes, a later chunk's SDPA key/value
        copy, one chunk's activations."""
        step = min(prefix_tokens, chunk_tokens) if chunk_tokens else prefix_tokens
        raw = (
            2 * (self.cache_per_token * prefix_tokens + self.state_per_row)
            + self.sdpa_copy_per_token * prefix_tokens
            + self.act_per_token * step
        )
        return int(raw * self.SAFETY)

    def rows_per_forward(
        self, headroom: int, prefix_tokens: int, width: int, chunk_tokens: int | None = None
    ) -> int:
        """How many rows fit in one suffix forward under `headroom` bytes (0: not even one)."""
        available = headroom - self.prefill_bytes(prefix_tokens, chunk_tokens)
        per_row = self.row_bytes(prefix_tokens, width, chunk_tokens)
        return max(0, available // per_row)

    # -- the headroom checks: whether a forward fits in the bytes between the warm floor and the cap

    def rows_under(
        self, headroom: int | None, prefix_tokens: int, width: int, chunk_tokens: int | None = None
    ) -> int | None:
        """Rows per suffix forward under `headroom` bytes (None: no cap, no limit); at least one."""
        if headroom is None:
            return None
        return max(1, self.rows_per_forward(headroom, prefix_tokens, width, chunk_tokens))

    def check_row(
        self, headroom: int | None, prefix_tokens: int, width: int, chunk_tokens: int | None, row: int
    ) -> None:
        """Refuse a request whose widest row (at position `row`) cannot fit under `headroom`."""
        if headroom is None or self.rows_per_forward(headroom, prefix_tokens, width, chunk_tokens) > 0:
            return
        need = self.prefill_bytes(prefix_tokens, chunk_tokens) + self.row_bytes(
            prefix_tokens, width, chunk_tokens
        )
        raise TooLargeForMemory(need, headroom, row=row)

    @staticmethod
    def check_tower(headroom: int | None, need_bytes: int, patches: int) -> None:
        """Refuse images whose largest needs `need_bytes` in the vision tower, more than `headroom`."""
        if headroom is not None and need_bytes > headroom:
            raise ImageTooLargeForMemory(need_bytes, headroom, patches)
