"""Host memory for the tensors :meth:`~tieredkv.TieredKVCache.load` returns, reused once the
caller drops them, and turned into huge pages while it is idle.

A load into new tensors pays a page fault per 4 KiB of output the first time the copy
touches it: on this project's 2-core VM, 75 ms per 512 MiB, a fifth of the time the SSD
needs to deliver those bytes. A serving loop loads a history, uses it and drops it, turn
after turn, so the same amount of memory is faulted in again and again. Like a caching
allocator, this pool keeps the memory of dropped outputs (up to ``keep_bytes`` idle) and
gives it to the next load, already faulted in.

Each tensor still gets its own storage of exactly its size (``torch.save`` of one writes
that tensor, not its neighbours); the memory goes back to the pool when the last tensor or
view of that storage is gone, and never earlier.

**Huge pages, off the load's path.** The 4 KiB pages a load faults in are scattered over
physical memory, and an O_DIRECT read into scattered pages is cut into more device
requests (a request carries a bounded number of physically contiguous segments: 254 on
this VM's virtual disk). Measured on the 2-core VM (a ``/tmp`` probe, one cache, 12 loads
of 16 turns of 64 x 128 KiB from cold files, two processes each way, 4 December 2026):
loads into reused 4 KiB pages (176-223 physically contiguous runs per 2 MiB) took a median
of 92-95 ms; into the same memory collapsed into 2 MiB pages (1 run per 2 MiB), 51-64 ms.
Faulting huge pages in during a load made a new cache's first load 2-3x slower on that VM
(its balloon takes free 2 MiB blocks back, so a new huge page faults on the host too), so
no load waits for one: once an output's memory is idle in the pool, a background thread
asks the kernel to collapse it into huge pages (``madvise(MADV_COLLAPSE)``, Linux 6.1, one
2 MiB range per call, about 5 ms each there), and the loads that reuse it read into
contiguous memory. The kernel keeps the bytes as they are while it collapses (memory a new
load already reads into is collapsed or left as it is, never changed). A kernel without it
(or with transparent huge pages ``never``) turns it off for the pool; a range it cannot
collapse now (no free 2 MiB block) is tried again the next time the memory is dropped, up
to three times (:mod:`tieredkv.backends._hugepages`).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import weakref
from collections import defaultdict

import torch

from .._fork import reset_in_forked_child
from ..backends._hugepages import Collapser, Idle, huge_aligned

__all__ = ["POOLED_MIN_BYTES", "OutputPool"]

POOLED_MIN_BYTES = 1 << 20
"""Outputs smaller than this come from ``torch.empty`` (the allocator's own reuse covers
them)."""


class OutputPool:
    """Reused, already-faulted host memory for new output tensors, collapsed into huge pages
    while idle (see the module's doc).

    :param keep_bytes: the most idle memory kept for reuse (0: none, every output is a new
        ``torch.empty``)
    :param huge_pages: collapse idle memory into transparent huge pages in a background
        thread, where the kernel can

    Thread-safe: memory comes back from whichever thread drops the last reference.
    """

    def __init__(self, keep_bytes: int, *, huge_pages: bool = True) -> None:
        self._keep = keep_bytes
        self._free: defaultdict[int, list[Idle]] = defaultdict(list)
        self._idle = 0
        # re-entrant: the cyclic collector may free an output (and so call _give_back) in
        # the middle of the pool's own critical section, in the thread that holds it
        self._lock = threading.RLock()
        self._closed = False
        self._collapser = Collapser(huge_pages and keep_bytes > 0)
        self.reused = 0
        """Outputs served from memory a dropped output left (for tests and metrics)."""
        reset_in_forked_child(self)

    def _after_fork(self) -> None:
        """In a forked child, a new lock: a parent's thread may have held this one at the
        fork (the child still drops, reuses and closes the memory it inherited)."""
        self._lock = threading.RLock()

    @property
    def idle_bytes(self) -> int:
        """Memory kept for reuse now."""
        return self._idle

    @property
    def collapsing(self) -> bool:
        """Whether idle memory is collapsed into huge pages (the kernel can, and it was
        asked for)."""
        return self._collapser.active

    @property
    def collapsed(self) -> int:
        """Huge pages idle memory was collapsed into so far."""
        return self._collapser.collapsed

    @property
    def collapse_failures(self) -> int:
        """Collapses the kernel refused for now (no free huge page)."""
        return self._collapser.failures

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized contiguous CPU tensor, on reused memory where there is some."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < POOLED_MIN_BYTES or self._keep <= 0:
            return torch.empty(shape, dtype=dtype)
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        with self._lock:
            free = self._free.get(size)
            block = free.pop() if free else None
            if block is not None:
                block.idle = False
                self._idle -= size
                self.reused += 1
        if block is None:
            block = self._new_block(size)
        # the ctypes array is the object the tensor's storage keeps alive; when the storage
        # dies, so does the array, and the finalizer hands the block back
        owner = (ctypes.c_ubyte * size).from_buffer(block.mm, block.offset)
        done = weakref.finalize(owner, self._give_back, block)
        done.atexit = False  # at exit, a live tensor may still use it
        return torch.frombuffer(owner, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)

    def _new_block(self, size: int) -> Idle:
        """New memory for an output of ``size`` bytes: where the pool collapses and the
        output spans a huge page, mapped a huge page larger and used from a huge-page
        boundary (the pages before and after it are never touched, so never backed)."""
        huge = self._collapser.huge if self._collapser.aligned(size) else 0
        mm, offset = huge_aligned(size, huge)
        return Idle(mm, offset, size)

    def _give_back(self, block: Idle) -> None:
        # called while the dying array still holds its export of the mapping (weakref
        # callbacks run first): memory not kept is unmapped when that export and the
        # mapping go, not here
        size = block.size
        with self._lock:
            if not self._closed and self._idle + size <= self._keep:
                block.idle = True
                self._free[size].append(block)
                self._idle += size
                self._collapser.submit(block)

    def open(self) -> None:
        """Keep dropped outputs' memory again (after :meth:`close`)."""
        with self._lock:
            self._closed = False
        self._collapser.open()

    def close(self) -> None:
        """Unmap the idle memory; memory still in use is unmapped when it is dropped. Ends
        the collapsing thread (after the huge page it collapses now)."""
        with self._lock:
            self._closed = True
            free = [b for blocks in self._free.values() for b in blocks]
            for b in free:
                b.idle = False
            self._free.clear()
            self._idle = 0
        self._collapser.close()
        with self._collapser.unmapping:
            for b in free:
                b.mm.close()
