"""Whether this kernel collapses memory into transparent huge pages, for the tests of the
output pool's and the SSD tier's background collapse (:mod:`tieredkv.backends._hugepages`)."""

from __future__ import annotations

import functools

from tieredkv.backends._hugepages import MADV_COLLAPSE, huge_aligned, huge_page_size


@functools.cache
def collapse_works() -> bool:
    """Whether this kernel collapses private anonymous memory into huge pages (Linux 6.1's
    ``MADV_COLLAPSE``, transparent huge pages not ``never``), asked directly."""
    huge = huge_page_size()
    if not huge:
        return False
    mm, off = huge_aligned(huge, huge)
    try:
        mm[off : off + huge] = b"\1" * huge
        mm.madvise(MADV_COLLAPSE, off, huge)
    except OSError:
        return False
    finally:
        mm.close()
    return True
