"""Idle buffers collapsed into transparent huge pages in a background thread.

An O_DIRECT read into 4 KiB pages faulted in one by one is cut into more device requests
than one into physically contiguous memory (a request carries a bounded number of
contiguous segments: 254 on this project's virtual disk). Asking for huge pages when a
buffer is made costs the first use that faults them in (on this project's VM, whose
balloon takes free 2 MiB blocks back, a new cache's first load took 2-3x longer). So a
:class:`Collapser` works on buffers that are already faulted in and idle (a load's
dropped outputs, a span buffer a copied span filled; the cache's staging buffers, made
once and reused by every append, ask for huge pages when made instead: see
:class:`tieredkv._cache.gather.Staging`): its thread asks the kernel to
collapse them (``madvise(MADV_COLLAPSE)``, Linux 6.1), one huge page per call, through
ctypes so that the GIL is released meanwhile, and only while the buffer stays idle. The
kernel keeps the bytes as they are while it collapses (memory a new read already uses is
collapsed or left alone, never changed). A kernel that cannot (older, or transparent huge
pages ``never``) turns the collapser off; a huge page it cannot give now is counted and
tried again the next time the buffer is idle, up to :data:`TRIES` times. A range with no
page in memory yet (a buffer never written) is not asked for: the kernel refuses it with
the ``EINVAL`` an older kernel gives for the advice itself (``mincore`` tells them
apart). A child this process forks gives each collapser and owner new locks
(:func:`reset_in_forked_child`): a collapse in progress holds two, for a thread the child
does not have.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import cast

from .._fork import reset_in_forked_child
from ._buffers import address, anonymous

__all__ = [
    "MADV_COLLAPSE",
    "TRIES",
    "Collapser",
    "Idle",
    "huge_aligned",
    "huge_page_size",
]

_log = logging.getLogger(__name__)

MADV_COLLAPSE = 25
"""``madvise(MADV_COLLAPSE)`` (Linux 6.1): make a range huge pages now, in the caller."""

TRIES = 3
"""Refusals (no free huge page) after which a buffer stays on 4 KiB pages. An idle period
that ends before every huge page of the buffer is collapsed is no refusal: the next one
goes on where it stopped (a busy server reuses dropped memory within milliseconds)."""

_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP})
"""``madvise`` errors that mean this kernel or its settings will never collapse."""


def huge_page_size() -> int:
    """The size of a transparent huge page (``hpage_pmd_size``), or 0 where the system has
    none (not Linux, or no transparent huge pages)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        size = int(Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return 0
    return size if size > mmap.PAGESIZE and size % mmap.PAGESIZE == 0 else 0


def huge_aligned(size: int, huge: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping that holds ``size`` bytes from a ``huge``-byte boundary,
    and the offset of that boundary in it (mapped ``huge`` bytes larger: the pages before
    and after are never touched, so never backed); with ``huge`` 0, ``size`` bytes from
    offset 0."""
    if not huge:
        return anonymous(size), 0
    mm = anonymous(size + huge)
    return mm, -address(memoryview(mm)) % huge


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


def _mincore() -> Callable[[int, int, ctypes.Array[ctypes.c_ubyte]], int] | None:
    """libc's ``mincore`` (which pages of a range are in memory), or ``None``."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    fn.restype = ctypes.c_int
    return cast("Callable[[int, int, ctypes.Array[ctypes.c_ubyte]], int]", fn)


_MINCORE = _mincore()


def _in_memory(at: int, length: int) -> bool:
    """Whether any page of the page-aligned range ``[at, at + length)`` of this process's
    memory is in memory (``True`` where that cannot be told: the collapse is then asked
    for, as before)."""
    if _MINCORE is None:
        return True
    pages = (ctypes.c_ubyte * -(-length // mmap.PAGESIZE))()
    if _MINCORE(at, length, pages) != 0:
        return True
    return any(b & 1 for b in bytes(pages))


class Idle:
    """A buffer a :class:`Collapser` may collapse: ``size`` bytes of the private mapping
    ``mm`` from ``offset``; its owner sets :attr:`idle` (under its own lock) while the
    buffer is not in use."""

    __slots__ = ("at", "done", "huge", "idle", "mm", "offset", "queued", "size", "tries")

    def __init__(self, mm: mmap.mmap, offset: int = 0, size: int | None = None) -> None:
        self.mm = mm
        self.offset = offset
        self.size = len(mm) - offset if size is None else size
        self.at = address(memoryview(mm)) + offset
        """The address of the buffer's first byte."""
        self.huge = False
        """Whether every huge page within it was collapsed."""
        self.idle = False
        """Whether its owner holds it unused (set by the owner)."""
        self.queued = False
        self.tries = 0
        """Collapses of it the kernel refused (each idle period ends at the first)."""
        self.done: set[int] = set()
        """The addresses of the huge pages within it collapsed so far (an idle period
        that ends before all of them resumes at the next)."""


class Collapser:
    """Collapses idle buffers into huge pages in a thread of its own (see the module's doc).

    :param enabled: whether to collapse at all (off where the system has no huge pages)

    The thread starts when a buffer is submitted and ends when none is left. An owner that
    unmaps a buffer it submitted does so holding :attr:`unmapping`, so that no mapping is
    unmapped while the kernel collapses part of it.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.huge = huge_page_size() if enabled else 0
        """The huge page size; 0 when off."""
        self._madvise = _madvise() if self.huge else None
        if self._madvise is None:
            self.huge = 0
        self._lock = threading.Lock()
        self._queue: deque[Idle] = deque()
        self._worker: threading.Thread | None = None
        self._closed = False
        self.unmapping = threading.Lock()
        """Held around each collapse call; hold it to unmap a submitted buffer."""
        self.collapsed = 0
        """Huge pages made so far."""
        self.failures = 0
        """Collapses the kernel refused for now (no free huge page)."""
        reset_in_forked_child(self)

    def _after_fork(self) -> None:
        """In a forked child: new locks (a parent's thread may have held them at the fork)
        and no thread or queue (the child has no collapsing thread; what was queued is
        queued again when its owner next drops it)."""
        self._lock = threading.Lock()
        self.unmapping = threading.Lock()
        self._worker = None
        for idle in self._queue:
            idle.queued = False
        self._queue.clear()

    @property
    def active(self) -> bool:
        """Whether buffers are collapsed (the system can, and it was asked for)."""
        return self.huge > 0

    def aligned(self, size: int) -> bool:
        """Whether a buffer of ``size`` bytes is worth mapping from a huge-page boundary."""
        return self.huge > 0 and size >= self.huge

    def submit(self, idle: Idle) -> None:
        """Collapse ``idle`` (marked idle by its owner) in the background, unless it is
        collapsed already, queued, tried :data:`TRIES` times or holds no whole huge page."""
        huge = self.huge
        if not huge or idle.huge or idle.queued or idle.tries >= TRIES:
            return
        if idle.at + -idle.at % huge + huge > idle.at + idle.size:
            return
        with self._lock:
            if self._closed:
                return
            idle.queued = True
            self._queue.append(idle)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(
                    target=self._loop, name="tieredkv-huge-pages", daemon=True
                )
                self._worker.start()

    def _loop(self) -> None:
        """Collapse queued buffers until none is left or the collapser closes."""
        while True:
            with self._lock:
                if self._closed or not self._queue:
                    self._worker = None
                    return
                idle = self._queue.popleft()
                idle.queued = False
            try:
                self._collapse(idle)
            except Exception:  # a bug here must not end collapsing silently
                _log.exception("collapsing idle buffers into huge pages failed; stopped")
                with self._lock:
                    self.huge = 0
                    self._queue.clear()
                    self._worker = None
                return

    def _collapse(self, idle: Idle) -> None:
        """Collapse ``idle``'s whole huge pages while it stays idle. A huge page's range
        with no page in memory (a buffer never written, such as the outputs of a load that
        failed or was cancelled before its bytes landed) is left as it is: there is nothing
        to collapse, and the kernel refuses such a range with ``EINVAL``, the error an older
        kernel gives for the advice itself, which would turn collapsing off for good."""
        huge, madvise = self.huge, self._madvise
        if not huge or madvise is None:  # turned off while ``idle`` was being queued
            return
        skipped = False
        for at in range(idle.at + -idle.at % huge, idle.at + idle.size - huge + 1, huge):
            if at in idle.done:
                continue
            with self.unmapping:
                if self._closed or not self.huge or not idle.idle or idle.mm.closed:
                    return  # in use again (submitted again when idle) or closing
                if not _in_memory(at, huge):
                    skipped = True
                    continue
                if madvise(at, huge, MADV_COLLAPSE) == 0:
                    self.collapsed += 1
                    idle.done.add(at)
                    continue
                err = ctypes.get_errno()
            if err in _UNSUPPORTED:
                _log.info(
                    "this kernel does not collapse memory into huge pages "
                    "(madvise(MADV_COLLAPSE): %s); buffers stay on 4 KiB pages",
                    errno.errorcode.get(err, err),
                )
                with self._lock:
                    self.huge = 0
                    self._queue.clear()
                return
            self.failures += 1  # no free huge page now: the rest would fail too
            idle.tries += 1
            return
        idle.huge = not skipped  # (a range written later is collapsed when next idle)

    def open(self) -> None:
        """Collapse again (after :meth:`close`)."""
        with self._lock:
            self._closed = False

    def close(self) -> None:
        """Stop collapsing: forget the queue and end the thread (after the huge page it
        collapses now)."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            worker = self._worker
        if worker is not None and worker is not threading.current_thread():
            worker.join(5.0)
