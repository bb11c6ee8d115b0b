"""Writing segments into an SSD tier, atomically and durably.

The bytes go to a temporary file in ``tmp/``; the file is renamed into place and
``fsync``-ed, its directory is ``fsync``-ed, and only then is the write committed. A
process killed at any moment therefore leaves each segment either whole or absent: the
rename comes after the last write has returned.

With O_DIRECT the rename comes before the file's ``fsync`` (the bytes are on the device
once the writes return), which makes one journal commit per write where the order
``fsync``, rename, directory ``fsync`` made two: on a journaling filesystem (ext4, XFS)
the file's ``fsync`` commits the rename together with the file's own metadata, and the
directory's ``fsync`` then has nothing left to commit (it flushes the device's cache).
The directory's ``fsync`` stays: it is what makes the name durable on any filesystem.
Buffered writes (where O_DIRECT is refused) keep the file's ``fsync`` before the rename:
their bytes may still be in the page cache when the writes return.

An O_DIRECT file's blocks are reserved whole (``posix_fallocate``) before its first write.
Without that, the filesystem allocates blocks write by write, in the order the writes
arrive: a filled write sends its later parts first and the header's part last, and ext4
gave 5 of 16 such 8 MiB segments two to four extents (the header's block far from the
rest), so one read of the segment became several. Buffered writes need nothing: the
page cache allocates at writeback, in file order.

With a secret, each segment is written with a keyed BLAKE2b MAC of its header and of its
body and with its session's incarnation, in a header block of its own (the caller's
buffer is never written to). A filled write (:meth:`SegmentWriter.write` with ``filled``)
writes a segment part by part while its caller is still serializing the next part, the
first part (with the header) last.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future

from ...errors import TierIOError
from ...payload import ALIGN, PREFIX, align_up, authenticated_head
from .._buffers import aligned, anonymous
from ..base import SegmentKey
from .dirs import TierDirectory, full_hint, unlink_quietly
from .layout import file_parts, pwrite_full, segment_file_name
from .reader import Workers

__all__ = ["Filled", "SegmentWriter"]

_log = logging.getLogger(__name__)

Filled = tuple[list[int], Callable[[int], None]]
"""A filled write's cuts and fill (see :meth:`SSDTier.write_filled`)."""


class SegmentWriter:
    """Writes the segment files of one SSD tier (in worker threads).

    :param directory: the tier's open directory
    :param workers: the tier's threads (a filled write's parts go to its readers)
    :param key: the MAC key (authenticated mode), or ``None``
    :param fsync: make every write durable before it counts as committed
    :param capacity: the tier's capacity, named by the hint for a full filesystem
    """

    def __init__(
        self,
        directory: TierDirectory,
        workers: Workers,
        key: bytes | None,
        *,
        fsync: bool,
        capacity: int,
    ) -> None:
        self._dir = directory
        self._workers = workers
        self._key = key
        self._fsync = fsync
        self._capacity = capacity
        self.doomed: set[SegmentKey] = set()
        """Files of failed writes that could not be removed (retried at close)."""
        self._lock = threading.Lock()
        self._preallocate = True
        """Whether O_DIRECT files are reserved whole before their writes (off once the
        filesystem refuses ``fallocate``)."""

    def forget_doomed(self, key: SegmentKey) -> None:
        """``key``'s leftover file is gone: a committed write of it replaced the file, or
        a failed one removed it."""
        with self._lock:
            self.doomed.discard(key)

    def write(
        self,
        key: SegmentKey,
        data: memoryview,
        incarnation: bytes | None,
        filled: Filled | None = None,
    ) -> bytes:
        """Write ``data`` as ``key``'s file, atomically; return its prefix. With ``filled``
        (cuts and fill, see :meth:`SSDTier.write_filled`) the data is filled part by part as
        it is written where it can be (O_DIRECT from an aligned buffer, no MAC), or first."""
        if filled is not None and (self._key is not None or not aligned(data)):
            cuts, fill = filled
            for k in range(len(cuts) - 1):
                fill(k)
            filled = None
        direct = self._dir.direct
        xx, name = file_parts(key)
        tmp_dir = self._dir.fd("tmp")
        tmp = f"{name}.{uuid.uuid4().hex}.tmp"
        sub: int | None = None  # the directory the file was renamed into (once it was)
        bounce: mmap.mmap | None = None
        head: mmap.mmap | None = None
        try:
            if direct and not aligned(data):
                bounce = anonymous(len(data))
                memoryview(bounce)[:] = data
                data = memoryview(bounce)
            # the file: ``parts`` in order; an authenticated segment starts with its own
            # header block (the caller's buffer is never written to)
            parts = [data]
            if self._key is not None and incarnation is not None:
                authed = authenticated_head(data, self._key, incarnation)
                n = align_up(len(authed))
                head = anonymous(n)
                head[:n] = data[:n]
                head[: len(authed)] = authed
                parts = [memoryview(head), data[n:]]
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags | self._dir.file_flags, 0o644, dir_fd=tmp_dir)
            try:
                if direct:
                    self._reserve(fd, len(data))
                if filled is not None:
                    self._write_while_filling(fd, data, *filled)
                at = 0
                for part in parts if filled is None else []:
                    pwrite_full(fd, part, at)
                    at += len(part)
                tag = bytes(parts[0][: PREFIX.size])  # complete only now, when filled
                if direct:  # the bytes are on the device: renamed before the fsyncs
                    sub = self._place(xx, tmp, name)
                if self._fsync:
                    os.fsync(fd)
                if not direct:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            if sub is None:
                sub = self._place(xx, tmp, name)
            if self._fsync:
                os.fsync(sub)
        except OSError as exc:
            self._take_back(key, tmp, name, sub)
            raise TierIOError(
                self._dir.tier,
                f"write segment {key[1]} ({len(data):,} bytes)",
                exc,
                hint=full_hint(exc, self._dir.path, self._capacity),
            ) from exc
        except BaseException:  # the caller's fill failed (before the rename)
            self._take_back(key, tmp, name, sub)
            raise
        finally:
            if head is not None:
                for part in parts:
                    part.release()
                head.close()
            if bounce is not None:
                data.release()
                bounce.close()
        return tag

    def _reserve(self, fd: int, size: int) -> None:
        """Reserve ``size`` bytes of blocks for the new file ``fd``, in as few extents as
        the filesystem can (see the module's doc). A filesystem without ``fallocate`` is
        not asked again; any other error (a full disk, EIO) fails the write."""
        if not self._preallocate or size == 0:
            return
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
                raise
            self._preallocate = False

    def _place(self, xx: str, tmp: str, name: str) -> int:
        """Rename the temporary file ``tmp`` into place as ``name``; return the directory
        it went into."""
        sub = self._dir.subdir(xx, create=True)
        os.replace(tmp, name, src_dir_fd=self._dir.fd("tmp"), dst_dir_fd=sub)
        return sub

    def _take_back(self, key: SegmentKey, tmp: str, name: str, sub: int | None) -> None:
        """Remove what a failed write left: its temporary file, and (``sub``: it was renamed
        into that directory) its segment file, which is not durable, so not committed: a
        restart must not find it either (if it cannot be removed now, it is at close)."""
        unlink_quietly(tmp, self._dir.fd("tmp"))
        if sub is None:
            return
        try:
            os.unlink(name, dir_fd=sub)
        except FileNotFoundError:
            pass
        except OSError:
            with self._lock:  # retried at close, unless written again first
                self.doomed.add(key)
            return
        self.forget_doomed(key)  # (it replaced the leftover file of an earlier failed write)

    def _write_while_filling(
        self, fd: int, data: memoryview, cuts: list[int], fill: Callable[[int], None]
    ) -> None:
        """Fill ``data`` part by part and write each part once final, the first part last;
        every write has finished when this returns or raises."""
        writers = self._workers.readers
        # the first part is at least the prefix's page: it is written last, once final
        bounds = [0, *(max(ALIGN, c - c % ALIGN) for c in cuts[1:-1]), len(data)]
        writes: list[Future[None]] = []
        try:
            for k in range(len(cuts) - 1):
                fill(k)
                lo, hi = bounds[k], bounds[k + 1]
                if k and hi > lo:
                    writes.append(writers.submit(pwrite_full, fd, data[lo:hi], lo))
            if bounds[1] > 0:
                pwrite_full(fd, data[: bounds[1]], 0)
        finally:
            failure: BaseException | None = None
            for w in writes:
                try:
                    w.result()
                except BaseException as exc:  # the first one is raised
                    failure = failure or exc
        if failure is not None:
            raise failure

    def remove_doomed(self) -> None:
        """Remove the files of failed writes whose cleanup failed (a restart would
        otherwise find segments whose write was reported as failed)."""
        for key in sorted(self.doomed):
            try:
                self._dir.unlink_segment(key)
            except OSError as exc:
                _log.error(
                    "tier %r: could not remove segment %s of a failed write (%s); a restart "
                    "may find it",
                    self._dir.tier,
                    segment_file_name(key),
                    exc,
                )
        self.doomed.clear()
