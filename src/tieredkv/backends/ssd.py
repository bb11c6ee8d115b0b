"""SSD: the persistent capacity tier. One file per segment under a directory.

Layout under ``directory``::

    LOCK                      flock-ed while a process has the tier open (never a symlink)
    segments/ab/<hash>.<seq>.seg   one segment; <hash> = BLAKE2b-128 of the session key
    tmp/                      segments being written (removed at open)
    quarantine/               damaged segments moved aside, never served

File names derive from a hash of the session key, so no key (``/``, ``..``, NUL, 10 kB of
text, any script) can escape or break the directory; the key itself lives in the segment
header, which is how the index is rebuilt after a restart.

Nothing under the directory is reached through a symbolic link: the subdirectories are
opened once with ``O_NOFOLLOW`` and every file is then named relative to a subdirectory's
descriptor (``dir_fd``), so a ``tmp/`` or ``segments/ab`` replaced by a link cannot make
the tier write, read or delete outside the directory. A symlinked ``segments``, ``tmp``,
``quarantine`` or ``LOCK`` fails :meth:`SSDTier.open`; a symlinked ``segments/ab`` or
segment file is moved to ``quarantine/`` (the link, never its target).

Every header is checked at open (:func:`~tieredkv.payload.parse_header`: CRC, then contents
against the file's length), and a file whose header cannot be read (an I/O error on that
one file, twice) is quarantined too: the tier opens with the rest. While open, a read serves a
file only if its prefix (which covers the header's CRC and the body's hash) is the one this
tier wrote or found at open, so a file swapped behind the tier's back, even for a valid
older copy of the same segment, is refused.

With a ``secret``, segments are authenticated (:mod:`tieredkv.payload`): the tier writes
each segment with a keyed BLAKE2b MAC of its header and of its body, and with the
session's *incarnation*, a random id shared by every segment of the session while the
session has any segment in the tier (a new one after it has had none). At open every
header's MAC is checked and a session whose files carry more than one incarnation is
quarantined whole; every read checks both MACs. What that catches, for someone who can
write the directory but does not know the secret:

- a forged segment, or any change to a header or a body: refused (a MAC fails);
- a segment written without the secret or with another one: refused;
- a stale, valid copy of one segment from an earlier residency of its session put back
  among newer ones (a rollback of one segment): the session is refused at open (two
  incarnations); put back while the tier is open: refused on read (not the file it wrote);
- a segment moved to another session or turn: refused (the name and the key in the
  authenticated header disagree).

What it does not catch: a rollback of a whole session (every one of its files replaced by
an older residency's complete set) or of the whole directory; files deleted (a session
then comes back shorter, or not at all: a miss, never wrong bytes); a segment copied from
another directory written with the same secret and the same session key, when it replaces
all of that session's files. Files written without a secret are all refused (quarantined)
when a directory is first opened with one; a directory opened without the secret checks
only CRCs and hashes. MACs cost a BLAKE2b pass over every segment written and read, in the
calling worker thread: about 12 times xxh3's cost (0.28 against 3.3 GB/s on one core of
a busy 2-core machine, 64 MiB hashed, best of 5).

Writes are atomic: the bytes go to a temporary file, are ``fsync``-ed, and the file is
renamed into place (then the directory is ``fsync``-ed). A process killed at any moment
therefore leaves each segment either whole or absent. Data is read and written with
``O_DIRECT`` and 4 KiB-aligned buffers, so the page cache cannot turn the "SSD" into a
second memory tier; where the filesystem refuses ``O_DIRECT`` (tmpfs, some overlay
filesystems) the tier falls back to buffered I/O, drops the pages it touched with
``posix_fadvise(DONTNEED)``, and says so in :meth:`SSDTier.stats`.

Reads verify the header CRC and the body's xxh3 hash while the data streams in: two chunk
reads are kept in flight, and the hash of each chunk (in a second thread; xxh3 releases the
GIL) overlaps the reads of the next ones. A segment that fails is moved
to ``quarantine/`` and reported as :class:`~tieredkv.errors.CorruptSegmentError`; the cache
treats it as a miss.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import mmap
import os
import stat
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import xxhash

from ..errors import ClosedError, CorruptSegmentError, InvalidArgumentError, TierIOError
from ..payload import (
    ALIGN,
    INCARNATION_BYTES,
    PREFIX,
    SegmentHeader,
    align_up,
    authenticated_head,
    check_body_mac,
    check_header_mac,
    check_int,
    check_prefix,
    derive_key,
    hash_body,
    hashed_from,
    parse_header,
)
from .arena import check_tier_arguments
from .base import SegmentKey, Tier, TierStats

__all__ = ["SSDTier", "read_header_at", "segment_file_name"]

_log = logging.getLogger(__name__)

_O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SUBDIRS = ("segments", "tmp", "quarantine")
_READ_DEPTH = 4
"""Chunk reads of one segment in flight at once."""


def segment_file_name(key: SegmentKey) -> str:
    """Relative path of a segment's file: ``<2 hex>/<32 hex>.<seq>.seg``."""
    digest = hashlib.blake2b(key[0].encode("utf-8"), digest_size=16).hexdigest()
    return f"{digest[:2]}/{digest}.{key[1]}.seg"


def _address(buf: memoryview) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _aligned(buf: memoryview) -> bool:
    return len(buf) % ALIGN == 0 and _address(buf) % ALIGN == 0


class SSDTier(Tier):
    """Segment files on a local filesystem (meant for an SSD), with O_DIRECT and checksums.

    :param directory: where the tier keeps its files (created if missing)
    :param capacity: the byte budget for segment files
    :param name: the tier's name in metadata and events
    :param direct_io: ``None`` (default) uses O_DIRECT where the filesystem supports it and
        falls back otherwise; ``True`` requires it; ``False`` never uses it
    :param fsync: make every write durable before it counts as committed
    :param max_threads: concurrent file operations (the per-tier thread limiter)
    :param chunk_size: bytes per read call; a segment of at most this many bytes is read in
        one call and hashed in the calling thread, a larger one in chunks of this size, read
        ahead by reader threads while the hasher thread hashes the chunks already read
    :param secret: authenticate segments with this secret (at least 16 bytes; keep it out
        of the directory): see the module's description for what that catches and what not
    """

    kind = "ssd"

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity: int,
        *,
        name: str = "ssd",
        direct_io: bool | None = None,
        fsync: bool = True,
        max_threads: int = 4,
        chunk_size: int = 8 << 20,
        secret: bytes | None = None,
    ) -> None:
        check_tier_arguments(name, capacity, max_threads)
        self._key = None if secret is None else derive_key(secret)
        self._incarnations: dict[str, list[Any]] = {}
        """Per session, in authenticated mode: [incarnation, segments committed or being
        written]."""
        check_int(f"tier {name!r}: chunk_size", chunk_size, minimum=ALIGN)
        if chunk_size % ALIGN:
            raise InvalidArgumentError(f"chunk_size must be a positive multiple of {ALIGN}")
        self.name = name
        self.directory = Path(directory)
        self._capacity = capacity
        self._want_direct = direct_io
        self._direct = False
        self._fsync = fsync
        self._max_threads = max_threads
        self._chunk = chunk_size
        self._index: dict[SegmentKey, int] = {}
        self._tags: dict[SegmentKey, bytes] = {}
        """Each committed segment's prefix (magic, header length, CRC, body hash)."""
        self._dirs: dict[str, int] = {}
        """Descriptors of the subdirectories: segments, tmp, quarantine and each segments/xx."""
        self._dirs_lock = threading.Lock()
        self._doomed: set[SegmentKey] = set()
        """Files of failed writes that could not be removed (retried at close)."""
        self._reserved: dict[SegmentKey, int] = {}
        self._used = 0
        self._limiter: anyio.CapacityLimiter | None = None
        self._hasher: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._lock_fd: int | None = None
        self._notes: list[str] = []
        self._counters: dict[str, int] = {
            "bytes_read": 0,
            "bytes_written": 0,
            "reads": 0,
            "writes": 0,
            "corrupt": 0,
        }

    # -- properties ----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    @property
    def persistent(self) -> bool:
        return True

    @property
    def authenticated(self) -> bool:
        """Whether segments are written and checked with a MAC (a secret was given)."""
        return self._key is not None

    @property
    def direct_io(self) -> bool:
        """Whether files are read and written with O_DIRECT."""
        return self._direct

    def _subdir(self, xx: str, *, create: bool) -> int:
        """The descriptor of ``segments/xx``, opened without following a symlink."""
        with self._dirs_lock:
            fd = self._dirs.get(xx)
            if fd is None:
                parent = self._dirs["segments"]
                if create:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(xx, 0o755, dir_fd=parent)
                try:
                    fd = os.open(xx, _O_DIR, dir_fd=parent)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    raise OSError(
                        exc.errno,
                        f"segments/{xx} is a symbolic link or not a directory (the tier never "
                        f"follows a link; remove it)",
                    ) from None
                self._dirs[xx] = fd
            return fd

    def _check_open(self) -> anyio.CapacityLimiter:
        if self._limiter is None:
            raise ClosedError(f"tier {self.name!r}")
        return self._limiter

    # -- lifecycle -----------------------------------------------------------------------
    async def open(self) -> list[SegmentHeader]:
        if self._limiter is not None:
            return []
        limiter = anyio.CapacityLimiter(self._max_threads)
        headers = await anyio.to_thread.run_sync(self._open_sync, limiter=limiter)
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix=f"tieredkv-{self.name}-hash")
        self._readers = ThreadPoolExecutor(
            self._max_threads * _READ_DEPTH, thread_name_prefix=f"tieredkv-{self.name}-read"
        )
        self._limiter = limiter
        return headers

    def _open_sync(self) -> list[SegmentHeader]:
        root: int | None = None
        try:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                root = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                self._refuse_links(root)
                for sub in _SUBDIRS:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(sub, 0o755, dir_fd=root)
                    self._dirs[sub] = os.open(sub, _O_DIR, dir_fd=root)
                flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                lock_fd = os.open("LOCK", flags, 0o644, dir_fd=root)
            except TierIOError:
                raise
            except OSError as exc:
                raise TierIOError(
                    self.name,
                    f"use directory {str(self.directory)!r} (it must be a writable directory; "
                    f"fix its permissions or pass another one)",
                    exc,
                ) from exc
            return self._lock_and_scan(lock_fd)
        except BaseException:
            self._close_dirs()
            self._index.clear()
            self._tags.clear()
            self._incarnations.clear()
            self._used = 0
            raise
        finally:
            if root is not None:
                os.close(root)

    def _refuse_links(self, root: int) -> None:
        for sub in (*_SUBDIRS, "LOCK"):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISLNK(os.stat(sub, dir_fd=root, follow_symlinks=False).st_mode):
                    raise TierIOError(
                        self.name,
                        f"use {str(self.directory / sub)!r}: it is a symbolic link, and the "
                        f"tier never follows one (remove the link)",
                        OSError(errno.ELOOP, "a symbolic link"),
                    )

    def _lock_and_scan(self, lock_fd: int) -> list[SegmentHeader]:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock_fd)
            raise TierIOError(
                self.name,
                f"lock {str(self.directory)!r}: another process has this SSD tier open; give "
                f"each process its own directory",
                exc,
            ) from exc
        try:
            self._probe_write()
            self._remove_leftovers()
            headers = self._scan()
        except OSError as exc:
            os.close(lock_fd)
            if isinstance(exc, TierIOError):
                raise
            raise TierIOError(self.name, f"scan {str(self.directory)!r}", exc) from exc
        except BaseException:
            os.close(lock_fd)
            raise
        self._lock_fd = lock_fd
        return headers

    def _remove_leftovers(self) -> None:
        """Delete what tmp/ holds: writes a crash interrupted (links included, never their
        targets: unlink removes the link itself)."""
        tmp = self._dirs["tmp"]
        for name in os.listdir(tmp):
            try:
                os.unlink(name, dir_fd=tmp)
            except OSError as exc:  # harmless: never read, only space
                _log.warning("tier %r: could not remove tmp/%s: %s", self.name, name, exc)

    def _close_dirs(self) -> None:
        with self._dirs_lock:
            fds = list(self._dirs.values())
            self._dirs.clear()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _probe_write(self) -> None:
        probe = f"probe-{uuid.uuid4().hex}"
        tmp = self._dirs["tmp"]
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        block = mmap.mmap(-1, ALIGN)
        try:
            if self._want_direct is not False and _O_DIRECT:
                try:
                    fd = os.open(probe, flags | os.O_EXCL | _O_DIRECT, 0o600, dir_fd=tmp)
                    try:
                        os.pwrite(fd, block, 0)
                    finally:
                        os.close(fd)
                    self._direct = True
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                        raise
                    if self._want_direct:
                        raise TierIOError(
                            self.name,
                            f"use O_DIRECT in {str(self.directory)!r} (the filesystem refuses "
                            f"it); pass direct_io=None to fall back to buffered I/O",
                            exc,
                        ) from exc
                    _unlink_quietly(probe, tmp)
            if not self._direct:
                fd = os.open(probe, flags | os.O_TRUNC, 0o600, dir_fd=tmp)
                try:
                    os.pwrite(fd, block, 0)
                finally:
                    os.close(fd)
                reason = "disabled" if self._want_direct is False else "unsupported here"
                self._notes.append(
                    f"O_DIRECT {reason}: buffered I/O with posix_fadvise(DONTNEED) after each "
                    f"access"
                )
                _log.warning("tier %r: %s", self.name, self._notes[-1])
        except TierIOError:
            raise
        except OSError as exc:
            raise TierIOError(
                self.name,
                f"write in {str(self.directory)!r} (it must be writable; fix its permissions "
                f"or pass another directory)",
                exc,
            ) from exc
        finally:
            block.close()
            _unlink_quietly(probe, tmp)

    def _scan(self) -> list[SegmentHeader]:
        headers: list[SegmentHeader] = []
        segments = self._dirs["segments"]
        for xx in sorted(os.listdir(segments)):
            try:
                sub = self._subdir(xx, create=False)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise  # an I/O error: the open fails (and can be retried), moving nothing
                self._quarantine_entry(segments, xx, str(exc), keep=True)  # a link or a file
                continue
            for name in sorted(os.listdir(sub)):
                rel = f"{xx}/{name}"
                if not name.endswith(".seg"):
                    continue
                try:
                    try:
                        header, size, tag = read_header_at(sub, name, rel, self._key)
                    except CorruptSegmentError as exc:
                        if not isinstance(exc.__cause__, OSError):
                            raise
                        # an I/O error: once more before setting a whole file aside
                        header, size, tag = read_header_at(sub, name, rel, self._key)
                except CorruptSegmentError as exc:
                    # an unreadable file may be whole: if it cannot be moved, it stays
                    unreadable = isinstance(exc.__cause__, OSError)
                    self._quarantine_entry(sub, name, str(exc), keep=unreadable)
                    continue
                key = (header.session, header.seq)
                self._index[key] = size
                self._tags[key] = tag
                self._used += size
                headers.append(header)
        if self._key is not None:
            headers = self._refuse_mixed_incarnations(headers)
        return headers

    def _refuse_mixed_incarnations(self, headers: list[SegmentHeader]) -> list[SegmentHeader]:
        """Quarantine every file of a session whose files carry more than one incarnation
        (one of them is a stale copy, and which one cannot be told); count the rest."""
        by_session: dict[str, list[SegmentHeader]] = {}
        for h in headers:
            by_session.setdefault(h.session, []).append(h)
        kept: list[SegmentHeader] = []
        for session, group in by_session.items():
            if len({h.incarnation for h in group}) == 1:
                self._incarnations[session] = [group[0].incarnation, len(group)]
                kept.extend(group)
                continue
            for h in group:
                key = (h.session, h.seq)
                self._used -= self._index.pop(key)
                self._tags.pop(key)
                self._quarantine_key(
                    key, "its session's files carry different incarnations (a rollback?)"
                )
        return kept

    async def aclose(self) -> None:
        if self._limiter is None:
            return
        self._limiter = None
        for pool in (self._readers, self._hasher):
            if pool is not None:
                pool.shutdown(wait=True)
        self._readers = self._hasher = None
        if self._doomed:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._remove_doomed)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # also releases the flock
            self._lock_fd = None
        self._close_dirs()
        self._index.clear()
        self._tags.clear()
        self._incarnations.clear()
        self._reserved.clear()
        self._used = 0

    async def __aenter__(self) -> SSDTier:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- space ---------------------------------------------------------------------------
    def reserve(self, key: SegmentKey, length: int) -> bool:
        self._check_open()
        if key in self._reserved or key in self._index:
            raise ValueError(f"tier {self.name!r} already holds or reserves segment {key[1]}")
        if length % ALIGN:
            raise ValueError(f"segment length {length} is not a multiple of {ALIGN}")
        with self._dirs_lock:  # a write of it will replace the leftover file
            self._doomed.discard(key)
        if self._used + length > self._capacity:
            return False
        self._reserved[key] = length
        self._used += length
        return True

    def release(self, key: SegmentKey) -> None:
        length = self._reserved.pop(key, None)
        if length is not None:
            self._used -= length

    # -- data ----------------------------------------------------------------------------
    async def write(self, key: SegmentKey, data: memoryview) -> None:
        limiter = self._check_open()
        length = self._reserved.get(key)
        if length is None:
            raise ValueError(f"segment {key[1]} has no reservation in tier {self.name!r}")
        if len(data) != length:
            raise ValueError(f"reserved {length} bytes, asked to write {len(data)}")
        incarnation = self._begin_incarnation(key[0])
        try:
            tag = await anyio.to_thread.run_sync(
                self._write_sync, key, data, incarnation, limiter=limiter
            )
        except BaseException:
            self._end_incarnation(key[0])
            raise
        del self._reserved[key]
        self._index[key] = length
        self._tags[key] = tag
        self._counters["writes"] += 1
        self._counters["bytes_written"] += length

    def _begin_incarnation(self, session: str) -> bytes | None:
        """The incarnation to write one more segment of ``session`` with (authenticated
        mode; ``None`` otherwise): the session's current one, or a new one if it has none."""
        if self._key is None:
            return None
        entry = self._incarnations.get(session)
        if entry is None:
            entry = self._incarnations[session] = [os.urandom(INCARNATION_BYTES), 0]
        entry[1] += 1
        incarnation: bytes = entry[0]
        return incarnation

    def _end_incarnation(self, session: str) -> None:
        """One segment of ``session`` fewer (deleted, quarantined, or its write failed)."""
        entry = self._incarnations.get(session)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._incarnations[session]

    def _write_sync(self, key: SegmentKey, data: memoryview, incarnation: bytes | None) -> bytes:
        """Write ``data`` as ``key``'s file, atomically; return its prefix."""
        xx, name = segment_file_name(key).split("/")
        tmp_dir = self._dirs["tmp"]
        tmp = f"{name}.{uuid.uuid4().hex}.tmp"
        sub: int | None = None
        bounce: mmap.mmap | None = None
        head: mmap.mmap | None = None
        renamed = False
        try:
            if self._direct and not _aligned(data):
                bounce = mmap.mmap(-1, len(data))
                memoryview(bounce)[:] = data
                data = memoryview(bounce)
            # the file: ``parts`` in order; an authenticated segment starts with its own
            # header block (the caller's buffer is never written to)
            parts = [data]
            if self._key is not None and incarnation is not None:
                authed = authenticated_head(data, self._key, incarnation)
                n = align_up(len(authed))
                head = mmap.mmap(-1, n)
                head[:n] = data[:n]
                head[: len(authed)] = authed
                parts = [memoryview(head), data[n:]]
            tag = bytes(parts[0][: PREFIX.size])
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags | (_O_DIRECT if self._direct else 0), 0o644, dir_fd=tmp_dir)
            try:
                at = 0
                for part in parts:
                    done = 0
                    while done < len(part):
                        done += os.pwrite(fd, part[done:], at + done)
                    at += len(part)
                if self._fsync:
                    os.fsync(fd)
                if not self._direct:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            sub = self._subdir(xx, create=True)
            os.replace(tmp, name, src_dir_fd=tmp_dir, dst_dir_fd=sub)
            renamed = True
            if self._fsync:
                os.fsync(sub)
        except OSError as exc:
            _unlink_quietly(tmp, tmp_dir)
            if renamed and sub is not None:  # not durable, so not committed: a restart
                try:  # must not find it either
                    os.unlink(name, dir_fd=sub)
                except FileNotFoundError:
                    pass
                except OSError:
                    with self._dirs_lock:  # retried at close, unless written again first
                        self._doomed.add(key)
            raise TierIOError(
                self.name, f"write segment {key[1]} ({len(data):,} bytes)", exc
            ) from exc
        finally:
            if head is not None:
                for part in parts:
                    part.release()
                head.close()
            if bounce is not None:
                data.release()
                bounce.close()
        return tag

    async def read_into(self, key: SegmentKey, out: memoryview) -> None:
        await self.read_many_into([(key, out)])

    async def read_many_into(self, items: Sequence[tuple[SegmentKey, memoryview]]) -> None:
        """Read several committed segments, in order, in one worker-thread call.

        A promotion reads a whole history (one segment per turn) this way: one hop to a
        worker thread instead of one per segment. Stops at the first segment that fails;
        the ones before it are complete. A damaged one is quarantined and raised as
        :class:`~tieredkv.errors.CorruptSegmentError`.
        """
        limiter = self._check_open()
        for key, out in items:
            length = self._index.get(key)
            if length is None:
                raise KeyError(key)
            if len(out) != length:
                raise ValueError(f"segment is {length} bytes, the buffer {len(out)}")
        done, failure = await anyio.to_thread.run_sync(self._read_many_sync, items, limiter=limiter)
        for _, out in items[:done]:
            self._counters["reads"] += 1
            self._counters["bytes_read"] += len(out)
        if failure is not None:
            key = items[done][0]
            # raised here, outside any except block: the original exception's traceback
            # would keep views of the caller's buffers alive
            detail, code, reason = failure
            if code is None:
                await self._quarantine(key)
                raise CorruptSegmentError(segment_file_name(key), detail)
            raise TierIOError(self.name, detail, OSError(code, reason))

    def _read_many_sync(
        self, items: Sequence[tuple[SegmentKey, memoryview]]
    ) -> tuple[int, tuple[str, int | None, str] | None]:
        for i, (key, out) in enumerate(items):
            failure = self._read_checked(key, out, segment_file_name(key))
            if failure is not None:
                return i, failure
        return len(items), None

    def _read_checked(
        self, key: SegmentKey, out: memoryview, rel: str
    ) -> tuple[str, int | None, str] | None:
        """Read and verify; ``None``, or (detail, errno or None if corrupt, reason)."""
        bounce: mmap.mmap | None = None
        target = out
        if self._direct and not _aligned(out):
            bounce = mmap.mmap(-1, len(out))
            target = memoryview(bounce)
        failure: tuple[str, int | None, str] | None = None
        try:
            xx, name = rel.split("/")
            try:
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                sub = self._subdir(xx, create=False)
                fd = os.open(name, flags | (_O_DIRECT if self._direct else 0), dir_fd=sub)
            except FileNotFoundError:
                return ("file is missing", None, "")
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    return ("a symbolic link or not a directory on its path", None, "")
                return (f"open segment {key[1]}", exc.errno or 0, exc.strerror or str(exc))
            try:
                self._read_verify(fd, key, target, rel)
                if self._key is not None:
                    header, _ = parse_header(target, rel, len(target))
                    check_header_mac(header, self._key, rel)
                    check_body_mac(target, header, self._key, rel)
            except CorruptSegmentError as exc:
                failure = (exc.detail, None, "")
            except OSError as exc:
                failure = (f"read segment {key[1]}", exc.errno or 0, exc.strerror or str(exc))
            finally:
                if not self._direct:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            if failure is None and bounce is not None:
                out[:] = target
        finally:
            if bounce is not None:
                target.release()
                bounce.close()
        return failure

    def _read_verify(self, fd: int, key: SegmentKey, out: memoryview, rel: str) -> None:
        """Read the file into ``out`` and verify it.

        A segment of one chunk or less (most are: one turn's K/V) is read with one call
        and hashed in this thread. A larger one is read chunk by chunk, pipelined
        (:meth:`_read_verify_pipelined`). The small path hands nothing to other threads:
        each hand-off is a wake-up that must take the GIL, and the model's thread, which
        on a GPU spends most of a step in Python, waits for each
        (``benchmarks/bench_interference.py --python-bound`` measures what loads cost such
        a model).
        """
        size = len(out)
        if size > self._chunk:
            self._read_verify_pipelined(fd, key, out, rel)
            return
        with out[:] as whole:  # _pread_full releases the view it is given
            n = _pread_full(fd, whole, 0)
        if n < size:
            raise CorruptSegmentError(rel, f"file ends at {n} of {size} bytes (truncated)")
        expected = _check_header(out, key, rel, self._tags.get(key))
        if hash_body(out[hashed_from(out) :]) != expected:
            raise CorruptSegmentError(rel, "body checksum mismatch")

    def _read_verify_pipelined(self, fd: int, key: SegmentKey, out: memoryview, rel: str) -> None:
        """Read the file into ``out`` chunk by chunk, hashing it as it arrives.

        Up to four chunk reads are in flight (in the reader threads), so the device
        queue never drains between chunks; each chunk's body bytes are hashed in the hasher
        thread while later chunks are read, so only the last chunk's hash adds to the
        latency. Every read and hash has finished when this returns or raises: ``out`` is
        never touched afterwards, and no view of it outlives the call.
        """
        assert self._hasher is not None
        assert self._readers is not None
        readers, hasher_pool = self._readers, self._hasher
        size = len(out)
        spans = [(at, min(size, at + self._chunk)) for at in range(0, size, self._chunk)]
        reads: deque[tuple[int, int, Future[int]]] = deque()
        hashes: list[Future[None]] = []
        hasher = xxhash.xxh3_64()
        checked = False  # the header, once the chunks holding it are in
        expected = 0
        hashed = 0  # bytes handed to the hasher so far (absolute offset)
        issued = 0

        def issue() -> None:
            nonlocal issued
            start, end = spans[issued]
            issued += 1
            reads.append((start, end, readers.submit(_pread_full, fd, out[start:end], start)))

        try:
            while issued < min(_READ_DEPTH, len(spans)):
                issue()
            while reads:
                start, end, future = reads.popleft()
                n = future.result()
                if n < end - start:
                    raise CorruptSegmentError(
                        rel, f"file ends at {start + n} of {size} bytes (truncated)"
                    )
                if issued < len(spans):
                    issue()
                if not checked:
                    if end < PREFIX.size:
                        continue
                    _, hlen, _, _ = PREFIX.unpack_from(out, 0)
                    if PREFIX.size + hlen > end and end < size:
                        continue  # the header spans several chunks
                    expected = _check_header(out[:end], key, rel, self._tags.get(key), size)
                    checked = True
                    hashed = PREFIX.size + hlen  # everything after the header is hashed
                upto = end
                if upto > hashed:
                    hashes.append(hasher_pool.submit(hasher.update, out[hashed:upto]))
                    hashed = upto
            for h in hashes:
                h.result()
            if not checked or hasher.intdigest() != expected:
                raise CorruptSegmentError(rel, "body checksum mismatch")
        finally:
            # on error, let in-flight work finish before the caller reuses or frees ``out``
            pending: list[Future[Any]] = [r[2] for r in reads] + hashes
            reads.clear()
            hashes.clear()
            for f in pending:
                with contextlib.suppress(Exception):
                    f.result()

    async def delete(self, key: SegmentKey) -> None:
        limiter = self._check_open()
        length = self._index.get(key)
        if length is None:
            return
        try:
            await anyio.to_thread.run_sync(self._delete_sync, key, limiter=limiter)
        except OSError as exc:
            raise TierIOError(self.name, f"delete segment {key[1]}", exc) from exc
        if self._index.pop(key, None) is not None:
            self._used -= length
            self._tags.pop(key, None)
            self._end_incarnation(key[0])

    def _remove_doomed(self) -> None:
        """Remove the files of failed writes whose cleanup failed (a restart would
        otherwise find segments whose write was reported as failed)."""
        for key in sorted(self._doomed):
            try:
                self._delete_sync(key)
            except OSError as exc:
                _log.error(
                    "tier %r: could not remove segment %s of a failed write (%s); a restart "
                    "may find it",
                    self.name,
                    segment_file_name(key),
                    exc,
                )
        self._doomed.clear()

    def _delete_sync(self, key: SegmentKey) -> None:
        xx, name = segment_file_name(key).split("/")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._subdir(xx, create=False))

    async def _quarantine(self, key: SegmentKey) -> None:
        length = self._index.pop(key, None)
        if length is None:
            return
        self._used -= length
        self._tags.pop(key, None)
        self._end_incarnation(key[0])
        self._counters["corrupt"] += 1
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._quarantine_key, key)

    def _quarantine_key(self, key: SegmentKey, why: str = "failed verification on read") -> None:
        xx, name = segment_file_name(key).split("/")
        try:
            sub = self._subdir(xx, create=False)
        except OSError as exc:
            _log.warning("tier %r: segments/%s cannot be opened (%s)", self.name, xx, exc)
            return
        self._quarantine_entry(sub, name, why)

    def _quarantine_entry(self, parent: int, name: str, why: str, *, keep: bool = False) -> None:
        """Move ``name`` (in the directory ``parent``) to quarantine/; a link moves as a link.

        If it cannot be moved it is deleted (it failed verification: it can never be
        served), unless ``keep`` (it could not be read, and may be whole: the next open
        looks at it again; it is not indexed meanwhile).
        """
        dest = f"{name}.{time.time_ns()}"
        try:
            os.replace(name, dest, src_dir_fd=parent, dst_dir_fd=self._dirs["quarantine"])
        except FileNotFoundError:
            return
        except OSError as exc:
            if keep:
                _log.warning(
                    "tier %r: could not move %s aside (%s); leaving it (%s)",
                    self.name,
                    name,
                    exc,
                    why,
                )
                return
            _log.warning("tier %r: could not move %s aside (%s); deleting it", self.name, name, exc)
            _unlink_quietly(name, parent)
            return
        _log.warning("tier %r: moved damaged %s to quarantine/%s (%s)", self.name, name, dest, why)

    def contains(self, key: SegmentKey) -> bool:
        return key in self._index

    def length(self, key: SegmentKey) -> int:
        return self._index[key]

    def keys(self) -> Iterator[SegmentKey]:
        """Committed segment keys."""
        return iter(tuple(self._index))

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            kind=self.kind,
            capacity=self._capacity,
            used=self._used,
            segments=len(self._index),
            direct_io=self._direct,
            notes=tuple(self._notes),
            bytes_read=self._counters["bytes_read"],
            bytes_written=self._counters["bytes_written"],
            reads=self._counters["reads"],
            writes=self._counters["writes"],
            corrupt=self._counters["corrupt"],
        )

    # -- span reads (layer-wise restores) --------------------------------------------------
    async def read_spans_into(
        self,
        items: Sequence[tuple[SegmentKey, memoryview]],
        ends: Sequence[Sequence[int]],
        landed: Callable[[int], None],
    ) -> None:
        """Read several committed segments span by span, in span order, verified.

        See :class:`~tieredkv.backends.base.RangedReadTier`. Span boundaries must be
        multiples of 4096 bytes and, with O_DIRECT, ``out`` 4096-aligned (as tier-0 slots
        and staging buffers are). Up to four span reads are in flight (reader threads); a
        segment's body hash is computed span by span as spans land (in the hasher thread),
        so only the last span's hashing adds to the latency. With a secret, both MACs are
        checked over each whole segment at the end.
        """
        limiter = self._check_open()
        groups = len(ends[0]) if ends else 0
        for (key, out), cuts in zip(items, ends, strict=True):
            length = self._index.get(key)
            if length is None:
                raise KeyError(key)
            if len(out) != length:
                raise ValueError(f"segment is {length} bytes, the buffer {len(out)}")
            if len(cuts) != groups or not cuts or cuts[-1] != length:
                raise ValueError(
                    "every segment needs the same number of spans, ending at its length"
                )
            if any(b < a for a, b in itertools.pairwise([0, *cuts])) or any(
                c % ALIGN for c in cuts
            ):
                raise ValueError(f"span ends must be non-decreasing multiples of {ALIGN}")
            if self._direct and not _aligned(out):
                raise ValueError(f"with O_DIRECT the buffers must be {ALIGN}-aligned")
        failure = await anyio.to_thread.run_sync(
            self._read_spans_sync, items, ends, landed, limiter=limiter
        )
        if failure is None:
            for _, out in items:
                self._counters["reads"] += 1
                self._counters["bytes_read"] += len(out)
            return
        i, detail, code, reason = failure
        key = items[i][0]
        if code is None:
            await self._quarantine(key)
            raise CorruptSegmentError(segment_file_name(key), detail)
        raise TierIOError(self.name, detail, OSError(code, reason))

    def _read_spans_sync(
        self,
        items: Sequence[tuple[SegmentKey, memoryview]],
        ends: Sequence[Sequence[int]],
        landed: Callable[[int], None],
    ) -> tuple[int, str, int | None, str] | None:
        """The worker side of :meth:`read_spans_into`: ``None``, or (segment index, detail,
        errno or None if corrupt, reason)."""
        assert self._readers is not None
        assert self._hasher is not None
        readers, hasher_pool = self._readers, self._hasher
        rels = [segment_file_name(key) for key, _ in items]
        fds: list[int] = []
        reads: deque[tuple[int, int, int, Future[int]]] = deque()
        hashes: list[Future[None]] = []
        hashers = [xxhash.xxh3_64() for _ in items]
        expected: list[int | None] = [None] * len(items)
        hashed = [0] * len(items)  # absolute offset hashed up to (after the header)
        try:
            for i, rel in enumerate(rels):
                xx, name = rel.split("/")
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
                try:
                    sub = self._subdir(xx, create=False)
                    fds.append(
                        os.open(name, flags | (_O_DIRECT if self._direct else 0), dir_fd=sub)
                    )
                except FileNotFoundError:
                    return (i, "file is missing", None, "")
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        return (i, "a symbolic link or not a directory on its path", None, "")
                    return (i, f"open segment {items[i][0][1]}", exc.errno or 0, exc.strerror or "")
            # every read, in span order, split into chunks of at most chunk_size
            plan: list[tuple[int, int, int, int]] = []  # (group, segment, start, end)
            groups = len(ends[0]) if ends else 0
            for g in range(groups):
                for i, cuts in enumerate(ends):
                    start = cuts[g - 1] if g else 0
                    plan.extend(
                        (g, i, at, min(cuts[g], at + self._chunk))
                        for at in range(start, cuts[g], self._chunk)
                    )
            last_of = dict.fromkeys(range(groups), -1)
            for n, (g, *_rest) in enumerate(plan):
                last_of[g] = n
            issued = 0

            def issue() -> None:
                nonlocal issued
                _, i, start, end = plan[issued]
                out = items[i][1]
                reads.append(
                    (issued, i, start, readers.submit(_pread_full, fds[i], out[start:end], start))
                )
                issued += 1

            done = -1  # plan entries finished, in order
            for g in range(groups):
                while done < last_of[g]:
                    while issued < len(plan) and len(reads) < _READ_DEPTH:
                        issue()
                    n, i, start, future = reads.popleft()
                    try:
                        got = future.result()
                    except OSError as exc:
                        return (
                            i,
                            f"read segment {items[i][0][1]}",
                            exc.errno or 0,
                            exc.strerror or "",
                        )
                    end = plan[n][3]
                    if got < end - start:
                        return (
                            i,
                            f"file ends at {start + got} of {len(items[i][1])} bytes (truncated)",
                            None,
                            "",
                        )
                    done = n
                for i, ((key, out), cuts) in enumerate(zip(items, ends, strict=True)):
                    upto = cuts[g]
                    if expected[i] is None:
                        if upto < PREFIX.size:
                            continue
                        _, hlen, _, _ = PREFIX.unpack_from(out, 0)
                        if PREFIX.size + hlen > upto and upto < len(out):
                            continue  # the header spans several spans
                        try:
                            expected[i] = _check_header(
                                out[:upto], key, rels[i], self._tags.get(key), len(out)
                            )
                        except CorruptSegmentError as exc:
                            return (i, exc.detail, None, "")
                        hashed[i] = PREFIX.size + hlen
                    if upto > hashed[i]:
                        hashes.append(hasher_pool.submit(hashers[i].update, out[hashed[i] : upto]))
                        hashed[i] = upto
                landed(g)
            for h in hashes:
                h.result()
            for i, ((_, out), rel) in enumerate(zip(items, rels, strict=True)):
                if expected[i] is None or hashers[i].intdigest() != expected[i]:
                    return (i, "body checksum mismatch", None, "")
                if self._key is not None:
                    try:
                        header, _ = parse_header(out, rel, len(out))
                        check_header_mac(header, self._key, rel)
                        check_body_mac(out, header, self._key, rel)
                    except CorruptSegmentError as exc:
                        return (i, exc.detail, None, "")
            return None
        finally:
            # let in-flight work finish before the caller reuses or frees the buffers
            pending: list[Future[Any]] = [r[3] for r in reads] + hashes
            reads.clear()
            hashes.clear()
            for f in pending:
                with contextlib.suppress(Exception):
                    f.result()
            for fd in fds:
                if not self._direct:
                    with contextlib.suppress(OSError):
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                with contextlib.suppress(OSError):
                    os.close(fd)


def _check_header(
    buf: memoryview, key: SegmentKey, rel: str, tag: bytes | None, size: int | None = None
) -> int:
    """Check the header at the start of ``buf`` (the file's ``size`` bytes, all of ``buf``
    by default); return the body hash it records.

    A segment this tier wrote or checked at open (its prefix ``tag`` is known) needs only
    its prefix to be ``tag`` and its header's CRC to hold: that header was checked in full
    then. Otherwise the header is parsed and checked in full, and must name ``key``.
    """
    if tag is None:
        header, expected = parse_header(buf, rel, len(buf) if size is None else size)
        if (header.session, header.seq) != key:
            raise CorruptSegmentError(rel, "header names another segment")
        return expected
    if bytes(buf[: PREFIX.size]) != tag:
        raise CorruptSegmentError(
            rel, "its prefix is not the one this tier stored (damaged, or the file replaced)"
        )
    return check_prefix(buf, rel)[1]


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Read ``len(view)`` bytes at ``offset``; fewer only at the end of the file."""
    got = 0
    with view:
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
            if got % ALIGN:  # the file ends here (O_DIRECT cannot continue unaligned)
                break
    return got


def read_header_at(
    sub: int, name: str, rel: str, key: bytes | None = None
) -> tuple[SegmentHeader, int, bytes]:
    """Read and check the header of file ``name`` in the directory ``sub`` (a descriptor;
    never through a symlink) whose path under ``segments/`` is ``rel``: its CRC, its
    contents against the file's size, that ``rel`` is its key's name, and with ``key``
    (from :func:`~tieredkv.payload.derive_key`) its MAC. Returns the header, the file's
    size and its prefix.

    Any failure, including an I/O error on this one file, is a
    :class:`~tieredkv.errors.CorruptSegmentError`: the file is set aside, the rest open.
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sub)
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, ALIGN, 0)
            if len(head) >= PREFIX.size:
                _, hlen, _, _ = PREFIX.unpack_from(head, 0)
                need = PREFIX.size + hlen
                if need > len(head) and need <= size:
                    head = os.pread(fd, need, 0)
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError as exc:
        raise CorruptSegmentError(rel, f"its header cannot be read ({exc})") from exc
    header, _ = parse_header(memoryview(head), rel, size)
    if segment_file_name((header.session, header.seq)) != rel:
        raise CorruptSegmentError(rel, "file name does not match its header")
    if key is not None:
        check_header_mac(header, key, rel)
    return header, size, head[: PREFIX.size]


def _unlink_quietly(name: str, dir_fd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)
