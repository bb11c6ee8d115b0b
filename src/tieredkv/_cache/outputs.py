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
to three times.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import sys
import threading
import weakref
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

from ..backends._buffers import address, anonymous

__all__ = ["MADV_COLLAPSE", "OutputPool", "POOLED_MIN_BYTES", "huge_page_size"]

_log = logging.getLogger(__name__)

POOLED_MIN_BYTES = 1 << 20
"""Outputs smaller than this come from ``torch.empty`` (the allocator's own reuse covers
them)."""

MADV_COLLAPSE = 25
"""``madvise(MADV_COLLAPSE)`` (Linux 6.1): make a range huge pages now, in the caller."""

_COLLAPSE_TRIES = 3
"""Times a block's collapse is tried before it stays on 4 KiB pages."""

_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP})
"""``madvise`` errors that mean this kernel or its settings will never collapse."""


def huge_page_size() -> int:
    """The size of a transparent huge page (``hpage_pmd_size``), or 0 where the system has
    none (not Linux, or no transparent huge pages)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text()
        size = int(text.strip())
    except (OSError, ValueError):
        return 0
    return size if size > mmap.PAGESIZE and size % mmap.PAGESIZE == 0 else 0


def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (called through ctypes, which lets go of the GIL meanwhile: a
    collapse takes milliseconds), or ``None``."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast("Callable[[int, int, int], int]", fn)


class _Block:
    """One output's memory: a private mapping and where in it the output starts (on a
    huge-page boundary where the pool collapses)."""

    __slots__ = ("at", "huge", "idle", "mm", "offset", "queued", "size", "tries")

    def __init__(self, mm: mmap.mmap, offset: int, size: int) -> None:
        self.mm = mm
        self.offset = offset
        self.size = size
        self.at = address(memoryview(mm)) + offset
        """The address of the output's first byte."""
        self.huge = False
        """Whether its huge-page ranges were all collapsed."""
        self.idle = False
        """Whether it is in the pool (not handed out)."""
        self.queued = False
        self.tries = 0


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
        self._free: defaultdict[int, list[_Block]] = defaultdict(list)
        self._idle = 0
        # re-entrant: the cyclic collector may free an output (and so call _give_back) in
        # the middle of the pool's own critical section, in the thread that holds it
        self._lock = threading.RLock()
        self._closed = False
        self._huge = huge_page_size() if huge_pages and keep_bytes > 0 else 0
        self._madvise = _madvise() if self._huge else None
        if self._madvise is None:
            self._huge = 0
        self._queue: deque[_Block] = deque()
        self._worker: threading.Thread | None = None
        # held around each collapse call and by close() around unmapping, so that no
        # mapping is unmapped while the kernel collapses part of it
        self._unmapping = threading.Lock()
        self.reused = 0
        """Outputs served from memory a dropped output left (for tests and metrics)."""
        self.collapsed = 0
        """Huge-page ranges (``huge_page_size()`` bytes each) collapsed so far."""
        self.collapse_failures = 0
        """Collapses the kernel refused for now (no free huge page, memory in use)."""

    @property
    def idle_bytes(self) -> int:
        """Memory kept for reuse now."""
        return self._idle

    @property
    def collapsing(self) -> bool:
        """Whether idle memory is collapsed into huge pages (the kernel can, and it was
        asked for)."""
        return self._huge > 0

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

    def _new_block(self, size: int) -> _Block:
        """New memory for an output of ``size`` bytes: where the pool collapses and the
        output spans a huge page, mapped a huge page larger and used from a huge-page
        boundary (the pages before and after it are never touched, so never backed)."""
        huge = self._huge
        if not huge or size < huge:
            return _Block(anonymous(size), 0, size)
        mm = anonymous(size + huge)
        base = address(memoryview(mm))
        return _Block(mm, -base % huge, size)

    def _give_back(self, block: _Block) -> None:
        # called while the dying array still holds its export of the mapping (weakref
        # callbacks run first): memory not kept is unmapped when that export and the
        # mapping go, not here
        size = block.size
        with self._lock:
            if not self._closed and self._idle + size <= self._keep:
                block.idle = True
                self._free[size].append(block)
                self._idle += size
                if (
                    self._huge
                    and not block.huge
                    and not block.queued
                    and block.tries < _COLLAPSE_TRIES
                    and size >= self._huge
                ):
                    block.queued = True
                    self._queue.append(block)
                    self._start_worker()

    def _start_worker(self) -> None:
        """Start the collapsing thread if it is not running (the lock held)."""
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(
                target=self._collapse_loop, name="tieredkv-output-collapse", daemon=True
            )
            self._worker.start()

    def _collapse_loop(self) -> None:
        """Collapse queued idle blocks until none is left or the pool closes (the pool's
        thread: it ends when it runs out of work, and the next dropped block starts
        another)."""
        while True:
            with self._lock:
                if self._closed or not self._queue:
                    self._worker = None
                    return
                block = self._queue.popleft()
                block.queued = False
            try:
                self._collapse(block)
            except Exception:  # a bug here must not end collapsing silently
                _log.exception("output pool: collapsing idle memory into huge pages failed")
                with self._lock:
                    self._huge = 0
                    self._queue.clear()
                    self._worker = None
                return

    def _collapse(self, block: _Block) -> None:
        """Collapse ``block``'s huge-page ranges while it stays idle in the open pool."""
        huge, madvise = self._huge, self._madvise
        assert madvise is not None
        block.tries += 1
        first = block.at + -block.at % huge
        for at in range(first, block.at + block.size - huge + 1, huge):
            with self._unmapping:
                with self._lock:
                    if self._closed or not block.idle or block.mm.closed or not self._huge:
                        return  # handed out again (queued again when dropped) or closing
                if madvise(at, huge, MADV_COLLAPSE) == 0:
                    self.collapsed += 1
                    continue
                err = ctypes.get_errno()
            if err in _UNSUPPORTED:
                _log.info(
                    "output pool: this kernel does not collapse memory into huge pages "
                    "(madvise(MADV_COLLAPSE): %s); loads read into 4 KiB pages",
                    errno.errorcode.get(err, err),
                )
                with self._lock:
                    self._huge = 0
                    self._queue.clear()
                return
            self.collapse_failures += 1  # no free huge page now: the rest would fail too
            return
        block.huge = True

    def open(self) -> None:
        """Keep dropped outputs' memory again (after :meth:`close`)."""
        with self._lock:
            self._closed = False

    def close(self) -> None:
        """Unmap the idle memory; memory still in use is unmapped when it is dropped. Ends
        the collapsing thread (after the range it collapses now)."""
        with self._lock:
            self._closed = True
            free = [b for blocks in self._free.values() for b in blocks]
            for b in free:
                b.idle = False
            self._free.clear()
            self._queue.clear()
            self._idle = 0
            worker = self._worker
        with self._unmapping:
            for b in free:
                b.mm.close()
        if worker is not None and worker is not threading.current_thread():
            worker.join(5.0)
