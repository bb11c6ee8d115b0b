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
against the file's length); a file whose header was read and found wrong is quarantined and
the tier opens with the rest (:meth:`SSDTier.set_aside` names them per session). An I/O
error is not evidence of damage: a header read that fails is tried again (5 tries over
0.44 s, :mod:`tieredkv.backends._retry`), and if it still fails, :meth:`SSDTier.open` fails
with a :class:`~tieredkv.errors.TierIOError` naming the file, having moved and deleted
nothing, so a later open sees every file. While open, a read serves a
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

Reads verify the header CRC and the body's xxh3 hash while the data streams in: up to four
chunk reads are kept in flight, and the hash of each chunk (in a second thread; xxh3
releases the GIL) overlaps the reads of the next ones. :meth:`SSDTier.read_spans` streams
whole histories that way, handing each span to a consumer (in a third thread) as it
arrives; :meth:`SSDTier.write_filled` writes a segment part by part while its caller is
still serializing the next part. A segment that fails is moved
to ``quarantine/`` and reported as :class:`~tieredkv.errors.CorruptSegmentError`; the cache
treats it as a miss.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
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
from typing import Any, NoReturn

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
    body_mac_hasher,
    check_body_mac,
    check_body_mac_digest,
    check_cuts,
    check_header_mac,
    check_int,
    check_prefix,
    derive_key,
    hash_body,
    hashed_from,
    parse_header,
)
from ._retry import retry_io, tries
from .arena import check_tier_arguments, close_mapping, prefaulted
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
        self._copier: ThreadPoolExecutor | None = None
        self._spare: list[mmap.mmap] = []
        """Prefaulted ``chunk_size`` buffers kept for streamed reads (:meth:`read_spans`)."""
        self._lock_fd: int | None = None
        self._set_aside: dict[str, list[int]] = {}
        """Per file-name digest: the seqs of the files the last open quarantined."""
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
    def span_bytes(self) -> int:
        """Bytes per read call (``chunk_size``): the size :meth:`read_spans` reads best."""
        return self._chunk

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

    def _full_hint(self, exc: OSError) -> str | None:
        """What to do about a full filesystem (or quota), naming the directory; else None."""
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return None
        return (
            f"the filesystem holding {str(self.directory)!r} is full (or its quota is used "
            f"up): free space there, or give the tier a capacity below the space it has "
            f"free (its capacity is {self._capacity:,} bytes)"
        )

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
        self._copier = ThreadPoolExecutor(1, thread_name_prefix=f"tieredkv-{self.name}-copy")
        self._readers = ThreadPoolExecutor(
            self._max_threads * _READ_DEPTH, thread_name_prefix=f"tieredkv-{self.name}-read"
        )
        self._limiter = limiter
        return headers

    def _open_sync(self) -> list[SegmentHeader]:
        root: int | None = None
        self._set_aside.clear()
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
            self._set_aside.clear()
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
                f"lock {str(self.directory)!r}",
                exc,
                hint="another SSDTier has this directory open (a cache in this process or "
                "another, or `tieredkv fsck --repair`): close it first, or give each cache "
                "its own directory",
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
                f"write in {str(self.directory)!r}",
                exc,
                hint=self._full_hint(exc)
                or "it must be writable: fix its permissions or pass another directory",
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
                    header, size, tag = retry_io(
                        functools.partial(read_header_at, sub, name, rel, self._key)
                    )
                except FileNotFoundError:
                    continue  # removed meanwhile
                except CorruptSegmentError as exc:  # read, and proven wrong
                    self._set_aside_file(sub, name, str(exc))
                    continue
                except OSError as exc:  # not evidence of damage: fail the open, move nothing
                    raise TierIOError(
                        self.name,
                        f"read the header of segments/{rel} ({tries()})",
                        exc,
                        hint="nothing was moved or deleted: open it again; if this keeps "
                        "failing, check the device (dmesg, smartctl) or copy the directory "
                        "to a healthy one",
                    ) from exc
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
                xx, name = segment_file_name(key).split("/")
                self._set_aside_file(
                    self._subdir(xx, create=False),
                    name,
                    "its session's files carry different incarnations (a rollback?)",
                )
        return kept

    def _set_aside_file(self, sub: int, name: str, why: str) -> None:
        """Quarantine a file the open found damaged, and remember it (:meth:`set_aside`)."""
        digest, _, rest = name.partition(".")
        seq = rest.removesuffix(".seg")
        if seq.isdigit():
            self._set_aside.setdefault(digest, []).append(int(seq))
        self._counters["corrupt"] += 1
        self._quarantine_entry(sub, name, why)

    def set_aside(self, session: str) -> tuple[int, ...]:
        """The turns (segment numbers) of ``session`` whose files the last :meth:`open`
        found damaged and moved to ``quarantine/``, in order.

        Matched by file name, so it names them even when a header was unreadable garbage.
        The cache reports a history that came back shorter because of them
        (:meth:`~tieredkv.TieredKVCache.truncated`).
        """
        digest = segment_file_name((session, 0)).split("/")[1].partition(".")[0]
        return tuple(sorted(self._set_aside.get(digest, ())))

    async def aclose(self) -> None:
        if self._limiter is None:
            return
        self._limiter = None
        for pool in (self._readers, self._hasher, self._copier):
            if pool is not None:
                pool.shutdown(wait=True)
        self._readers = self._hasher = self._copier = None
        while self._spare:
            close_mapping(self._spare.pop(), f"tier {self.name!r}'s span buffer", collect=True)
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
        await self._write(key, data, None)

    async def write_filled(
        self,
        key: SegmentKey,
        data: memoryview,
        cuts: Sequence[int],
        fill: Callable[[int], None],
    ) -> None:
        """Commit the reservation for ``key`` with ``data``, which ``fill(k)`` makes valid
        part by part while the parts before it are written.

        ``fill(k)`` (called in a worker thread, for k = 0, 1, ... in order) makes bytes
        ``[0, cuts[k + 1])`` of ``data`` final, except the first page-aligned part's (up to
        ``cuts[1]`` rounded down to 4 KiB), which only the last call makes final (it holds
        the header, whose checksum covers everything). Each part is written as soon as it
        is final, so serializing a segment and writing it overlap; the first part is
        written last. Atomic and durable as :meth:`write`.
        """
        await self._write(key, data, (check_cuts(cuts, len(data)), fill))

    async def _write(
        self,
        key: SegmentKey,
        data: memoryview,
        filled: tuple[list[int], Callable[[int], None]] | None,
    ) -> None:
        limiter = self._check_open()
        length = self._reserved.get(key)
        if length is None:
            raise ValueError(f"segment {key[1]} has no reservation in tier {self.name!r}")
        if len(data) != length:
            raise ValueError(f"reserved {length} bytes, asked to write {len(data)}")
        incarnation = self._begin_incarnation(key[0])
        try:
            tag = await anyio.to_thread.run_sync(
                self._write_sync, key, data, incarnation, filled, limiter=limiter
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

    def _write_sync(
        self,
        key: SegmentKey,
        data: memoryview,
        incarnation: bytes | None,
        filled: tuple[list[int], Callable[[int], None]] | None = None,
    ) -> bytes:
        """Write ``data`` as ``key``'s file, atomically; return its prefix. With ``filled``
        (cuts and fill, see :meth:`write_filled`) the data is filled part by part as it is
        written where it can be (O_DIRECT from an aligned buffer, no MAC), or first."""
        if filled is not None and (self._key is not None or not _aligned(data)):
            cuts, fill = filled
            for k in range(len(cuts) - 1):
                fill(k)
            filled = None
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
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags | (_O_DIRECT if self._direct else 0), 0o644, dir_fd=tmp_dir)
            try:
                if filled is not None:
                    self._write_while_filling(fd, data, *filled)
                at = 0
                for part in parts if filled is None else []:
                    _pwrite_full(fd, part, at)
                    at += len(part)
                tag = bytes(parts[0][: PREFIX.size])  # complete only now, when filled
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
                self.name,
                f"write segment {key[1]} ({len(data):,} bytes)",
                exc,
                hint=self._full_hint(exc),
            ) from exc
        except BaseException:  # the caller's fill failed: nothing was renamed
            _unlink_quietly(tmp, tmp_dir)
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

    def _write_while_filling(
        self, fd: int, data: memoryview, cuts: list[int], fill: Callable[[int], None]
    ) -> None:
        """Fill ``data`` part by part and write each part once final, the first part last;
        every write has finished when this returns or raises."""
        assert self._readers is not None
        # the first part is at least the prefix's page: it is written last, once final
        bounds = [0, *(max(ALIGN, c - c % ALIGN) for c in cuts[1:-1]), len(data)]
        writes: list[Future[None]] = []
        try:
            for k in range(len(cuts) - 1):
                fill(k)
                lo, hi = bounds[k], bounds[k + 1]
                if k and hi > lo:
                    writes.append(self._readers.submit(_pwrite_full, fd, data[lo:hi], lo))
            if bounds[1] > 0:
                _pwrite_full(fd, data[: bounds[1]], 0)
        finally:
            failure: BaseException | None = None
            for w in writes:
                try:
                    w.result()
                except BaseException as exc:  # the first one is raised
                    failure = failure or exc
        if failure is not None:
            raise failure

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
            await self._raise_read_failure(items[done][0], failure)

    async def _raise_read_failure(
        self, key: SegmentKey, failure: tuple[str, int | None, str]
    ) -> NoReturn:
        """Quarantine ``key`` and raise :class:`CorruptSegmentError` if it was damaged (no
        errno), or raise the I/O error as :class:`TierIOError`.

        Raised here, outside any except block: the original exception's traceback would keep
        views of the caller's buffers alive.
        """
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
            fd = self._open_segment(key)
            if isinstance(fd, tuple):
                return fd
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
                self._close_segment(fd)
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

    async def read_spans(
        self,
        items: Sequence[tuple[SegmentKey, Sequence[tuple[int, int]]]],
        consume: Callable[[int, int, memoryview], None],
        *,
        into: Sequence[memoryview] | None = None,
        order: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Stream several committed segments to ``consume``, span by span, as they arrive.

        Each item is a segment and its spans: byte ranges ``(start, end)`` that together
        cover it from 0 to its length, in order, each starting at a multiple of 4 KiB at or
        before the previous one's end (they may overlap by less than a page), each ending at
        a multiple of 4 KiB or the segment's end. ``consume(item, span, view)`` gets each
        span's bytes (valid only during the call) in a worker thread, in order, while later
        spans are read: up to four reads are in flight across segment boundaries, each
        segment's checksum (and MAC) is computed in the hasher thread as its spans arrive,
        and the spans are read into a small pool of reused, prefaulted buffers, so a
        history of any size needs a few chunks of memory, not a segment-sized buffer.

        :param into: one buffer per item, the segment's length, to read the spans straight
            into (at their offsets) instead of the pool's buffers: a promotion reads into its
            new slots this way. With O_DIRECT they must be 4 KiB-aligned.
        :param order: the ``(item, span)`` pairs in the order to read and deliver them
            (default: every span of item 0, then of item 1, ...); each item's spans must come
            in their own order. A layer-wise restore reads every segment's first span, then
            every segment's second, and so on.

        A segment is verified when its last span has arrived, so ``consume`` sees bytes
        before they are checked: what it built is final only once this returns. A failure
        stops the stream (the segments whose last span came before it were delivered and
        verified); a damaged segment is quarantined and raised as
        :class:`~tieredkv.errors.CorruptSegmentError`, an I/O error as
        :class:`~tieredkv.errors.TierIOError`; an exception from ``consume`` propagates.
        """
        limiter = self._check_open()
        for i, (key, spans) in enumerate(items):
            length = self._index.get(key)
            if length is None:
                raise KeyError(key)
            _check_spans(spans, length)
            tag = self._tags.get(key)
            if tag is not None and spans[0][1] < PREFIX.size + PREFIX.unpack_from(tag)[1]:
                raise ValueError(
                    f"the first span of segment {key[1]} ends at {spans[0][1]}, inside its "
                    f"header ({PREFIX.size + PREFIX.unpack_from(tag)[1]} bytes): it must hold "
                    f"the whole header"
                )
            if into is not None:
                if len(into[i]) != length:
                    raise ValueError(f"segment is {length} bytes, the buffer {len(into[i])}")
                if self._direct and not _aligned(into[i]):
                    raise ValueError(f"with O_DIRECT the buffers must be {ALIGN}-aligned")
        if into is not None and len(into) != len(items):
            raise ValueError(f"{len(items)} segments but {len(into)} buffers")
        jobs = _span_order(items, order)
        verified, failure = await anyio.to_thread.run_sync(
            self._read_spans_sync, items, jobs, consume, into, limiter=limiter
        )
        for i in verified:
            self._counters["reads"] += 1
            self._counters["bytes_read"] += self._index.get(items[i][0], 0)
        if failure is not None:
            i, why = failure
            await self._raise_read_failure(items[i][0], why)

    def _span_buffer(self, size: int) -> mmap.mmap:
        """A prefaulted buffer of at least ``size`` bytes from the pool (or a new one)."""
        with self._dirs_lock:
            for i, buf in enumerate(self._spare):
                if len(buf) >= size:
                    return self._spare.pop(i)
        return prefaulted(max(size, self._chunk))

    def _give_back(self, buf: mmap.mmap) -> None:
        with self._dirs_lock:
            if len(buf) == self._chunk and len(self._spare) < _SPARE_BUFFERS:
                self._spare.append(buf)
                return
        with contextlib.suppress(BufferError):
            buf.close()

    def _read_spans_sync(
        self,
        items: Sequence[tuple[SegmentKey, Sequence[tuple[int, int]]]],
        jobs: list[tuple[int, int]],
        consume: Callable[[int, int, memoryview], None],
        into: Sequence[memoryview] | None,
    ) -> tuple[list[int], tuple[int, tuple[str, int | None, str]] | None]:
        """The stream itself (see :meth:`read_spans`); returns the items verified, in the
        order they were, and the failure that stopped it (the item, and the failure as
        :meth:`_read_checked` reports one)."""
        assert self._hasher is not None
        assert self._readers is not None
        assert self._copier is not None
        readers, hasher_pool, copier = self._readers, self._hasher, self._copier
        size = max(items[i][1][k][1] - items[i][1][k][0] for i, k in jobs)
        ring = [] if into is not None else [self._span_buffer(size) for _ in range(_RING)]
        free = list(ring)
        # (item, span, buffer or None, view, read); a buffer returns to ``free`` once its
        # span is hashed and consumed (``busy``, oldest first)
        inflight: deque[tuple[int, int, mmap.mmap | None, memoryview, Future[int]]] = deque()
        busy: deque[tuple[mmap.mmap | None, list[Future[None]]]] = deque()
        fds: dict[int, int] = {}
        reading: dict[int, _SegmentRead] = {}
        verified: list[int] = []
        issued = 0
        try:
            while True:
                while issued < len(jobs) and len(inflight) < _READ_DEPTH:
                    while into is None and not free:  # the oldest span's buffer, once done
                        done_buf, futures = busy.popleft()
                        for f in futures:
                            f.result()  # an exception from consume propagates
                        if done_buf is not None:
                            free.append(done_buf)
                    i, k = jobs[issued]
                    key, spans = items[i]
                    if i not in fds:
                        fd = self._open_segment(key)
                        if isinstance(fd, tuple):
                            return verified, (i, fd)
                        fds[i] = fd
                    start, end = spans[k]
                    buf: mmap.mmap | None = None
                    if into is None:
                        buf = free.pop()
                        view = memoryview(buf)[: end - start]
                    else:
                        view = into[i][start:end]
                    # _pread_full releases the view it is given: give it its own
                    read = readers.submit(_pread_full, fds[i], view[:], start)
                    inflight.append((i, k, buf, view, read))
                    issued += 1
                if not inflight:
                    return verified, None
                i, k, buf, view, future = inflight.popleft()
                key, spans = items[i]
                start, end = spans[k]
                length = self._index[key]
                rel = segment_file_name(key)
                try:
                    n = future.result()
                except OSError as exc:
                    why = (f"read segment {key[1]}", exc.errno or 0, exc.strerror or str(exc))
                    return verified, (i, why)
                # ``view`` is not released here: the copier thread may still be using it
                # (its buffer is reused only once it is done, and unmapped at close)
                try:
                    if n < end - start:
                        raise CorruptSegmentError(
                            rel, f"file ends at {start + n} of {length} bytes (truncated)"
                        )
                    if k == 0:
                        reading[i] = self._begin_segment_read(view, key, rel, length)
                    seg = reading[i]
                    futures = seg.feed(hasher_pool, view, start, end)
                except CorruptSegmentError as exc:
                    if buf is not None:
                        free.append(buf)
                    return verified, (i, (exc.detail, None, ""))
                # copied out in the copier thread, so this one reissues reads meanwhile
                copying = copier.submit(consume, i, k, view)
                busy.append((buf, [*futures, copying]))
                seg.copies.append(copying)
                if end == length:
                    try:
                        reading.pop(i).finish()
                    except CorruptSegmentError as exc:
                        return verified, (i, (exc.detail, None, ""))
                    self._close_segment(fds.pop(i))
                    verified.append(i)
        finally:
            # let every read, hash and copy finish before a buffer is reused
            for *_, future in inflight:
                with contextlib.suppress(Exception):
                    future.result()
            for _, futures in busy:
                for f in futures:
                    with contextlib.suppress(Exception):
                        f.result()
            for fd in fds.values():
                self._close_segment(fd)
            for buf in ring:
                self._give_back(buf)

    def _open_segment(self, key: SegmentKey) -> int | tuple[str, int | None, str]:
        """Open ``key``'s file for reading; its descriptor, or the failure (as
        :meth:`_read_checked` reports one)."""
        xx, name = segment_file_name(key).split("/")
        try:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            sub = self._subdir(xx, create=False)
            return os.open(name, flags | (_O_DIRECT if self._direct else 0), dir_fd=sub)
        except FileNotFoundError:
            return ("file is missing", None, "")
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return ("a symbolic link or not a directory on its path", None, "")
            return (f"open segment {key[1]}", exc.errno or 0, exc.strerror or str(exc))

    def _close_segment(self, fd: int) -> None:
        if not self._direct:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with contextlib.suppress(OSError):  # Linux closes the descriptor even then
            os.close(fd)

    def _begin_segment_read(
        self, first: memoryview, key: SegmentKey, rel: str, length: int
    ) -> _SegmentRead:
        """Check a segment's header in its first span; the state that verifies the rest."""
        expected = _check_header(first, key, rel, self._tags.get(key), length)
        mac = None
        if self._key is not None:
            header, _ = parse_header(first, rel, length)
            check_header_mac(header, self._key, rel)
            mac = (body_mac_hasher(self._key), header)
        return _SegmentRead(rel, hashed_from(first), expected, mac)

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

    async def quarantine(self, key: SegmentKey, why: str) -> None:
        """Move committed segment ``key``'s file to ``quarantine/`` (never deleted, never
        served again) and forget it; for repair tools (``tieredkv fsck --repair`` moves
        segments no cache would recover there). A cache never calls it.

        :raises KeyError: if the tier holds no such segment
        """
        self._check_open()
        if key not in self._index:
            raise KeyError(key)
        await self._quarantine(key, why, corrupt=False)

    async def _quarantine(
        self, key: SegmentKey, why: str = "failed verification on read", *, corrupt: bool = True
    ) -> None:
        length = self._index.pop(key, None)
        if length is None:
            return
        self._used -= length
        self._tags.pop(key, None)
        self._end_incarnation(key[0])
        self._counters["corrupt"] += corrupt
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._quarantine_key, key, why)

    def _quarantine_key(self, key: SegmentKey, why: str) -> None:
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
        and staging buffers are). This is :meth:`read_spans` reading straight into ``out``,
        every segment's span 0 first, then every segment's span 1, and so on: up to four
        reads in flight, each segment's checksum and MAC computed as its spans land.
        """
        groups = len(ends[0]) if ends else 0
        spans: list[list[tuple[int, int]]] = []
        group_of: list[list[int]] = []  # each span's group
        for (_, out), cuts in zip(items, ends, strict=True):
            if len(cuts) != groups or not cuts or cuts[-1] != len(out):
                raise ValueError(
                    "every segment needs the same number of spans, ending at its length"
                )
            if any(b < a for a, b in itertools.pairwise([0, *cuts])) or any(
                c % ALIGN for c in cuts
            ):
                raise ValueError(f"span ends must be non-decreasing multiples of {ALIGN}")
            seg_spans: list[tuple[int, int]] = []
            seg_groups: list[int] = []
            start = 0
            for g, end in enumerate(cuts):
                if end > start:  # an empty span has nothing to read
                    seg_spans.append((start, end))
                    seg_groups.append(g)
                start = end
            spans.append(seg_spans)
            group_of.append(seg_groups)
        pending = [0] * groups  # spans of each group not delivered yet
        for seg_groups in group_of:
            for g in seg_groups:
                pending[g] += 1
        done = 0  # groups reported landed

        def deliver(item: int, k: int, view: memoryview) -> None:
            nonlocal done
            pending[group_of[item][k]] -= 1
            while done < groups and not pending[done]:
                landed(done)
                done += 1

        order = sorted((g, i, k) for i, gs in enumerate(group_of) for k, g in enumerate(gs))
        await self.read_spans(
            [(key, seg_spans) for (key, _), seg_spans in zip(items, spans, strict=True)],
            deliver,
            into=[out for _, out in items],
            order=[(i, k) for _, i, k in order],
        )


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


def _pwrite_full(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` (``pwrite`` may write less than asked)."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


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

    What was read and found wrong (and a symbolic link, which is never read through) is a
    :class:`~tieredkv.errors.CorruptSegmentError`. An I/O error is raised as the
    :class:`OSError` it is: it proves nothing about the file (try again, see
    :func:`~tieredkv.backends._retry.retry_io`).
    """
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sub)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptSegmentError(rel, "a symbolic link (a tier never follows one)") from None
        raise
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
        with contextlib.suppress(OSError):  # Linux closes the descriptor even then
            os.close(fd)
    header, _ = parse_header(memoryview(head), rel, size)
    if segment_file_name((header.session, header.seq)) != rel:
        raise CorruptSegmentError(rel, "file name does not match its header")
    if key is not None:
        check_header_mac(header, key, rel)
    return header, size, head[: PREFIX.size]


def _unlink_quietly(name: str, dir_fd: int) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


_RING = _READ_DEPTH + 2
"""Span buffers one stream cycles through: the reads in flight, one being hashed and copied
out, one spare."""

_SPARE_BUFFERS = 2 * _RING
"""Span buffers of ``chunk_size`` bytes a tier keeps for later streams (two streams' worth)."""


def _span_order(
    items: Sequence[tuple[SegmentKey, Sequence[tuple[int, int]]]],
    order: Sequence[tuple[int, int]] | None,
) -> list[tuple[int, int]]:
    """The ``(item, span)`` pairs to read, in order; ``ValueError`` if ``order`` misses one,
    repeats one, or puts an item's spans out of their order."""
    if order is None:
        return [(i, k) for i, (_, spans) in enumerate(items) for k in range(len(spans))]
    jobs = list(order)
    nxt = [0] * len(items)
    for i, k in jobs:
        if not 0 <= i < len(items) or k != nxt[i]:
            raise ValueError(
                f"order must list each item's spans once, in their order; ({i}, {k}) is not "
                f"the next span of an item"
            )
        nxt[i] += 1
    if nxt != [len(spans) for _, spans in items]:
        raise ValueError("order leaves out some spans")
    return jobs


def _check_spans(spans: Sequence[tuple[int, int]], length: int) -> None:
    """Refuse spans that do not cover a segment of ``length`` bytes as :meth:`SSDTier.read_spans`
    needs (``ValueError``)."""
    end = 0
    for start, stop in spans:
        if start % ALIGN or (stop % ALIGN and stop != length):
            raise ValueError(f"span ({start}, {stop}) is not aligned to {ALIGN} bytes")
        if not start <= end < stop <= length:
            raise ValueError(
                f"span ({start}, {stop}) does not continue the spans before it (which end at "
                f"{end}) within the segment's {length} bytes"
            )
        end = stop
    if end != length:
        raise ValueError(f"the spans end at {end}, the segment at {length}")


class _SegmentRead:
    """One segment being streamed: its checksum (and MAC) fed in order as spans arrive."""

    def __init__(
        self, rel: str, hashed: int, expected: int, mac: tuple[Any, SegmentHeader] | None
    ) -> None:
        self.rel = rel
        self.hashed = hashed
        """Absolute offset up to which bytes were handed to the hashers."""
        self.expected = expected
        self.xxh = xxhash.xxh3_64()
        self.mac = mac
        self.futures: list[Future[None]] = []
        self.copies: list[Future[None]] = []
        """The consumer's calls for the spans delivered so far."""

    def feed(
        self, pool: ThreadPoolExecutor, view: memoryview, start: int, end: int
    ) -> list[Future[None]]:
        """Hash the part of span ``[start, end)`` (in ``view``) not hashed yet, in ``pool``."""
        if end <= self.hashed:
            return []
        part = view[self.hashed - start :]
        self.hashed = end
        futures = [pool.submit(self.xxh.update, part)]
        if self.mac is not None:
            futures.append(pool.submit(self.mac[0].update, part))
        self.futures.extend(futures)
        return futures

    def finish(self) -> None:
        """Check the digests once every span was fed (``CorruptSegmentError`` if wrong)."""
        for f in self.futures:
            f.result()
        for f in self.copies:
            f.result()  # an exception from consume propagates
        if self.xxh.intdigest() != self.expected:
            raise CorruptSegmentError(self.rel, "body checksum mismatch")
        if self.mac is not None:
            check_body_mac_digest(self.mac[0].digest(), self.mac[1], self.rel)
