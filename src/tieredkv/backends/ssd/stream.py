"""Streaming segments out of an SSD tier span by span (:meth:`SSDTier.read` with spans).

Whole histories stream to a consumer (in a third thread) span by span as they arrive: up
to eight reads are in flight across segment boundaries, each segment's checksum (and MAC)
is computed in the hasher thread as its spans arrive, or, for a segment streamed in one
span (a turn of up to a span's size), by the reader thread right after its one read, before
the span is consumed; and the spans are read into a small
pool of reused buffers (or straight into the caller's buffers), so a history
of any size needs a few chunks of memory, not a segment-sized buffer. A layer-wise restore
reads every segment's first span, then every segment's second, and so on.

A consumer that says where each span's bytes go (a
:class:`~tieredkv.backends.base.LandingConsumer`, such as a load's
:class:`~tieredkv._cache.gather.Scatter`) gets them there with no copy:
the span is read with one ``preadv`` whose views are its tensors' places in the outputs and,
for the bytes between them (the header, padding), the span's buffer. That needs each
place's address, length and file offset to be multiples of what the tier's reads need
(512 bytes with O_DIRECT on most SSDs, :attr:`TierDirectory.io_align`), which large tensors
meet (:data:`~tieredkv.payload.LAND_ALIGN`); a span that does not is read and consumed.
This removes a load's one copy (see ``docs/explanation/api-performance.md`` for what it
saved).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xxhash

from ..._fork import reset_in_forked_child
from ...errors import CorruptSegmentError
from ...payload import (
    ALIGN,
    PREFIX,
    SegmentHeader,
    body_mac_hasher,
    check_body_mac_digest,
    check_header_mac,
    hashed_from,
    parse_header,
)
from .._buffers import aligned, anonymous, close_mapping
from .._hugepages import Collapser, Idle
from ..base import Consumer, LandingConsumer, SegmentKey, Spans
from .index import SegmentIndex
from .layout import pread_full, preadv_full, segment_file_name
from .reader import READ_DEPTH, VERIFYING, Failure, SegmentReader, Workers, check_header

__all__ = ["SpanStream", "check_stream"]

Items = Sequence[tuple[SegmentKey, Spans]]
"""Segments and their spans."""

_IOV_MAX = 1024
"""The most views one ``preadv`` takes (Linux's ``IOV_MAX``)."""

_SPARE_BUFFERS = 12
"""Span buffers of ``chunk_size`` bytes a tier keeps for later streams (at most 96 MiB at the
default chunk size)."""


def check_stream(
    items: Items,
    index: SegmentIndex,
    into: Sequence[memoryview] | None,
    direct: bool,
) -> None:
    """Refuse a stream that :func:`~tieredkv.backends.base.check_read` lets through but
    this tier cannot read: a first span that splits a segment's header, or (with O_DIRECT)
    buffers that are not 4 KiB-aligned (``ValueError``)."""
    for i, (key, spans) in enumerate(items):
        tag = index.tags.get(key)
        if tag is not None and spans[0][1] < PREFIX.size + PREFIX.unpack_from(tag)[1]:
            raise ValueError(
                f"the first span of segment {key[1]} ends at {spans[0][1]}, inside its "
                f"header ({PREFIX.size + PREFIX.unpack_from(tag)[1]} bytes): it must hold "
                f"the whole header"
            )
        if into is not None and direct and not aligned(into[i]):
            raise ValueError(f"with O_DIRECT the buffers must be {ALIGN}-aligned")


class SpanStream:
    """Streams committed segments of one SSD tier span by span (in worker threads).

    :param reader: opens and closes the tier's segment files
    :param index: the tier's index
    :param workers: the tier's threads
    :param huge_pages: collapse kept span buffers into huge pages (where the kernel can)
    """

    def __init__(
        self,
        reader: SegmentReader,
        index: SegmentIndex,
        workers: Workers,
        huge_pages: bool = True,
    ) -> None:
        self._reader = reader
        self._index = index
        self._workers = workers
        self._spare: list[mmap.mmap] = []
        """``chunk_size`` buffers kept for later streams (faulted in by their first)."""
        self._lock = threading.Lock()
        self._idle: dict[int, Idle] = {}
        """Each kept buffer (by ``id``), as the collapser sees it."""
        self._collapser = Collapser(huge_pages)
        """Collapses kept buffers a copied span filled into huge pages (a span that lands
        leaves its buffer untouched but for a page: collapsing it would only add memory)."""
        reset_in_forked_child(self)

    def _after_fork(self) -> None:
        """In a forked child, a new lock (a parent's stream may have held this one)."""
        self._lock = threading.Lock()

    def close(self, tier: str) -> None:
        """Unmap the buffers kept for later streams (the tier closes)."""
        self._collapser.close()
        with self._collapser.unmapping:
            while self._spare:
                buf = self._spare.pop()
                self._idle.pop(id(buf), None)
                close_mapping(buf, f"tier {tier!r}'s span buffer", collect=True)
        self._collapser.open()  # (a tier may be opened again)

    def _span_buffer(self, size: int, copied: bool) -> mmap.mmap:
        """A buffer of at least ``size`` bytes from the pool (for a span read into it and
        ``copied`` out, or one that lands), or a new one, not prefaulted: its
        pages fault in during its first read, in a reader thread, rather than all of them
        before the stream's first read. A new tier's first stream used to populate six chunks
        up front, 48 MiB at the default chunk size, though a load of 16 spans uses fewer:
        without that, a new cache's first load of 134 MB took 6,000 fewer page faults and
        157-179 ms of CPU instead of 180-188 ms, its wall time unchanged."""
        with self._lock:
            fits = [i for i, buf in enumerate(self._spare) if len(buf) >= size]
            if fits:
                # a copied span takes the buffer most faulted in, a landed one the least
                # (it touches a page of it): each kind of stream keeps its own buffers
                def faulted(i: int) -> int:
                    idle = self._idle.get(id(self._spare[i]))
                    return 0 if idle is None else idle.size

                i = max(fits, key=faulted) if copied else min(fits, key=faulted)
                buf = self._spare.pop(i)
                idle = self._idle.get(id(buf))
                if idle is not None:
                    idle.idle = False
                return buf
        return anonymous(max(size, self._reader.chunk))

    def _give_back(self, buf: mmap.mmap, filled: int) -> None:
        """Keep ``buf`` for a later stream, or unmap it. A kept buffer's first ``filled``
        bytes (what copied spans were read into) are collapsed into huge pages in the
        background, so that later copied spans read into contiguous memory; the rest of it
        is never touched, and not collapsed (that would back it with memory)."""
        with self._lock:
            chunk = self._reader.chunk  # (a load's last span may run up to chunk / 8 over)
            if chunk <= len(buf) <= chunk + chunk // 8 and len(self._spare) < _SPARE_BUFFERS:
                self._spare.append(buf)
                idle = self._idle.get(id(buf))
                if idle is None:
                    idle = self._idle[id(buf)] = Idle(buf, 0, 0)
                if filled > idle.size:  # more of it is faulted in now: collapse that too
                    idle.size, idle.huge, idle.tries = filled, False, 0
                idle.idle = True
                self._collapser.submit(idle)
                return
            self._idle.pop(id(buf), None)
        with contextlib.suppress(BufferError):
            buf.close()

    def read(
        self,
        items: Items,
        jobs: list[tuple[int, int]],
        consume: Consumer | None,
        into: Sequence[memoryview] | None,
    ) -> tuple[list[int], tuple[int, Failure] | None]:
        """The stream itself (see :meth:`SSDTier.read`); returns the items verified, in
        the order they were, and the failure that stopped it (the item, and the failure as
        :meth:`SegmentReader.read_checked` reports one)."""
        w = self._workers
        readers, hasher_pool, copier = w.readers, w.hasher, w.copier
        reader = self._reader
        lands = consume if into is None and isinstance(consume, LandingConsumer) else None
        size = max(items[i][1][k][1] - items[i][1][k][0] for i, k in jobs)
        # a span read into a ring buffer keeps it until consumed: only jobs whose bytes go
        # to the caller's memory may outnumber the reads in flight. Outputs the reads
        # cannot land in (``torch.empty``'s memory starts 64 bytes into a page) make every
        # span a copied one: more jobs than reads would then hold a whole buffer each, more
        # than the tier keeps for the next stream, and every load_into would fault new
        # ones; so the first span that is copied brings the limit down to the reads
        limit = READ_DEPTH if into is None and lands is None else READ_DEPTH + VERIFYING
        # the jobs in flight, one span being hashed and copied out, one spare; taken from
        # the tier's spare buffers (or mapped) as the stream first needs each
        ring_size = 0 if into is not None else limit + 2
        ring: list[mmap.mmap] = []
        free: list[mmap.mmap] = []
        filled: dict[int, int] = {}  # by ``id``: the most of a ring buffer copied spans filled
        # (item, span, buffer or None, the span's pieces, landed, read): the pieces are
        # one view of the span (in ``into`` or a ring buffer) or, for a span read straight
        # into its consumer's memory, the views it lands in and the gaps between them (in
        # the ring buffer); a buffer returns to ``free`` once its span is hashed and
        # consumed (``busy``, oldest first)
        inflight: deque[tuple[int, int, mmap.mmap | None, list[memoryview], bool, Future[int]]] = (
            deque()
        )
        busy: deque[tuple[mmap.mmap | None, list[Future[None]]]] = deque()
        fds: dict[int, int] = {}
        reading: dict[int, _SegmentRead] = {}
        verified: list[int] = []
        issued = 0
        flight = _Flight()
        try:
            while True:
                while issued < len(jobs) and len(inflight) < limit and flight.room():
                    if into is None and not free and len(ring) < ring_size:
                        copied = lands is None or limit == READ_DEPTH
                        ring.append(self._span_buffer(size, copied))
                        free.append(ring[-1])
                    while into is None and not free:  # the oldest span's buffer, once done
                        done_buf, futures = busy.popleft()
                        for f in futures:
                            f.result()  # an exception from consume propagates
                        if done_buf is not None:
                            free.append(done_buf)
                    i, k = jobs[issued]
                    key, spans = items[i]
                    if i not in fds:
                        fd = reader.open_segment(key)
                        if isinstance(fd, tuple):
                            return verified, (i, fd)
                        fds[i] = fd
                    start, end = spans[k]
                    buf: mmap.mmap | None = None
                    pieces = None
                    if into is None:
                        buf = free.pop()
                        moves = None if lands is None else self._places(lands, i, k, start, end)
                        if moves is not None:
                            pieces = self._landing(moves, buf)
                        elif limit > READ_DEPTH:  # a copied span (see ``limit``)
                            limit = READ_DEPTH
                            ring_size = limit + 2
                    landed = pieces is not None
                    if pieces is None:
                        if buf is not None:
                            filled[id(buf)] = max(filled.get(id(buf), 0), end - start)
                            view = memoryview(buf)[: end - start]
                        else:
                            assert into is not None
                            view = into[i][start:end]
                        pieces = [view]
                    flight.begin()
                    try:
                        if len(spans) == 1:  # the whole segment: read and verified in one job
                            rel = segment_file_name(key)
                            length = self._index.lengths[key]
                            read = readers.submit(
                                self._read_whole, fds[i], pieces, key, rel, length, flight.end
                            )
                            fds.pop(i)  # the job closes it
                            read.add_done_callback(flight.job_done)
                        else:
                            if landed:  # straight into the consumer's memory
                                read = readers.submit(preadv_full, fds[i], pieces, start)
                            else:  # pread_full releases the view it is given: its own one
                                read = readers.submit(pread_full, fds[i], pieces[0][:], start)
                            read.add_done_callback(flight.read_done)
                    except BaseException:  # not submitted (the pool is shut down)
                        flight.end()
                        raise
                    inflight.append((i, k, buf, pieces, landed, read))
                    issued += 1
                if not inflight:
                    return verified, None
                # with more to issue, wait for the oldest job or a read slot, whichever first
                more = issued < len(jobs) and len(inflight) < limit
                if more and not flight.wait(inflight[0][-1]):
                    continue
                i, k, buf, pieces, landed, future = inflight.popleft()
                key, spans = items[i]
                start, end = spans[k]
                length = self._index.lengths[key]
                rel = segment_file_name(key)
                try:
                    n = future.result()
                except OSError as exc:
                    why = (f"read segment {key[1]}", exc.errno or 0, exc.strerror or str(exc))
                    return verified, (i, why)
                except CorruptSegmentError as exc:  # (a segment read whole, in one job)
                    if buf is not None:
                        free.append(buf)
                    return verified, (i, (exc.detail, None, ""))
                if len(spans) == 1:  # read and verified already
                    if consume is not None and not landed:
                        copying = copier.submit(consume, i, k, pieces[0])
                        busy.append((buf, [copying]))
                        copying.result()  # an exception from consume propagates
                    else:
                        busy.append((buf, []))
                    verified.append(i)
                    continue
                # ``view`` is not released here: the copier thread may still be using it
                # (its buffer is reused only once it is done, and unmapped at close)
                try:
                    if n < end - start:
                        raise CorruptSegmentError(
                            rel, f"file ends at {start + n} of {length} bytes (truncated)"
                        )
                    if k == 0:  # the header is in the first piece (tensors come after it)
                        reading[i] = self._begin_segment_read(pieces[0], key, rel, length)
                    seg = reading[i]
                    futures = seg.feed(hasher_pool, pieces, start, end)
                except CorruptSegmentError as exc:
                    if buf is not None:
                        free.append(buf)
                    return verified, (i, (exc.detail, None, ""))
                # copied out in the copier thread, so this one reissues reads meanwhile
                if consume is not None and not landed:
                    copying = copier.submit(consume, i, k, pieces[0])
                    futures = [*futures, copying]
                    seg.copies.append(copying)
                busy.append((buf, futures))
                if end == length:
                    try:
                        reading.pop(i).finish()
                    except CorruptSegmentError as exc:
                        return verified, (i, (exc.detail, None, ""))
                    reader.close_segment(fds.pop(i))
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
                reader.close_segment(fd)
            for buf in ring:
                self._give_back(buf, filled.get(id(buf), 0))

    @staticmethod
    def _landing(moves: list[tuple[int, int, int]], buf: mmap.mmap) -> list[memoryview] | None:
        """A span as the pieces one ``preadv`` reads it into, from its moves
        (:meth:`_places`): each tensor straight into its place in the consumer's memory,
        the bytes between them (the header, padding) into ``buf``; ``None`` where the gaps
        do not fit in ``buf``, and the span is read into ``buf`` and consumed instead."""
        scratch = memoryview(buf)
        pieces: list[memoryview] = []
        at = used = 0  # bytes of the span placed; bytes of ``buf`` used for gaps
        for address, offset, length in moves:
            if offset > at:  # a gap: into the buffer
                if used + offset - at > len(buf):
                    return None
                pieces.append(scratch[used : used + offset - at])
                used += offset - at
            if length:
                pieces.append(memoryview((ctypes.c_ubyte * length).from_address(address)))
            at = offset + length
        return pieces

    def _places(
        self, consume: LandingConsumer, i: int, k: int, start: int, end: int
    ) -> list[tuple[int, int, int]] | None:
        """The consumer's moves of span ``k`` of item ``i`` (``[start, end)`` of its file),
        closed by an empty move at the span's end, where one ``preadv`` can land them
        (:meth:`_landing`); ``None`` where the consumer has no place for it or a place is
        not aligned as this tier's reads need (:attr:`TierDirectory.io_align`: with
        O_DIRECT, a multiple of the device's logical block in address, length and file
        offset), and the span is read into a buffer and consumed instead."""
        moves = consume.landing(i, k)
        if not moves or 2 * len(moves) + 1 > _IOV_MAX:
            return None
        align = self._reader.io_align
        closed = [*moves, (0, end - start, 0)]
        at = 0
        for address, offset, length in closed:
            if offset < at or (start + offset) % align or address % align or length % align:
                return None
            at = offset + length
        return closed

    def _read_whole(
        self,
        fd: int,
        pieces: list[memoryview],
        key: SegmentKey,
        rel: str,
        length: int,
        read_done: Callable[[], None],
    ) -> int:
        """Read a segment whole (``pieces``, consecutive, cover it from byte 0) with one
        ``preadv`` and verify it, all in this (reader) thread, right after the read: the
        checksum of a segment streamed in one span costs no hand-off to the hasher thread
        and back. Calls ``read_done`` once the read has returned (or failed), before the
        hash. Closes ``fd``. Raises :class:`CorruptSegmentError` for a short file or a
        wrong header, checksum or MAC; returns the bytes read."""
        try:
            n = preadv_full(fd, pieces, 0)
        finally:
            read_done()
            self._reader.close_segment(fd)
        if n < length:
            raise CorruptSegmentError(rel, f"file ends at {n} of {length} bytes (truncated)")
        seg = self._begin_segment_read(pieces[0], key, rel, length)
        seg.hash_here(pieces, 0, length)
        seg.check()
        return n

    def _begin_segment_read(
        self, first: memoryview, key: SegmentKey, rel: str, length: int
    ) -> _SegmentRead:
        """Check a segment's header in its first span; the state that verifies the rest."""
        expected = check_header(first, key, rel, self._index.tags.get(key), length)
        mac = None
        secret = self._reader.key
        if secret is not None:
            header, _ = parse_header(first, rel, length)
            check_header_mac(header, secret, rel)
            mac = (body_mac_hasher(secret), header)
        return _SegmentRead(rel, hashed_from(first), expected, mac)


class _Flight:
    """The reads one stream has in flight, counted apart from its jobs: a job that reads a
    segment whole frees its read's slot as soon as its read returns, and goes on to verify
    the segment; any other job frees it when it finishes."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._reads = 0

    def room(self) -> bool:
        """Whether another read may be issued."""
        with self._cond:
            return self._reads < READ_DEPTH

    def begin(self) -> None:
        """A read is about to be issued."""
        with self._cond:
            self._reads += 1

    def end(self) -> None:
        """A read returned (or failed, or was never issued): its slot is free."""
        with self._cond:
            self._reads -= 1
            self._cond.notify_all()

    def job_done(self, future: Future[int]) -> None:
        """A job that frees its slot itself (:meth:`end`) finished."""
        with self._cond:
            self._cond.notify_all()

    def read_done(self, future: Future[int]) -> None:
        """A job that is only a read finished."""
        self.end()

    def wait(self, oldest: Future[int]) -> bool:
        """Wait until ``oldest`` is done (``True``) or a read slot is free (``False``)."""
        with self._cond:
            self._cond.wait_for(lambda: oldest.done() or self._reads < READ_DEPTH)
            return oldest.done()


def _update(hasher: Any, parts: list[memoryview]) -> None:
    for part in parts:
        hasher.update(part)


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
        self, pool: ThreadPoolExecutor, pieces: list[memoryview], start: int, end: int
    ) -> list[Future[None]]:
        """Hash the part of span ``[start, end)`` (``pieces``, consecutive) not hashed yet,
        in ``pool``."""
        if end <= self.hashed:
            return []
        parts = self._unhashed(pieces, start, end)
        futures = [pool.submit(_update, self.xxh, parts)]
        if self.mac is not None:
            futures.append(pool.submit(_update, self.mac[0], parts))
        self.futures.extend(futures)
        return futures

    def _unhashed(self, pieces: list[memoryview], start: int, end: int) -> list[memoryview]:
        """The views of ``pieces`` (span ``[start, end)``) past what was hashed so far; from
        now on, hashed up to ``end``."""
        parts: list[memoryview] = []
        at = start
        for piece in pieces:
            lo, hi = max(self.hashed, at), at + len(piece)
            if hi > lo:
                parts.append(piece[lo - at : hi - at])
            at = hi
        self.hashed = max(self.hashed, end)
        return parts

    def hash_here(self, pieces: list[memoryview], start: int, end: int) -> None:
        """Hash the part of span ``[start, end)`` (``pieces``, consecutive) not hashed yet,
        in this thread."""
        parts = self._unhashed(pieces, start, end)
        _update(self.xxh, parts)
        if self.mac is not None:
            _update(self.mac[0], parts)

    def finish(self) -> None:
        """Check the digests once every span was fed (``CorruptSegmentError`` if wrong)."""
        for f in self.futures:
            f.result()
        for f in self.copies:
            f.result()  # an exception from consume propagates
        self.check()

    def check(self) -> None:
        """Check the digests of what was hashed (``CorruptSegmentError`` if wrong)."""
        if self.xxh.intdigest() != self.expected:
            raise CorruptSegmentError(self.rel, "body checksum mismatch")
        if self.mac is not None:
            check_body_mac_digest(self.mac[0].digest(), self.mac[1], self.rel)
