"""A simulated CUDA device for running GPU-only code on the CPU: `torch.cuda`'s calls with their
real argument checks over a simulated caching allocator, and a model whose forwards allocate in it.

Only what cannot exist here is simulated (the card, its allocator, its out-of-memory event); the
model, the service and the tensors are real and live on the CPU. The argument checks follow
torch 2.10's `torch/cuda/memory.py` and `torch/cuda/__init__.py`: a fraction must be a `float`
in [0, 1], a device an int, "cuda[:i]" or a cuda `torch.device`, and its index in range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class Properties:
    """The fields of `torch.cuda.get_device_properties` the code reads."""

    name: str
    total_memory: int
    major: int = 9
    minor: int = 0
    multi_processor_count: int = 132


class SimulatedCuda:
    """`torch.cuda` for one simulated card.

    The allocator keeps `allocated` and `reserved` bytes like PyTorch's caching allocator: freed
    blocks stay reserved until `empty_cache`; an allocation that would take reserved memory past
    the per-process fraction first returns the cached blocks, then raises
    `torch.cuda.OutOfMemoryError` (the real class) if allocated memory alone would pass it.

    A tracked model's decoder forward over `rows` rows of `q` new tokens after `past` cached ones
    allocates `rows * (row_bytes + (past + q) * token_bytes)` for its duration; a tracked vision
    tower's forward over `patches` patches, `patches * patch_bytes`.
    """

    OutOfMemoryError = torch.cuda.OutOfMemoryError

    def __init__(
        self,
        total_memory: int = 141 * GIB,
        name: str = "Simulated NVIDIA H200",
        row_bytes: int = MIB,
        token_bytes: int = 8 * 1024,
        patch_bytes: int = 4 * 1024,
    ) -> None:
        self.properties = Properties(name, total_memory)
        self.fraction = 1.0
        self.allocated = 0
        self.reserved = 0
        self.peak_reserved = 0
        self.peak_allocated = 0
        self.row_bytes = row_bytes
        self.token_bytes = token_bytes
        self.patch_bytes = patch_bytes
        self.out_of_memory_events = 0
        self.empty_cache_calls = 0
        self.forwards: list[tuple[int, int, int]] = []

    # -- torch.cuda's calls

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return 0

    def get_device_properties(self, device=None) -> Properties:
        self._index(device)
        return self.properties

    def set_per_process_memory_fraction(self, fraction, device=None) -> None:
        self._index(device)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fraction = fraction

    def memory_reserved(self, device=None) -> int:
        self._index(device)
        return self.reserved

    def memory_allocated(self, device=None) -> int:
        self._index(device)
        return self.allocated

    def max_memory_reserved(self, device=None) -> int:
        self._index(device)
        return self.peak_reserved

    def max_memory_allocated(self, device=None) -> int:
        self._index(device)
        return self.peak_allocated

    def reset_peak_memory_stats(self, device=None) -> None:
        self._index(device)
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1
        self.reserved = self.allocated

    def synchronize(self, device=None) -> None:
        self._index(device)

    # -- the simulated allocator

    @property
    def limit(self) -> int:
        return int(self.fraction * self.properties.total_memory)

    def allocate(self, nbytes: int) -> None:
        if self.allocated + nbytes > self.limit:
            self.out_of_memory_events += 1
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {nbytes / MIB:.2f} MiB (simulated; "
                f"{self.allocated / MIB:.2f} MiB allocated, limit {self.limit / MIB:.2f} MiB)"
            )
        if max(self.reserved, self.allocated + nbytes) > self.limit:
            self.empty_cache()  # the cached blocks go back before an allocation fails
        self.allocated += nbytes
        self.reserved = max(self.reserved, self.allocated)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def forward_bytes(self, rows: int, past: int, new: int) -> int:
        return rows * (self.row_bytes + (past + new) * self.token_bytes)

    def track(self, model) -> None:
        """Account the model's weights, and allocate each decoder forward's working set."""
        self.allocate(sum(p.numel() * p.element_size() for p in model.parameters()))
        decoder = model.get_decoder()
        live: list[int] = []

        def before(module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is None:  # a prefix fed as embeddings (the image path)
                ids = kwargs["inputs_embeds"]
            cache = kwargs.get("past_key_values")
            past = int(cache.get_seq_length()) if cache is not None else 0
            rows, new = ids.shape[:2]
            self.forwards.append((rows, past, new))
            nbytes = self.forward_bytes(rows, past, new)
            self.allocate(nbytes)
            live.append(nbytes)

        def after(module, args, kwargs, output):
            if live:
                self.free(live.pop())

        decoder.register_forward_pre_hook(before, with_kwargs=True)
        decoder.register_forward_hook(after, with_kwargs=True, always_call=True)
        self._track_packed(model)

    def _track_packed(self, model) -> None:
        """Allocate each packed forward's working set too (it runs the decoder's layers itself):
        every sequence's row bytes and its whole chain's tokens."""
        from semif_serve.engine.lanes import ForwardLanes

        real = ForwardLanes.forward

        def packed_forward(lanes, over, segments, adapters=None):
            if over is not model:
                return real(lanes, over, segments, adapters)
            chains: list[int] = []
            for segment in segments:
                before = chains[segment.parent] if segment.parent is not None else len(segment.start or ())
                chains.append(before + len(segment.ids))
            self.forwards.append((len(segments), 0, sum(len(s.ids) for s in segments)))
            nbytes = sum(self.forward_bytes(1, 0, chain) for chain in chains)
            self.allocate(nbytes)
            try:
                return real(lanes, over, segments, adapters)
            finally:
                self.free(nbytes)

        ForwardLanes.forward = packed_forward  # type: ignore[method-assign]

    def track_vision(self, tower) -> None:
        """Account a vision tower's weights, and allocate `patches * patch_bytes` for each of its
        forwards (over the `[patches, ...]` pixel values it is given)."""
        self.allocate(sum(p.numel() * p.element_size() for p in tower.parameters()))
        live: list[int] = []

        def before(module, args, kwargs):
            pixels = kwargs.get("hidden_states", args[0] if args else None)
            nbytes = int(pixels.shape[0]) * self.patch_bytes
            self.allocate(nbytes)
            live.append(nbytes)

        def after(module, args, kwargs, output):
            if live:
                self.free(live.pop())

        tower.register_forward_pre_hook(before, with_kwargs=True)
        tower.register_forward_hook(after, with_kwargs=True, always_call=True)

    # -- torch's device-index rules

    def _index(self, device) -> int:
        if device is None:
            return 0
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            index = 0 if device.index is None else device.index
        elif isinstance(device, int) and not isinstance(device, bool):
            index = device
        else:
            raise ValueError(
                f"Expected a torch.device with a specified index or an integer, but got:{device}"
            )
        if index < 0 or index >= self.device_count():
            raise AssertionError("Invalid device id")
        return index
