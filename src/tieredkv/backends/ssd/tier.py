"""The SSD tier: the class that composes the directory, the index, recovery, the reader,
the span stream and the writer (see :mod:`tieredkv.backends.ssd` for the design)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn

import anyio

from ..._checks import check_cuts, check_int
from ..._fork import check_process, reset_in_forked_child
from ...errors import (
    ClosedError,
    CorruptSegmentError,
    InvalidArgumentError,
    InvalidTypeError,
    TierIOError,
)
from ...payload import ALIGN, SegmentHeader, derive_key
from .._arguments import check_tier_arguments
from ..base import Consumer, SegmentKey, Spans, Tier, TierStats, check_read
from .dirs import TierDirectory
from .index import SegmentIndex
from .layout import segment_file_name
from .probe import probe_direct_io
from .reader import Failure, SegmentReader, Workers
from .recovery import Recovery
from .stream import SpanStream, check_stream
from .writer import Filled, SegmentWriter

__all__ = ["SSDTier"]


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
        of the directory): see :mod:`tieredkv.backends.ssd` for what that catches and what not
    :param huge_pages: collapse the span buffers the tier keeps into transparent huge pages
        in a background thread, up to what spans read into them and copied out filled
        (``madvise(MADV_COLLAPSE)``, Linux 6.1; nothing elsewhere), so that later such reads
        go to physically contiguous memory; ``False`` keeps 4 KiB pages. Loads that land
        straight in their outputs do not use it (see ``output_huge_pages`` of
        :class:`~tieredkv.TieredKVCache` for theirs)
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
        huge_pages: bool = True,
    ) -> None:
        check_tier_arguments(name, capacity, max_threads)
        if not isinstance(huge_pages, bool):
            raise InvalidTypeError(
                f"tier {name!r}: huge_pages must be a bool, not {type(huge_pages).__name__}"
            )
        key = None if secret is None else derive_key(secret)
        check_int(f"tier {name!r}: chunk_size", chunk_size, minimum=ALIGN)
        if chunk_size % ALIGN:
            raise InvalidArgumentError(f"chunk_size must be a positive multiple of {ALIGN}")
        self.name = name
        self.directory = Path(directory)
        self._capacity = capacity
        self._want_direct = direct_io
        self._max_threads = max_threads
        self._dir = TierDirectory(self.directory, name)
        self._index = SegmentIndex(authenticated=key is not None)
        self._recovery = Recovery(self._dir, self._index, key)
        self._workers = Workers(name, max_threads)
        self._reader = SegmentReader(self._dir, self._index, self._workers, key, chunk_size)
        self._stream = SpanStream(self._reader, self._index, self._workers, huge_pages)
        self._writer = SegmentWriter(self._dir, self._workers, key, fsync=fsync, capacity=capacity)
        self._limiter: anyio.CapacityLimiter | None = None
        self._opened_in: int | None = None
        """The process that opened the tier (a child it forks cannot use it)."""
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
        return self._index.used

    @property
    def persistent(self) -> bool:
        return True

    @property
    def authenticated(self) -> bool:
        """Whether segments are written and checked with a MAC (a secret was given)."""
        return self._reader.key is not None

    @property
    def span_bytes(self) -> int:
        """Bytes per read call (``chunk_size``): the span size :meth:`read` streams best."""
        return self._reader.chunk

    @property
    def direct_io(self) -> bool:
        """Whether files are read and written with O_DIRECT."""
        return self._dir.direct

    def _check_open(self) -> anyio.CapacityLimiter:
        if self._limiter is None:
            raise ClosedError(f"tier {self.name!r}")
        check_process(f"tier {self.name!r}", self._opened_in)
        return self._limiter

    # -- lifecycle -----------------------------------------------------------------------
    async def open(self) -> list[SegmentHeader]:
        check_process(f"tier {self.name!r}", self._opened_in)
        if self._limiter is not None:
            return []
        limiter = anyio.CapacityLimiter(self._max_threads)
        headers = await anyio.to_thread.run_sync(self._open_sync, limiter=limiter)
        self._workers.start()
        self._limiter = limiter
        self._opened_in = os.getpid()
        reset_in_forked_child(self)
        return headers

    def _after_fork(self) -> None:
        """In a child forked while the tier was open: close the child's copies of its
        directory's descriptors, so that a long-lived child does not keep the directory
        locked after the parent closed the tier (the tier is unusable in the child)."""
        if self._limiter is not None and self._opened_in != os.getpid():
            self._dir.forget_in_child()

    def _open_sync(self) -> list[SegmentHeader]:
        self._recovery.forget()
        try:
            self._dir.open()
            try:
                note = probe_direct_io(self._dir, self._want_direct, self._capacity)
                if note is not None:
                    self._notes.append(note)
                self._dir.remove_leftovers()
                return self._recovery.scan()
            except TierIOError:
                raise
            except OSError as exc:
                raise TierIOError(self.name, f"scan {str(self.directory)!r}", exc) from exc
        except BaseException:
            self._dir.close()
            self._index.clear()
            self._recovery.forget()
            raise

    def set_aside(self, session: str) -> tuple[int, ...]:
        """The turns (segment numbers) of ``session`` whose files the last :meth:`open`
        found damaged and moved to ``quarantine/``, in order.

        Matched by file name, so it names them even when a header was unreadable garbage.
        The cache reports a history that came back shorter because of them
        (:meth:`~tieredkv.TieredKVCache.truncated`).
        """
        return self._recovery.set_aside(session)

    async def aclose(self) -> None:
        limiter = self._limiter
        if limiter is None:
            return
        self._limiter = None
        if self._opened_in != os.getpid():  # a forked child's copy: the parent's files
            return
        # a call still in a worker thread (its caller gone, say, or a cache's close out of
        # time) uses the directory's descriptors and the readers: it ends first
        with anyio.CancelScope(shield=True):
            for _ in range(int(limiter.total_tokens)):  # (every thread's token, once free)
                await limiter.acquire_on_behalf_of(object())
        self._workers.stop()
        self._stream.close(self.name)
        if self._writer.doomed:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._writer.remove_doomed)
        self._dir.close()
        self._index.clear()
        self._opened_in = None  # closed: a child forked from now on may open it

    async def __aenter__(self) -> SSDTier:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- space ---------------------------------------------------------------------------
    def reserve(self, key: SegmentKey, length: int) -> bool:
        self._check_open()
        # (a leftover file of a failed write of ``key`` stays doomed: only a write that
        # commits replaces it, see _write; a reservation released unwritten, or whose
        # write fails before its rename, leaves the file to the removal at close)
        return self._index.reserve(key, length, self._capacity, self.name)

    def release(self, key: SegmentKey) -> None:
        self._index.release(key)

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

    async def _write(self, key: SegmentKey, data: memoryview, filled: Filled | None) -> None:
        limiter = self._check_open()
        length = self._index.reserved.get(key)
        if length is None:
            raise ValueError(f"segment {key[1]} has no reservation in tier {self.name!r}")
        if len(data) != length:
            raise ValueError(f"reserved {length} bytes, asked to write {len(data)}")
        incarnation = self._index.begin_incarnation(key[0])
        try:
            tag = await anyio.to_thread.run_sync(
                self._writer.write, key, data, incarnation, filled, limiter=limiter
            )
        except BaseException:
            self._index.end_incarnation(key[0])
            raise
        self._writer.forget_doomed(key)  # the committed file replaced any leftover one
        self._index.commit(key, tag)
        self._counters["writes"] += 1
        self._counters["bytes_written"] += length

    async def read(
        self,
        keys: Sequence[SegmentKey],
        into: Sequence[memoryview] | None = None,
        *,
        spans: Sequence[Spans] | None = None,
        consume: Consumer | None = None,
        order: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Read committed segments, verified (see :meth:`~tieredkv.backends.base.Tier.read`).

        Whole segments into ``into`` (no ``spans``, no ``consume``: a promotion reading a
        history into its new slots) are read in one worker-thread call, in order: a
        segment of at most ``chunk_size`` bytes with one read call, hashed in that thread;
        a larger one in chunks, read ahead by reader threads while the hasher thread hashes
        the chunks already read.

        Otherwise the segments stream span by span (the spans may overlap by less than a
        page; the first must hold the whole header): up to eight reads in flight across
        segment boundaries, in ``order``, each segment's checksum (and MAC) computed in the
        hasher thread as its spans arrive (a segment of one span: read, verified and closed
        by one reader thread, and consumed only once verified), ``consume`` called in a
        third thread while later
        spans are read (or, for a :class:`~tieredkv.backends.base.LandingConsumer` whose
        places suit this tier's reads, each span read straight into them and not
        consumed); without ``into`` the spans are read into a small pool of reused
        buffers, so a history of any size needs a few chunks of memory, not a
        segment-sized buffer. With O_DIRECT, ``into`` must be 4 KiB-aligned (as tier-0
        slots and staging buffers are) when it is streamed into.
        """
        limiter = self._check_open()
        lengths = []
        for key in keys:
            length = self._index.lengths.get(key)
            if length is None:
                raise KeyError(key)
            lengths.append(length)
        if not lengths:
            check_read(lengths, into, spans, order)
            return
        if spans is None and consume is None and order is None:
            if into is None:
                raise ValueError("read needs buffers (into) or a consumer (consume)")
            check_read(lengths, into, None, None)
            items = list(zip(keys, into, strict=True))
            done, failure = await anyio.to_thread.run_sync(
                self._reader.read_many, items, limiter=limiter
            )
            verified: Sequence[int] = range(done)
            stopped = None if failure is None else (done, failure)
        else:
            jobs = check_read(lengths, into, spans, order)
            whole = [((0, length),) for length in lengths]
            items_spans = list(zip(keys, whole if spans is None else spans, strict=True))
            check_stream(items_spans, self._index, into, self._dir.direct)
            verified, stopped = await anyio.to_thread.run_sync(
                self._stream.read, items_spans, jobs, consume, into, limiter=limiter
            )
        for i in verified:
            self._counters["reads"] += 1
            self._counters["bytes_read"] += lengths[i]
        if stopped is not None:
            i, why = stopped
            await self._raise_read_failure(keys[i], why)

    async def _raise_read_failure(self, key: SegmentKey, failure: Failure) -> NoReturn:
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

    async def delete(self, key: SegmentKey) -> None:
        limiter = self._check_open()
        if key not in self._index:
            return
        try:
            await anyio.to_thread.run_sync(self._dir.unlink_segment, key, limiter=limiter)
        except OSError as exc:
            raise TierIOError(self.name, f"delete segment {key[1]}", exc) from exc
        self._index.forget(key)

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
        if self._index.forget(key) is None:
            return
        self._counters["corrupt"] += corrupt
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._dir.quarantine_key, key, why)

    def contains(self, key: SegmentKey) -> bool:
        return key in self._index

    def length(self, key: SegmentKey) -> int:
        return self._index.lengths[key]

    def keys(self) -> Iterator[SegmentKey]:
        """Committed segment keys."""
        return iter(self._index)

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            kind=self.kind,
            capacity=self._capacity,
            used=self._index.used,
            segments=len(self._index),
            direct_io=self._dir.direct,
            notes=tuple(self._notes),
            bytes_read=self._counters["bytes_read"],
            bytes_written=self._counters["bytes_written"],
            reads=self._counters["reads"],
            writes=self._counters["writes"],
            corrupt=self._counters["corrupt"] + self._recovery.corrupt,
        )
