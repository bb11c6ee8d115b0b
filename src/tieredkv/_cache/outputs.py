"""Host memory for the tensors :meth:`~tieredkv.TieredKVCache.load` returns, reused once the
caller drops them.

A load into new tensors pays a page fault per 4 KiB of output the first time the copy
touches it: on this project's 2-core VM, 75 ms per 512 MiB, a fifth of the time the SSD
needs to deliver those bytes. A serving loop loads a history, uses it and drops it, turn
after turn, so the same amount of memory is faulted in again and again. Like a caching
allocator, this pool keeps the memory of dropped outputs (up to ``keep_bytes`` idle) and
gives it to the next load, already faulted in.

Each tensor still gets its own storage of exactly its size (``torch.save`` of one writes
that tensor, not its neighbours); the memory goes back to the pool when the last tensor or
view of that storage is gone, and never earlier.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import weakref
from collections import defaultdict

import torch

from ..backends._buffers import anonymous

__all__ = ["OutputPool", "POOLED_MIN_BYTES"]

POOLED_MIN_BYTES = 1 << 20
"""Outputs smaller than this come from ``torch.empty`` (the allocator's own reuse covers
them)."""


class OutputPool:
    """Reused, already-faulted host memory for new output tensors (see the module's doc).

    :param keep_bytes: the most idle memory kept for reuse (0: none, every output is a new
        ``torch.empty``)

    Thread-safe: memory comes back from whichever thread drops the last reference.
    """

    def __init__(self, keep_bytes: int) -> None:
        self._keep = keep_bytes
        self._free: defaultdict[int, list[mmap.mmap]] = defaultdict(list)
        self._idle = 0
        # re-entrant: the cyclic collector may free an output (and so call _give_back) in
        # the middle of the pool's own critical section, in the thread that holds it
        self._lock = threading.RLock()
        self._closed = False
        self.reused = 0
        """Outputs served from memory a dropped output left (for tests and metrics)."""

    @property
    def idle_bytes(self) -> int:
        """Memory kept for reuse now."""
        return self._idle

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous CPU tensor, on reused memory where there is some."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < POOLED_MIN_BYTES or self._keep <= 0:
            return torch.empty(shape, dtype=dtype)
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        with self._lock:
            free = self._free.get(size)
            mm = free.pop() if free else None
            if mm is not None:
                self._idle -= size
                self.reused += 1
        if mm is None:
            mm = anonymous(size)
        # the ctypes array is the object the tensor's storage keeps alive; when the storage
        # dies, so does the array, and the finalizer hands the mapping back
        owner = (ctypes.c_ubyte * size).from_buffer(mm)
        done = weakref.finalize(owner, self._give_back, mm)
        done.atexit = False  # at exit, a live tensor may still use it
        flat = torch.frombuffer(owner, dtype=torch.uint8, count=nbytes)
        return flat.view(dtype).view(shape)

    def _give_back(self, mm: mmap.mmap) -> None:
        # called while the dying array still holds its export of ``mm`` (weakref callbacks
        # run first): memory not kept is unmapped when that export and ``mm`` go, not here
        size = len(mm)
        with self._lock:
            if not self._closed and self._idle + size <= self._keep:
                self._free[size].append(mm)
                self._idle += size

    def open(self) -> None:
        """Keep dropped outputs' memory again (after :meth:`close`)."""
        with self._lock:
            self._closed = False

    def close(self) -> None:
        """Unmap the idle memory; memory still in use is unmapped when it is dropped."""
        with self._lock:
            self._closed = True
            free = [mm for mms in self._free.values() for mm in mms]
            self._free.clear()
            self._idle = 0
        for mm in free:
            mm.close()
