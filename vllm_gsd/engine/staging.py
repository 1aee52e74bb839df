"""Host-to-device staging of index arrays built on the host: one pinned, non-blocking copy.

A draft forward's inputs (token ids, positions, KV positions, batch rows, query starts, ...) and
the verification's tree arrays (draft tokens, parent rows, row indices) are built on the host.
Copied one by one from pageable memory, each copy makes the host wait for the stream (a pageable
host-to-device copy is synchronous). `HostStaging.stage` packs them into one int64 host buffer,
pinned where the device is CUDA, and copies it in one non-blocking copy into a fresh device
tensor (the caching allocator's: freed when its views are, in stream order), returning its views.

Host buffers are reused round-robin, so one is not written again before the stream has run its
last copy (a CUDA event a slot; the wait is almost never taken: a level's children are read
between two levels' forwards, and a level rarely needs more forwards than there are slots).
Each user keeps its own HostStaging (the drafter, the rejection sampler): one thread each. On
the CPU the host's arrays are the device's: a stage is one concatenation, no copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

NUM_SLOTS = 4
MIN_SLOT_ELEMENTS = 1 << 12

# Called with each stage's tensor (before it is split): the host-read counter
# (testing/host_reads.py) marks them device tensors, which they are on a GPU.
STAGED_HOOKS: list = []


class HostStaging:
    """Stages int and float arrays for one device; `pin_memory` where the platform allows it
    (vLLM's is_pin_memory_available). Where the device is the host (CPU), a stage is one
    concatenation and no copy, unless `copy` asks for the device path (tests)."""

    def __init__(self, device: torch.device | str, pin_memory: bool, copy: bool | None = None) -> None:
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.copy = self.device.type != "cpu" if copy is None else copy
        self.pin_memory = pin_memory and self.on_cuda
        self._host = [torch.empty(0, dtype=torch.int64) for _ in range(NUM_SLOTS)]
        self._copied: list[torch.cuda.Event | None] = [None] * NUM_SLOTS
        self._next = 0

    def stage(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """The arrays (flattened) as device tensors, in order: int arrays as int64, float arrays
        as float64 (their bits travel as int64)."""
        flat, sizes, is_float = [], [], []
        for array in arrays:
            array = np.asarray(array).reshape(-1)
            floating = array.dtype.kind == "f"
            flat.append(array.astype(np.float64).view(np.int64) if floating else array)
            sizes.append(array.size)
            is_float.append(floating)
        staged = self._copied_to_device(flat, sum(sizes)) if self.copy else \
            torch.from_numpy(np.concatenate(flat).astype(np.int64, copy=False))
        for hook in STAGED_HOOKS:
            hook(staged)
        return [t.view(torch.float64) if f else t for t, f in zip(staged.split(sizes), is_float)]

    def _copied_to_device(self, flat: list[np.ndarray], total: int) -> torch.Tensor:
        """One non-blocking copy of the arrays from this turn's (pinned) host buffer."""
        slot, self._next = self._next, (self._next + 1) % NUM_SLOTS
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()  # the stream has run this slot's last copy
            self._copied[slot] = None
        host = self._host[slot]
        if host.numel() < total:
            host = torch.empty(max(total, 2 * host.numel(), MIN_SLOT_ELEMENTS), dtype=torch.int64,
                               pin_memory=self.pin_memory)
            self._host[slot] = host
        if total:
            np.concatenate(flat, out=host.numpy()[:total], casting="unsafe")
        staged = torch.empty(total, dtype=torch.int64, device=self.device)
        staged.copy_(host[:total], non_blocking=True)
        if self.on_cuda:
            event = torch.cuda.Event()
            event.record()
            self._copied[slot] = event
        return staged
