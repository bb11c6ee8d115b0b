"""The Tier protocol: what a storage layer must do for :class:`tieredkv.TieredKVCache`.

A tier stores *segments*: immutable byte strings (see :mod:`tieredkv.payload`) named by a
:data:`SegmentKey` ``(session, seq)``. It knows nothing about policies or other tiers.

Writing is two-phase so that space decisions stay with the cache and a cancelled or failed
write leaks nothing:

1. ``reserve(key, length)`` (synchronous) sets aside room for ``length`` bytes, or returns
   ``False`` if the tier has no room now (the cache then evicts and asks again);
2. ``await write(key, data)`` fills and commits the reservation. On any error (or
   cancellation) the reservation is still held and the caller ``release``-s it.

Every tier reads through one method, :meth:`Tier.read`: a vectored span read of several
segments, into the caller's buffers or handed span by span to a consumer, which must
deliver exactly the bytes written, or raise :class:`~tieredkv.errors.CorruptSegmentError`
after taking the damaged segment out of service. Persistent tiers list what survived a
restart from :meth:`Tier.open`.

Addressable tiers (host memory, mmap) also offer a zero-copy view
(:class:`AddressableTier`): ``view(key)``, a writable memoryview of a reserved or committed
slot, and ``commit(key)``: the cache serializes a new segment or reads a lower tier's bytes
straight into the slot, with no intermediate copy. Two more optional protocols let a tier
go faster (:class:`StreamingTier`, :class:`DefragmentingTier`). The cache resolves what
each tier offers once, when it is built (:mod:`tieredkv._cache.tierio`); a tier that offers
none of them works through :class:`Tier` alone.

Blocking work (file I/O, large copies) runs in worker threads, never on the event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeAlias, runtime_checkable

import msgspec

from ..payload import ALIGN as _ALIGN
from ..payload import SegmentHeader

__all__ = [
    "AddressableTier",
    "Consumer",
    "DefragmentingTier",
    "LandingConsumer",
    "Seal",
    "SegmentKey",
    "Spans",
    "StreamingTier",
    "Tier",
    "TierStats",
    "check_read",
    "deliver",
]

SegmentKey = tuple[str, int]
"""``(session, seq)``: a session's ``seq``-th segment (one per appended turn)."""

Spans: TypeAlias = Sequence[tuple[int, int]]
"""One segment's spans for :meth:`Tier.read`: byte ranges ``(start, end)``."""

Consumer: TypeAlias = Callable[[int, int, memoryview], None]
"""What :meth:`Tier.read` hands each span to: ``consume(item, span, view)``."""

Seal: TypeAlias = Callable[[], Awaitable[None]]
"""What completes a segment's prefix once its body is hashed (the ``seal`` of a tier's
``write_pieces``, for the pieces of ``SegmentPlan.pieces(sealed=False)``)."""


@runtime_checkable
class LandingConsumer(Protocol):
    """A :data:`Consumer` that can also say where a span's bytes go, so that a tier may read
    them straight there instead of handing the span over (the SSD tier does, with
    ``preadv``, where the places meet O_DIRECT's alignment).

    ``landing(i, k)`` is ``None`` (span ``k`` of ``keys[i]`` must be consumed) or its
    moves: ``(address, offset, length)`` triples, ascending and disjoint by offset, each
    putting the ``length`` bytes at ``offset`` from the span's start at ``address`` (memory
    the consumer keeps valid and writable for the whole read; bytes of the span that no
    move covers go nowhere). A span a tier lands is not also consumed; one it does not
    land, it consumes. The same answer for the same ``(i, k)`` every time; called from any
    one thread at a time.
    """

    def __call__(self, item: int, k: int, view: memoryview, /) -> None: ...

    def landing(self, item: int, k: int, /) -> Sequence[tuple[int, int, int]] | None: ...


class TierStats(msgspec.Struct, kw_only=True):
    """Counters and facts about one tier.

    :param name: the tier's name
    :param kind: ``"memory"``, ``"mmap"``, ``"ssd"`` or a third-party kind
    :param capacity: bytes the tier may hold
    :param used: bytes held, reservations included
    :param segments: committed segments
    :param bytes_read: bytes read out of the tier
    :param bytes_written: bytes written into the tier
    :param reads: segment reads
    :param writes: segment writes
    :param pinned: host memory is page-locked for fast device copies (``None``: not memory)
    :param direct_io: files bypass the page cache with O_DIRECT (``None``: no files)
    :param corrupt: segments found damaged and taken out of service
    :param relocations: times free space was defragmented by moving segments aside
    :param relocated_bytes: bytes of segments moved to defragment free space
    :param reachable: whether the tier's last contact with its server succeeded (a shared
        tier's heartbeat); ``None``: the tier has no server
    :param notes: anything a user should know (fallbacks taken, ...)
    """

    name: str
    kind: str
    capacity: int
    used: int
    segments: int
    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    pinned: bool | None = None
    direct_io: bool | None = None
    corrupt: int = 0
    relocations: int = 0
    relocated_bytes: int = 0
    reachable: bool | None = None
    notes: tuple[str, ...] = ()


@runtime_checkable
class Tier(Protocol):
    """A storage layer holding segments. See the module docstring for the write protocol."""

    name: str
    """Unique among the cache's tiers; appears in metadata and events."""

    @property
    def capacity(self) -> int:
        """Bytes the tier may hold."""
        ...

    @property
    def used(self) -> int:
        """Bytes held, reservations included; never above :attr:`capacity`."""
        ...

    @property
    def persistent(self) -> bool:
        """Whether committed segments survive a restart."""
        ...

    async def open(self) -> list[SegmentHeader]:
        """Prepare the tier; return the headers of the segments recovered from a previous run.

        :raises TierIOError: if the tier cannot be used (for example, a directory that cannot
            be written), with a message that says what to fix
        """
        ...

    async def aclose(self) -> None:
        """Release the tier's resources. Committed segments of a persistent tier remain."""
        ...

    def reserve(self, key: SegmentKey, length: int) -> bool:
        """Set aside ``length`` bytes for ``key``; ``False`` if there is no room now."""
        ...

    def release(self, key: SegmentKey) -> None:
        """Give back a reservation that was not committed (no-op if there is none)."""
        ...

    async def write(self, key: SegmentKey, data: memoryview) -> None:
        """Fill the reservation for ``key`` with ``data`` and commit it (atomically)."""
        ...

    async def read(
        self,
        keys: Sequence[SegmentKey],
        into: Sequence[memoryview] | None = None,
        *,
        spans: Sequence[Spans] | None = None,
        consume: Consumer | None = None,
        order: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Read the committed segments ``keys``, in order: the tier's one read.

        :param into: one buffer per key, of exactly the segment's length: its bytes land
            there (at their offsets)
        :param spans: per key, the byte ranges ``consume`` gets: together they cover the
            segment from 0 to its length, in order, each starting at a multiple of 4 KiB at
            or before the previous one's end and ending at a multiple of 4 KiB or at the
            segment's end (default: one span, the whole segment)
        :param consume: called as ``consume(i, k, view)`` once span ``k`` of ``keys[i]`` is
            in, in span order for each segment, by one thread at a time (perhaps a worker
            thread); ``view`` holds the span's bytes: part of ``into[i]`` when given, else
            the tier's own memory, valid only during the call (an :class:`AddressableTier`
            hands views of its slots: valid while the segment is committed)
        :param order: the ``(i, k)`` pairs in the order the caller wants them read and
            delivered, every span once, each segment's in their order (default: every span
            of ``keys[0]``, then of ``keys[1]``, ...); a tier that reads whole segments may
            deliver each segment's spans together, in ``keys`` order

        Each segment is verified as a whole before this returns (``consume`` may see bytes
        before they are checked: what it built is final only once this returns). Stops at
        the first failure, the segments before it delivered and verified: a damaged one is
        taken out of service and raised as :class:`~tieredkv.errors.CorruptSegmentError`,
        an I/O error raised as :class:`~tieredkv.errors.TierIOError`, an exception of
        ``consume`` as it is. No read still writes into ``into`` once this returns or
        raises. :func:`deliver` hands a segment read whole to ``consume``.

        :raises KeyError: if a key is not committed here
        :raises ValueError: if a buffer is not its segment's length, or ``spans`` or
            ``order`` break the rules above (a tier that verifies a header as it arrives,
            as the SSD tier does, also refuses a first span that does not hold the whole
            header)
        """
        ...

    async def delete(self, key: SegmentKey) -> None:
        """Remove a committed segment and free its space (no-op if absent)."""
        ...

    def contains(self, key: SegmentKey) -> bool:
        """Whether ``key`` is committed here."""
        ...

    def length(self, key: SegmentKey) -> int:
        """Stored length of a committed segment.

        :raises KeyError: if absent
        """
        ...

    def stats(self) -> TierStats:
        """Counters and facts, as a Struct."""
        ...


@runtime_checkable
class AddressableTier(Tier, Protocol):
    """A tier whose slots are memory the cache can read and write in place (the zero-copy
    view). Its :meth:`~Tier.read` hands ``consume`` views of the slots themselves."""

    def view(self, key: SegmentKey) -> memoryview:
        """Writable view of the reserved or committed slot for ``key``."""
        ...

    def commit(self, key: SegmentKey) -> None:
        """Mark a reservation filled through :meth:`view` as committed."""
        ...


@runtime_checkable
class StreamingTier(Tier, Protocol):
    """A tier that moves segments best span by span, as its device delivers or takes them.

    The cache then loads a history by handing :meth:`~Tier.read` spans of whole tensors of
    about :attr:`span_bytes` (each copied into the output tensors while later spans are
    read: a load needs a few spans of memory, not a segment-sized buffer) and appends by
    serializing a segment part by part while the tier writes the parts already filled.
    """

    @property
    def span_bytes(self) -> int:
        """The span (and part) size this tier reads and writes best."""
        ...

    async def write_filled(
        self,
        key: SegmentKey,
        data: memoryview,
        cuts: Sequence[int],
        fill: Callable[[int], None],
    ) -> None:
        """Commit the reservation for ``key`` with ``data``, calling ``fill(k)`` for each
        part in order (in a worker thread) to make bytes ``[0, cuts[k + 1])`` final, except
        the first 4 KiB-aligned part's, which the last call makes final. Atomic as
        :meth:`Tier.write`; on any failure the reservation is still held."""
        ...


@runtime_checkable
class DefragmentingTier(Tier, Protocol):
    """A tier whose free space can be compacted so one large reservation fits."""

    def defragment(self, length: int, movable: Callable[[SegmentKey], bool]) -> int | None:
        """Make one free block of ``length`` bytes by moving segments ``movable`` accepts.

        :returns: bytes moved, or ``None`` if no window could be cleared
        """
        ...


def deliver(
    consume: Consumer | None, spans: Sequence[Spans] | None, item: int, segment: memoryview
) -> None:
    """Hand segment ``item`` (``segment``: all its bytes, read and verified) to ``consume``
    span by span, as :meth:`Tier.read` asks: what a tier that reads whole segments does."""
    if consume is None:
        return
    for k, (start, end) in enumerate(spans[item] if spans is not None else ((0, len(segment)),)):
        consume(item, k, segment[start:end])


def check_read(
    lengths: Sequence[int],
    into: Sequence[memoryview] | None,
    spans: Sequence[Spans] | None,
    order: Sequence[tuple[int, int]] | None,
) -> list[tuple[int, int]]:
    """Refuse a :meth:`Tier.read` of segments of ``lengths`` bytes whose buffers, spans or
    order break its rules (``ValueError``, saying which); return the ``(i, k)`` pairs in the
    order to deliver them."""
    if into is not None:
        if len(into) != len(lengths):
            raise ValueError(f"{len(lengths)} segments but {len(into)} buffers")
        for buf, length in zip(into, lengths, strict=True):
            if len(buf) != length:
                raise ValueError(f"segment is {length} bytes, the buffer {len(buf)}")
    if spans is None:
        counts = [1] * len(lengths)
    else:
        if len(spans) != len(lengths):
            raise ValueError(f"{len(lengths)} segments but {len(spans)} span lists")
        for seg_spans, length in zip(spans, lengths, strict=True):
            _check_spans(seg_spans, length)
        counts = [len(seg_spans) for seg_spans in spans]
    if order is None:
        return [(i, k) for i, n in enumerate(counts) for k in range(n)]
    jobs = list(order)
    nxt = [0] * len(counts)
    for i, k in jobs:
        if not 0 <= i < len(counts) or k != nxt[i]:
            raise ValueError(
                f"order must list each segment's spans once, in their order; ({i}, {k}) is "
                f"not the next span of a segment"
            )
        nxt[i] += 1
    if nxt != counts:
        raise ValueError("order leaves out some spans")
    return jobs


def _check_spans(spans: Spans, length: int) -> None:
    """Refuse spans that do not cover a segment of ``length`` bytes as :meth:`Tier.read`
    needs (``ValueError``)."""
    end = 0
    for start, stop in spans:
        if start % _ALIGN or (stop % _ALIGN and stop != length):
            raise ValueError(f"span ({start}, {stop}) is not aligned to {_ALIGN} bytes")
        if not start <= end < stop <= length:
            raise ValueError(
                f"span ({start}, {stop}) does not continue the spans before it (which end at "
                f"{end}) within the segment's {length} bytes"
            )
        end = stop
    if end != length:
        raise ValueError(f"the spans end at {end}, the segment at {length}")
