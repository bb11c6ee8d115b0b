"""Reading whole segments from an SSD tier, verified while the data streams in.

A segment of one chunk or less is read with one call and hashed in the calling thread. A
larger one is read chunk by chunk with up to eight chunk reads in flight, and the hash of
each chunk (in a second thread; xxh3 releases the GIL) overlaps the reads of the next ones.
With a secret, both MACs are checked too. Nothing here raises for a failed read: each read
returns its failure (``(detail, errno or None if the file is damaged, reason)``), which the
tier turns into :class:`~tieredkv.errors.CorruptSegmentError` (after quarantining the file)
or :class:`~tieredkv.errors.TierIOError`.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

from ...errors import CorruptSegmentError
from ...payload import (
    PREFIX,
    check_body_mac,
    check_header_mac,
    check_prefix,
    hash_body,
    hashed_from,
    parse_header,
)
from .._buffers import aligned, anonymous
from ..base import SegmentKey
from .dirs import TierDirectory
from .index import SegmentIndex
from .layout import file_parts, pread_full, segment_file_name

__all__ = ["READ_DEPTH", "VERIFYING", "Failure", "SegmentReader", "Workers", "check_header"]

READ_DEPTH = 8
"""Chunk (or span) reads in flight at once. With 4, an open cache's load of 8 turns of
64 MiB read at 0.72-0.91x raw O_DIRECT reads with 4 in flight (in one process, alternating,
5 reps each: ``/tmp`` probe); with 8, at 0.90-1.0x. (That was measured when a stream issued
its next read only once the oldest one was in and handled; it now issues one as soon as a
read returns. Having the reader thread whose read returned start the next one itself, with
no hand-off back to the stream's thread, did not speed a load:
``docs/explanation/api-performance.md``, 8 December 2026.)"""

VERIFYING = 8
"""Segments read whole, beyond the :data:`READ_DEPTH` reads in flight, that a span stream
lets its reader threads verify while it issues further reads. A one-span segment's job reads the
file and then hashes it in the same thread; the stream takes the read's slot back as soon
as the read returns, not when the hash is done. When the device returned a wave of eight
8 MiB reads at once, their eight hashes on two cores held the next wave back by 3-7 ms
(timelines of ``preadv`` calls in a load of 16 x 8 MiB, beside raw O_DIRECT reads whose
next read is issued at once: ``docs/explanation/api-performance.md``)."""

Failure = tuple[str, int | None, str]
"""A failed read: what was being done, the errno (``None``: the file is damaged), the reason."""


class Workers:
    """The threads an open SSD tier reads, hashes and copies with (besides anyio's).

    :param tier: the tier's name, in the threads' names
    :param max_threads: the tier's thread limit (``READ_DEPTH + VERIFYING`` readers each)
    """

    def __init__(self, tier: str, max_threads: int) -> None:
        self._tier = tier
        self._max_threads = max_threads
        self._hasher: ThreadPoolExecutor | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._copier: ThreadPoolExecutor | None = None

    def start(self) -> None:
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix=f"tieredkv-{self._tier}-hash")
        self._copier = ThreadPoolExecutor(1, thread_name_prefix=f"tieredkv-{self._tier}-copy")
        self._readers = ThreadPoolExecutor(
            self._max_threads * (READ_DEPTH + VERIFYING),
            thread_name_prefix=f"tieredkv-{self._tier}-read",
        )

    def stop(self) -> None:
        """Wait for what was submitted, then end the threads."""
        for pool in (self._readers, self._hasher, self._copier):
            if pool is not None:
                pool.shutdown(wait=True)
        self._readers = self._hasher = self._copier = None

    @property
    def readers(self) -> ThreadPoolExecutor:
        """Chunk reads (and the parts of a filled write)."""
        assert self._readers is not None
        return self._readers

    @property
    def hasher(self) -> ThreadPoolExecutor:
        """Checksums and MACs of the chunks read, one thread, in order."""
        assert self._hasher is not None
        return self._hasher

    @property
    def copier(self) -> ThreadPoolExecutor:
        """A stream's consumer, one thread, in order."""
        assert self._copier is not None
        return self._copier


def check_header(
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


class SegmentReader:
    """Reads and verifies committed segments of one SSD tier (in worker threads).

    :param directory: the tier's open directory
    :param index: the tier's index (the prefixes reads must match)
    :param workers: the tier's threads
    :param key: the MAC key (authenticated mode), or ``None``
    :param chunk: bytes per read call
    """

    def __init__(
        self,
        directory: TierDirectory,
        index: SegmentIndex,
        workers: Workers,
        key: bytes | None,
        chunk: int,
    ) -> None:
        self._dir = directory
        self._index = index
        self._workers = workers
        self.key = key
        self.chunk = chunk

    @property
    def io_align(self) -> int:
        """The alignment reads of this tier need (:attr:`TierDirectory.io_align`)."""
        return self._dir.io_align

    def read_many(
        self, items: Sequence[tuple[SegmentKey, memoryview]]
    ) -> tuple[int, Failure | None]:
        """Read ``items`` in order; how many were read whole, and the failure that stopped
        the rest."""
        for i, (key, out) in enumerate(items):
            failure = self.read_checked(key, out, segment_file_name(key))
            if failure is not None:
                return i, failure
        return len(items), None

    def read_checked(self, key: SegmentKey, out: memoryview, rel: str) -> Failure | None:
        """Read and verify; ``None``, or (detail, errno or None if corrupt, reason)."""
        bounce: mmap.mmap | None = None
        target = out
        if self._dir.direct and not aligned(out):
            bounce = anonymous(len(out))
            target = memoryview(bounce)
        failure: Failure | None = None
        try:
            fd = self.open_segment(key)
            if isinstance(fd, tuple):
                return fd
            try:
                self._read_verify(fd, key, target, rel)
                if self.key is not None:
                    header, _ = parse_header(target, rel, len(target))
                    check_header_mac(header, self.key, rel)
                    check_body_mac(target, header, self.key, rel)
            except CorruptSegmentError as exc:
                failure = (exc.detail, None, "")
            except OSError as exc:
                failure = (f"read segment {key[1]}", exc.errno or 0, exc.strerror or str(exc))
            finally:
                self.close_segment(fd)
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
        if size > self.chunk:
            self._read_verify_pipelined(fd, key, out, rel)
            return
        with out[:] as whole:  # pread_full releases the view it is given
            n = pread_full(fd, whole, 0)
        if n < size:
            raise CorruptSegmentError(rel, f"file ends at {n} of {size} bytes (truncated)")
        expected = check_header(out, key, rel, self._index.tags.get(key))
        if hash_body(out[hashed_from(out) :]) != expected:
            raise CorruptSegmentError(rel, "body checksum mismatch")

    def _read_verify_pipelined(self, fd: int, key: SegmentKey, out: memoryview, rel: str) -> None:
        """Read the file into ``out`` chunk by chunk, hashing it as it arrives.

        Up to :data:`READ_DEPTH` chunk reads are in flight (in the reader threads), so the device
        queue never drains between chunks; each chunk's body bytes are hashed in the hasher
        thread while later chunks are read, so only the last chunk's hash adds to the
        latency. Every read and hash has finished when this returns or raises: ``out`` is
        never touched afterwards, and no view of it outlives the call.
        """
        readers, hasher_pool = self._workers.readers, self._workers.hasher
        size = len(out)
        spans = [(at, min(size, at + self.chunk)) for at in range(0, size, self.chunk)]
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
            reads.append((start, end, readers.submit(pread_full, fd, out[start:end], start)))

        try:
            while issued < min(READ_DEPTH, len(spans)):
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
                    expected = check_header(out[:end], key, rel, self._index.tags.get(key), size)
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

    def open_segment(self, key: SegmentKey) -> int | Failure:
        """Open ``key``'s file for reading; its descriptor, or the failure (as
        :meth:`read_checked` reports one)."""
        xx, name = file_parts(key)
        try:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            sub = self._dir.subdir(xx, create=False)
            return os.open(name, flags | self._dir.file_flags, dir_fd=sub)
        except FileNotFoundError:
            return ("file is missing", None, "")
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                return ("a symbolic link or not a directory on its path", None, "")
            return (f"open segment {key[1]}", exc.errno or 0, exc.strerror or str(exc))

    def close_segment(self, fd: int) -> None:
        if not self._dir.direct:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        with contextlib.suppress(OSError):  # Linux closes the descriptor even then
            os.close(fd)
