"""Page-aligned buffers the tiers share: private anonymous mappings, their safe unmapping, and
the alignment test that O_DIRECT needs.

Every buffer here is a private anonymous ``mmap`` (:func:`anonymous`): page-aligned, so an
O_DIRECT read can land in it and an O_DIRECT write can leave from it. The host tier
(:mod:`.memory`), the SSD tier (:mod:`.ssd`), the cache's staging buffers and the tensors a
load returns use them.

What new memory costs is its page faults. Python's ``mmap.mmap(-1, n)`` makes a *shared*
anonymous mapping (shmem): on this project's 2-core VM, faulting in 128 MiB of it took
86-107 ms, against 58-66 ms for a private one (``MAP_PRIVATE``) and 48-62 ms for a private
one populated in one call (``benchmarks/bench_faults.py``, a new process per mapping).
Transparent huge pages (``MADV_HUGEPAGE``: 97 faults instead of 32,801) took 12-22 ms in
most processes but 70-384 ms in one or two of five: this VM's balloon device reports free 2 MiB
blocks to the host (free page reporting, ``page_reporting_order`` 9), so a huge page the
host has taken back faults on the host too. A new cache's first load of 134 MB into
outputs on huge pages took 609-610 ms against 250-290 ms on 4 KiB pages, most of it in
``clear_page_erms``. So no mapping here asks for huge pages when it is made; the output
pool (:mod:`tieredkv._cache.outputs`) collapses its idle memory into huge pages in a
background thread instead, off every load's path.
"""

from __future__ import annotations

import gc
import logging
import mmap
import sys

import numpy as np

from ..payload import ALIGN

__all__ = ["address", "aligned", "anonymous", "close_mapping", "prefaulted"]

_log = logging.getLogger(__name__)


def address(buf: memoryview) -> int:
    """The address of ``buf``'s first byte."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def aligned(buf: memoryview) -> bool:
    """Whether ``buf`` starts and ends on a 4 KiB boundary (what O_DIRECT needs)."""
    return len(buf) % ALIGN == 0 and address(buf) % ALIGN == 0


_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform == "linux" else 0)
"""``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14): fault every page in, writable, in one call
(Python's ``mmap`` names it from 3.13 on)."""


def anonymous(size: int, *, populate: bool = False) -> mmap.mmap:
    """A private anonymous, page-aligned (O_DIRECT-capable) mapping of ``size`` bytes (see the
    module's doc); with ``populate``, every page faulted in now (by the kernel in one call
    where it can, else by writing zeros).

    :raises OSError: the memory cannot be mapped
    """
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if populate:
        try:
            if not _MADV_POPULATE_WRITE:
                raise OSError("no MADV_POPULATE_WRITE")
            buf.madvise(_MADV_POPULATE_WRITE)
        except OSError:  # an older kernel (EINVAL): touch every page instead
            np.frombuffer(buf, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
    return buf


def prefaulted(size: int) -> mmap.mmap:
    """:func:`anonymous` with every page faulted in now."""
    return anonymous(size, populate=True)


def close_mapping(mm: mmap.mmap, what: str, *, collect: bool = False) -> None:
    """Unmap ``mm`` now, or (while something still holds a view of it) when its last view
    goes; ``what`` names it in the warning that the second case logs.

    Unmapping memory that a live view points at would crash the process; ``mmap.close``
    refuses with BufferError instead, and the mapping then lives until it is unreferenced.
    With ``collect`` (a tier's close), garbage is collected first and the close tried
    again: a failed I/O call's traceback (after a full disk, say) holds views of the
    memory it was copying in a reference cycle, which only the collector frees.
    """
    try:
        mm.close()
        return
    except BufferError:
        pass
    if collect:
        gc.collect()
        try:
            mm.close()
            return
        except BufferError:
            pass
    _log.warning(
        "%s: closed while the application still holds a view of its memory (a memoryview "
        "or tensor made from it, e.g. with view()); nothing stored is lost or damaged, but "
        "its %s bytes stay allocated until that view is released: drop it to free them",
        what,
        f"{len(mm):,}",
    )
