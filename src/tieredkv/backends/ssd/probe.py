"""The O_DIRECT probe an SSD tier runs at open: can it write in its directory, and how.

Data is read and written with ``O_DIRECT`` and 4 KiB-aligned buffers, so the page cache
cannot turn the "SSD" into a second memory tier. Whether the filesystem allows it is found
by writing one block to a file in ``tmp/``: where it refuses (``EINVAL`` or
``EOPNOTSUPP``: tmpfs, some overlay filesystems) the tier falls back to buffered I/O, drops
the pages it touched with ``posix_fadvise(DONTNEED)``, and says so in its stats' notes.
"""

from __future__ import annotations

import errno
import logging
import os
import uuid

from ...errors import TierIOError
from ...payload import ALIGN, LAND_ALIGN
from .._buffers import anonymous
from .dirs import TierDirectory, full_hint, unlink_quietly
from .layout import O_DIRECT

__all__ = ["probe_direct_io"]

_log = logging.getLogger(__name__)


def _read_align(probe: str, tmp: int) -> int:
    """The alignment O_DIRECT reads of the probe file need: 512 where a 512-byte read at
    offset 512 into an address 512 bytes past a page works (most SSDs), else 4096."""
    buf = anonymous(ALIGN)
    fd = os.open(probe, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | O_DIRECT, dir_fd=tmp)
    try:
        with memoryview(buf) as whole, whole[LAND_ALIGN : 2 * LAND_ALIGN] as view:
            os.preadv(fd, [view], LAND_ALIGN)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return ALIGN
    finally:
        os.close(fd)
        buf.close()
    return LAND_ALIGN


def probe_direct_io(directory: TierDirectory, want: bool | None, capacity: int) -> str | None:
    """Write one block in ``directory``'s ``tmp/`` and set :attr:`TierDirectory.direct`.

    :param want: ``None`` uses O_DIRECT where it works, ``True`` requires it, ``False``
        never uses it
    :param capacity: the tier's capacity, named by the hint for a full filesystem
    :returns: the note for the tier's stats when O_DIRECT is not used, else ``None``
    :raises ~tieredkv.errors.TierIOError: the directory is not writable (or full), or
        ``want`` is true and the filesystem refuses O_DIRECT
    """
    probe = f"probe-{uuid.uuid4().hex}"
    tmp = directory.fd("tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    block = anonymous(ALIGN)
    note = None
    try:
        if want is not False and O_DIRECT:
            try:
                fd = os.open(probe, flags | os.O_EXCL | O_DIRECT, 0o600, dir_fd=tmp)
                try:
                    os.pwrite(fd, block, 0)
                finally:
                    os.close(fd)
                directory.direct = True
                directory.io_align = _read_align(probe, tmp)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                if want:
                    raise TierIOError(
                        directory.tier,
                        f"use O_DIRECT in {str(directory.path)!r} (the filesystem refuses "
                        f"it); pass direct_io=None to fall back to buffered I/O",
                        exc,
                    ) from exc
                unlink_quietly(probe, tmp)
        if not directory.direct:
            fd = os.open(probe, flags | os.O_TRUNC, 0o600, dir_fd=tmp)
            try:
                os.pwrite(fd, block, 0)
            finally:
                os.close(fd)
            reason = "disabled" if want is False else "unsupported here"
            note = f"O_DIRECT {reason}: buffered I/O with posix_fadvise(DONTNEED) after each access"
            _log.warning("tier %r: %s", directory.tier, note)
    except TierIOError:
        raise
    except OSError as exc:
        raise TierIOError(
            directory.tier,
            f"write in {str(directory.path)!r}",
            exc,
            hint=full_hint(exc, directory.path, capacity)
            or "it must be writable: fix its permissions or pass another directory",
        ) from exc
    finally:
        block.close()
        unlink_quietly(probe, tmp)
    return note
