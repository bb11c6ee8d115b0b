"""A byte arena with its own allocator, and the tier built on it.

Host memory and mmap tiers are both one large preallocated buffer carved into 4 KiB-aligned
slots, one per segment. Slots are aligned so that an O_DIRECT read from the SSD tier can
land straight in the arena, and an O_DIRECT write can leave straight from it.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import numpy as np
import torch

from .._fork import check_process
from ..errors import ClosedError
from ..payload import ALIGN, SegmentHeader, align_up
from ._arguments import check_tier_arguments
from .base import AddressableTier, Consumer, SegmentKey, Spans, TierStats, check_read

__all__ = ["INLINE_COPY", "ArenaAllocator", "ArenaTier"]

INLINE_COPY = 256 * 1024
"""Copies up to this many bytes run on the event loop (microseconds); larger ones in a
worker thread."""


class ArenaAllocator:
    """First-fit allocator over ``[0, capacity)`` with coalescing of neighbouring free blocks.

    Offsets and sizes are multiples of ``granularity``. State: free blocks by offset (a
    sorted list plus a dict of sizes). ``allocate`` is O(free blocks), ``free`` is
    O(log free blocks) plus a list insertion.
    """

    __slots__ = ("_free_offsets", "_free_sizes", "_granularity", "_used", "capacity")

    def __init__(self, capacity: int, granularity: int = ALIGN) -> None:
        if capacity < 0 or capacity % granularity:
            raise ValueError(
                f"capacity {capacity} must be a non-negative multiple of {granularity}"
            )
        self.capacity = capacity
        self._granularity = granularity
        self._free_offsets: list[int] = [0] if capacity else []
        self._free_sizes: dict[int, int] = {0: capacity} if capacity else {}
        self._used = 0

    @property
    def used(self) -> int:
        """Bytes allocated."""
        return self._used

    def block_size(self, size: int) -> int:
        """The bytes a request for ``size`` takes: at least one granule, rounded up."""
        return align_up(max(size, 1), self._granularity)

    @property
    def largest_free(self) -> int:
        """Size of the largest free block."""
        return max(self._free_sizes.values(), default=0)

    def allocate(self, size: int) -> int | None:
        """Offset of a new block of ``size`` bytes (rounded up), or ``None`` if none fits."""
        size = self.block_size(size)
        for i, offset in enumerate(self._free_offsets):
            block = self._free_sizes[offset]
            if block >= size:
                del self._free_sizes[offset]
                if block == size:
                    del self._free_offsets[i]
                else:
                    self._free_offsets[i] = offset + size
                    self._free_sizes[offset + size] = block - size
                self._used += size
                return offset
        return None

    def free_blocks(self) -> list[tuple[int, int]]:
        """The free blocks as ``(offset, size)``, by offset."""
        return [(offset, self._free_sizes[offset]) for offset in self._free_offsets]

    def take(self, offset: int, size: int) -> None:
        """Allocate exactly ``[offset, offset + size)`` (rounded up), which must be free."""
        size = self.block_size(size)
        i = bisect.bisect_right(self._free_offsets, offset) - 1
        start = self._free_offsets[i] if i >= 0 else -1
        block = self._free_sizes.get(start, 0)
        if i < 0 or offset % self._granularity or offset + size > start + block:
            raise ValueError(f"arena range [{offset}, {offset + size}) is not free")
        del self._free_offsets[i]
        del self._free_sizes[start]
        tail = start + block - (offset + size)
        if offset > start:
            self._free_offsets.insert(i, start)
            self._free_sizes[start] = offset - start
            i += 1
        if tail:
            self._free_offsets.insert(i, offset + size)
            self._free_sizes[offset + size] = tail
        self._used += size

    def free(self, offset: int, size: int) -> None:
        """Return a block obtained from :meth:`allocate` (same ``size`` as asked)."""
        size = self.block_size(size)
        self._used -= size
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and self._free_offsets[i] == offset:
            raise ValueError(f"double free of arena block at {offset}")
        # merge with the following block
        if i < len(self._free_offsets) and self._free_offsets[i] == offset + size:
            size += self._free_sizes.pop(self._free_offsets[i])
            del self._free_offsets[i]
        # merge with the preceding block
        if i > 0:
            prev = self._free_offsets[i - 1]
            if prev + self._free_sizes[prev] == offset:
                self._free_sizes[prev] += size
                return
        self._free_offsets.insert(i, offset)
        self._free_sizes[offset] = size


class _Slot:
    __slots__ = ("committed", "length", "offset")

    def __init__(self, offset: int, length: int) -> None:
        self.offset = offset
        self.length = length
        self.committed = False


class ArenaTier(AddressableTier):
    """A tier over one contiguous writable buffer; subclasses provide and release the buffer.

    Copies of at most ``inline_copy_limit`` bytes run on the event loop (they take
    microseconds); larger ones run in a worker thread under the tier's capacity limiter.
    """

    kind = "arena"
    inline_copy_limit = INLINE_COPY

    def __init__(self, name: str, capacity: int, *, max_threads: int = 2) -> None:
        check_tier_arguments(name, capacity, max_threads)
        self.name = name
        self._capacity = align_up(capacity)
        self._alloc = ArenaAllocator(self._capacity)
        self._slots: dict[SegmentKey, _Slot] = {}
        self._buf: memoryview | None = None
        self._max_threads = max_threads
        self._limiter: anyio.CapacityLimiter | None = None
        self._opened_in: int | None = None
        """The process that opened the tier (a child it forks cannot use it)."""
        self._committed = 0
        self._counters: dict[str, int] = {
            "bytes_read": 0,
            "bytes_written": 0,
            "reads": 0,
            "writes": 0,
            "relocations": 0,
            "relocated_bytes": 0,
        }

    # -- subclass hooks ------------------------------------------------------------------
    def _acquire_buffer(self) -> memoryview:  # pragma: no cover - abstract
        raise NotImplementedError

    def _release_buffer(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _extra_stats(self) -> dict[str, Any]:
        return {}

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used(self) -> int:
        return self._alloc.used

    @property
    def persistent(self) -> bool:
        return False

    async def open(self) -> list[SegmentHeader]:
        check_process(f"tier {self.name!r}", self._opened_in)
        if self._buf is None:
            self._limiter = anyio.CapacityLimiter(self._max_threads)
            self._buf = await anyio.to_thread.run_sync(self._acquire_buffer, limiter=self._limiter)
            self._opened_in = os.getpid()
        return []

    async def aclose(self) -> None:
        if self._buf is None:
            return
        if self._opened_in != os.getpid():  # a forked child's copy: the parent's memory
            self._buf = None  # (a shared map, and its file, stay the parent's; the copy
            return  # cannot be opened again here, its slots being the parent's)
        self._slots.clear()
        self._alloc = ArenaAllocator(self._capacity)
        self._committed = 0
        buf, self._buf = self._buf, None
        # Release our view now rather than whenever the garbage collector frees its last
        # reference (the worker thread's future that returned it, say): the buffer can only
        # be unmapped once no view of it is left.
        with contextlib.suppress(BufferError):
            buf.release()
        await anyio.to_thread.run_sync(self._release_buffer)
        self._opened_in = None  # closed: a child forked from now on may open it

    async def __aenter__(self) -> ArenaTier:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _arena(self) -> memoryview:
        if self._buf is None:
            raise ClosedError(f"tier {self.name!r}")
        check_process(f"tier {self.name!r}", self._opened_in)
        return self._buf

    # -- space ---------------------------------------------------------------------------
    def reserve(self, key: SegmentKey, length: int) -> bool:
        self._arena()
        if key in self._slots:
            raise ValueError(f"tier {self.name!r} already holds or reserves segment {key[1]}")
        offset = self._alloc.allocate(length)
        if offset is None:
            return False
        self._slots[key] = _Slot(offset, length)
        return True

    def release(self, key: SegmentKey) -> None:
        slot = self._slots.get(key)
        if slot is not None and not slot.committed:
            del self._slots[key]
            self._alloc.free(slot.offset, slot.length)

    def _slot(self, key: SegmentKey) -> _Slot:
        self._arena()
        slot = self._slots.get(key)
        if slot is None:
            raise ValueError(
                f"segment {key[1]} has no reservation in tier {self.name!r}; reserve() it first"
            )
        return slot

    def defragment(self, length: int, movable: Callable[[SegmentKey], bool]) -> int | None:
        """Make one free block of ``length`` bytes by moving committed segments aside.

        Free space splits into gaps as segments come and go; a reservation can then fail
        with enough bytes free in all. This finds the window of the arena that is cheapest
        to clear (fewest bytes of segments to move, none of them unmovable) and moves the
        segments in it into free space elsewhere. Only committed segments whose key
        ``movable`` accepts move: the caller promises that nobody holds a :meth:`view` of
        them (the cache passes the segments of sessions no operation is using). The moves
        are synchronous, so nothing can take a view meanwhile.

        :returns: bytes moved (0 if a large enough block was already free), or ``None``
            if no window can be cleared (too few bytes free, or unmovable segments in the
            way): the caller must free space another way
        """
        buf = self._arena()
        alloc = self._alloc
        need = alloc.block_size(length)
        if need > self._capacity - alloc.used:
            return None
        if alloc.largest_free >= need:
            return 0
        # The arena in address order: free blocks (key None) and slots, each with its
        # allocated size and whether it may move.
        blocks: list[tuple[int, int, SegmentKey | None, bool]] = [
            (offset, size, None, True) for offset, size in alloc.free_blocks()
        ]
        for key, slot in self._slots.items():
            may = slot.committed and movable(key)
            blocks.append((slot.offset, alloc.block_size(slot.length), key, may))
        blocks.sort()
        # Every run of movable blocks spanning ``need`` bytes, with the bytes to move out
        windows: list[tuple[int, int, int]] = []  # (cost, first, last)
        first = span = cost = 0
        for last, (_, size, owner, may) in enumerate(blocks):
            if not may:
                first, span, cost = last + 1, 0, 0
                continue
            span += size
            cost += size if owner is not None else 0
            while span - blocks[first][1] >= need:
                span -= blocks[first][1]
                cost -= blocks[first][1] if blocks[first][2] is not None else 0
                first += 1
            if span >= need:
                windows.append((cost, first, last))
        windows.sort()
        for _, first, last in windows[:8]:
            moved = self._clear(buf, blocks[first : last + 1])
            if moved is not None:
                self._counters["relocations"] += 1
                self._counters["relocated_bytes"] += moved
                return moved
        return None

    def _clear(
        self, buf: memoryview, window: list[tuple[int, int, SegmentKey | None, bool]]
    ) -> int | None:
        """Move the segments in ``window`` (adjacent blocks) out of it, or change nothing."""
        alloc = self._alloc
        held = [(offset, size) for offset, size, key, _ in window if key is None]
        for offset, size in held:  # keep the moves out of the window's own free space
            alloc.take(offset, size)
        moves: list[tuple[SegmentKey, int, int, int]] = []  # key, from, to, size
        try:
            for offset, size, key, _ in sorted(window, key=lambda b: -b[1]):
                if key is None:
                    continue
                to = alloc.allocate(size)
                if to is None:
                    for _, _, placed, n in moves:
                        alloc.free(placed, n)
                    return None
                moves.append((key, offset, to, size))
        finally:
            for offset, size in held:
                alloc.free(offset, size)
        arena = np.frombuffer(buf, dtype=np.uint8)
        for key, src, dst, size in moves:
            np.copyto(arena[dst : dst + size], arena[src : src + size])
            self._slots[key].offset = dst
            alloc.free(src, size)
        return sum(size for *_, size in moves)

    def view(self, key: SegmentKey) -> memoryview:
        slot = self._slot(key)
        return self._arena()[slot.offset : slot.offset + slot.length]

    def commit(self, key: SegmentKey) -> None:
        slot = self._slot(key)
        if not slot.committed:
            slot.committed = True
            self._committed += 1
            self._counters["writes"] += 1
            self._counters["bytes_written"] += slot.length

    # -- data ----------------------------------------------------------------------------
    async def write(self, key: SegmentKey, data: memoryview) -> None:
        slot = self._slot(key)
        if slot.committed:
            raise ValueError(f"segment {key[1]} is already committed in tier {self.name!r}")
        dst = self.view(key)
        if len(dst) != len(data):
            raise ValueError(f"copy of {len(data)} bytes into a buffer of {len(dst)}")
        if len(data) <= self.inline_copy_limit:
            dst[:] = data
        else:
            await anyio.to_thread.run_sync(_copy_bytes, dst, data, limiter=self._limiter)
        self.commit(key)

    async def read(
        self,
        keys: Sequence[SegmentKey],
        into: Sequence[memoryview] | None = None,
        *,
        spans: Sequence[Spans] | None = None,
        consume: Consumer | None = None,
        order: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Copy committed segments into ``into`` and/or hand ``consume`` their spans (see
        :meth:`~tieredkv.backends.base.Tier.read`): without ``into``, ``consume`` gets views
        of the slots themselves (no copy), valid while the segment is committed.

        Everything runs in one worker-thread call when it is larger than
        ``inline_copy_limit`` (on the event loop otherwise), in ``order`` when given.
        """
        arena = self._arena()
        slots = []
        for key in keys:
            slot = self._slots.get(key)
            if slot is None or not slot.committed:
                raise KeyError(key)
            slots.append(slot)
        jobs = check_read([slot.length for slot in slots], into, spans, order)
        sources = [arena[slot.offset : slot.offset + slot.length] for slot in slots]

        def copy() -> None:
            if into is not None:
                for dst, src in zip(into, sources, strict=True):
                    _copy_bytes(dst, src)
            if consume is not None:
                held = into if into is not None else sources
                for i, k in jobs:
                    start, end = spans[i][k] if spans is not None else (0, len(held[i]))
                    consume(i, k, held[i][start:end])

        total = sum(slot.length for slot in slots)
        if total <= self.inline_copy_limit:
            copy()
        else:
            await anyio.to_thread.run_sync(copy, limiter=self._limiter)
        self._counters["reads"] += len(slots)
        self._counters["bytes_read"] += total

    async def delete(self, key: SegmentKey) -> None:
        self._arena()
        self.discard(key)

    def discard(self, key: SegmentKey) -> None:
        """Synchronous :meth:`delete` (freeing arena space needs no I/O)."""
        slot = self._slots.pop(key, None)
        if slot is not None:
            if slot.committed:
                self._committed -= 1
            self._alloc.free(slot.offset, slot.length)

    def contains(self, key: SegmentKey) -> bool:
        slot = self._slots.get(key)
        return slot is not None and slot.committed

    def length(self, key: SegmentKey) -> int:
        slot = self._slots.get(key)
        if slot is None or not slot.committed:
            raise KeyError(key)
        return slot.length

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            kind=self.kind,
            capacity=self._capacity,
            used=self.used,
            segments=self._committed,
            bytes_read=self._counters["bytes_read"],
            bytes_written=self._counters["bytes_written"],
            reads=self._counters["reads"],
            writes=self._counters["writes"],
            relocations=self._counters["relocations"],
            relocated_bytes=self._counters["relocated_bytes"],
            **self._extra_stats(),
        )


def _copy_bytes(dst: memoryview, src: memoryview) -> None:
    if len(src) <= INLINE_COPY:
        dst[:] = src
        return
    # torch and numpy copies release the GIL, unlike memoryview slice assignment; torch also
    # splits a large copy over threads but wants a writable source
    if src.readonly:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
    else:
        torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
