"""The Tier protocol: what a storage layer must do for :class:`tieredkv.TieredKVCache`.

A tier stores *segments*: immutable byte strings (see :mod:`tieredkv.payload`) named by a
:data:`SegmentKey` ``(session, seq)``. It knows nothing about policies or other tiers.

Writing is two-phase so that space decisions stay with the cache and a cancelled or failed
write leaks nothing:

1. ``reserve(key, length)`` (synchronous) sets aside room for ``length`` bytes, or returns
   ``False`` if the tier has no room now (the cache then evicts and asks again);
2. ``await write(key, data)`` fills and commits the reservation. On any error (or
   cancellation) the reservation is still held and the caller ``release``-s it.

Addressable tiers (host memory, mmap) also offer ``view(key)``, a writable memoryview of a
reserved or committed slot, and ``commit(key)``: the cache serializes a new segment or reads
a lower tier's bytes straight into the slot, with no intermediate copy.

``read_into`` must deliver exactly the bytes written, or raise
:class:`~tieredkv.errors.CorruptSegmentError` after taking the damaged segment out of
service. Persistent tiers list what survived a restart from :meth:`Tier.open`.

Blocking work (file I/O, large copies) runs in worker threads, never on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import msgspec

from ..payload import SegmentHeader

__all__ = [
    "AddressableTier",
    "BatchReadTier",
    "DefragmentingTier",
    "FilledWriteTier",
    "RangedReadTier",
    "ReadCountingTier",
    "SegmentKey",
    "StreamingReadTier",
    "Tier",
    "TierStats",
]

SegmentKey = tuple[str, int]
"""``(session, seq)``: a session's ``seq``-th segment (one per appended turn)."""


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

    async def read_into(self, key: SegmentKey, out: memoryview) -> None:
        """Copy the committed segment into ``out`` (exactly its length)."""
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
    """A tier whose slots are memory the cache can read and write in place."""

    def view(self, key: SegmentKey) -> memoryview:
        """Writable view of the reserved or committed slot for ``key``."""
        ...

    def commit(self, key: SegmentKey) -> None:
        """Mark a reservation filled through :meth:`view` as committed."""
        ...


# -- optional capabilities ---------------------------------------------------------------
# The cache uses these where a tier declares them (checked with isinstance, once, when the
# cache is built), and falls back to the plain Tier protocol elsewhere.


@runtime_checkable
class BatchReadTier(Tier, Protocol):
    """A tier that reads several segments in one call (one worker-thread hop)."""

    async def read_many_into(self, items: Sequence[tuple[SegmentKey, memoryview]]) -> None:
        """Read each ``(key, out)`` in order; stop at the first failure.

        The segments before a failure are complete; a damaged one is taken out of service
        and raised as :class:`~tieredkv.errors.CorruptSegmentError`.
        """
        ...


@runtime_checkable
class StreamingReadTier(Tier, Protocol):
    """A tier that streams segments to a consumer span by span, as the device delivers them
    (a load then needs no segment-sized buffer, and copies while the device reads)."""

    @property
    def span_bytes(self) -> int:
        """The span size this tier reads best (spans may be larger where one tensor is)."""
        ...

    async def read_spans(
        self,
        items: Sequence[tuple[SegmentKey, Sequence[tuple[int, int]]]],
        consume: Callable[[int, int, memoryview], None],
    ) -> None:
        """Deliver each segment's spans to ``consume(item, span, view)`` in order.

        The spans of a segment cover it from 0 to its length, in order, each starting at a
        multiple of 4 KiB at or before the previous one's end. ``view`` is valid only during
        the call, and its bytes are checked only once the segment's last span has arrived:
        what ``consume`` built is final when this returns. Stops at the first failure (the
        segments before it were delivered and verified); a damaged segment is taken out of
        service and raised as :class:`~tieredkv.errors.CorruptSegmentError`.
        """
        ...


@runtime_checkable
class FilledWriteTier(Tier, Protocol):
    """A tier that writes a new segment while the caller is still serializing it."""

    @property
    def span_bytes(self) -> int:
        """The part size this tier writes best."""
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


@runtime_checkable
class ReadCountingTier(AddressableTier, Protocol):
    """An addressable tier that counts reads done in place through :meth:`view`."""

    def note_read(self, nbytes: int) -> None:
        """Count one read of ``nbytes`` done through a view."""
        ...


@runtime_checkable
class RangedReadTier(Tier, Protocol):
    """A tier that reads segments span by span, saying when each span of all of them is in.

    A streamed (layer-wise) restore reads the bytes of the first layers of every segment of
    a history first, so a model can start on them while later layers are still read
    (:meth:`tieredkv.TieredKVCache.load_layerwise`).
    """

    async def read_spans_into(
        self,
        items: Sequence[tuple[SegmentKey, memoryview]],
        ends: Sequence[Sequence[int]],
        landed: Callable[[int], None],
    ) -> None:
        """Read each ``(key, out)`` in consecutive spans: span ``g`` of segment ``i`` is
        ``[ends[i][g - 1], ends[i][g])`` (span 0 from 0; ``ends[i][-1]`` is the segment's
        length; every segment has the same number of spans).

        Spans are read in order of ``g`` (all segments' span 0, then span 1, ...), several
        reads in flight; ``landed(g)`` is called (from a worker thread) once spans ``0 ..
        g`` of every segment are in ``out``, before the bytes are verified. Every segment is
        verified as a whole (as :meth:`Tier.read_into` does) before this returns; a damaged
        one is taken out of service and raised as
        :class:`~tieredkv.errors.CorruptSegmentError`, after which ``landed`` is not called
        again. Every read has finished when this returns or raises.
        """
        ...
