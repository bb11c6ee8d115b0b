"""Each tier's I/O, resolved once when the cache is built.

A tier implements one read (:meth:`~tieredkv.backends.base.Tier.read`, a vectored span
read) and may declare more (:mod:`tieredkv.backends.base`): a zero-copy view of its slots
(:class:`~tieredkv.backends.base.AddressableTier`), span-sized streaming both ways
(:class:`~tieredkv.backends.base.StreamingTier`), defragmentation, sharing across replicas
(:class:`~tieredkv.backends.shared.SharedTier`), naming the segments its open set aside.
:class:`TierIO` looks at what a tier declares once, when the cache is built, and binds
the way each operation is done for it; :func:`copier` does the same for each (source,
destination) pair of tiers, as vLLM's offloading workers pick a transfer handler by source
and destination medium (``vllm/v1/kv_offload``). This is the only module of the cache that
asks what a tier is: everywhere else the cache calls what was bound here.

What each operation does, by what the tier declares:

============  ==========================  ==========================  ======================
operation     addressable (host, mmap)    streaming (SSD)             plain (Redis, yours)
============  ==========================  ==========================  ======================
write a turn  serialized into its slot    written part by part while  serialized into a
                                          the rest is serialized      staging buffer, then
                                                                      written
restore       copied out of the slots     read span by span, each     whole segments into
              (one worker-thread call)    span's tensors copied while staging buffers, two
                                          later spans are read        reads ahead
layer-wise    copied out of the slots,    read span group by group    read whole, then
              group by group              of all segments             copied group by group
============  ==========================  ==========================  ======================

A plain tier that takes a segment as pieces (the Redis tier, on one server and without a
secret) gets its header and views of the tensors' own bytes instead of a staging buffer:
the cache hashes the body over them and copies nothing.

A copy between tiers reads straight into an addressable destination's slots (the whole
history in one read), writes from an addressable source's slots, and otherwise goes
through a scratch buffer, segment by segment.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, runtime_checkable

import anyio
import torch

from ..backends.arena import INLINE_COPY
from ..backends.base import (
    AddressableTier,
    Consumer,
    DefragmentingTier,
    Seal,
    SegmentKey,
    StreamingTier,
    Tier,
)
from ..backends.shared import SharedTier
from ..errors import InvalidArgumentError, InvalidTypeError
from ..payload import ALIGN, PartWriter, SegmentHeader, SegmentPlan
from .gather import Scatter, Staging, fill_cuts, run, scratch

__all__ = ["Copy", "TierIO", "copier", "landing_plan", "resolve"]

Copy = Callable[[list[SegmentKey], list[SegmentKey]], Awaitable[None]]
"""``copy(keys, written)``: copy committed segments ``keys`` of one tier into their
reservations in another, appending each key to ``written`` once it is committed there."""

_WriteFilled = Callable[
    [SegmentKey, memoryview, Sequence[int], Callable[[int], None]], Awaitable[None]
]
"""A streaming tier's ``write_filled``."""

_READS_AHEAD = 2
"""Segment reads in flight while a staged restore scatters the segment before them."""


@runtime_checkable
class _SetsAside(Protocol):
    """A tier that names the segments its open set aside as damaged (the SSD tier)."""

    def set_aside(self, session: str) -> tuple[int, ...]: ...


@runtime_checkable
class _WritesPieces(Protocol):
    """A tier that writes a segment from its pieces (the Redis tier: see
    :meth:`~tieredkv.payload.SegmentPlan.pieces`) without joining them, where
    ``writes_pieces``."""

    @property
    def writes_pieces(self) -> bool: ...

    async def write_pieces(
        self,
        key: SegmentKey,
        pieces: Sequence[memoryview],
        seal: Seal | None = None,
    ) -> None: ...


class TierIO:
    """What the cache does with one tier, bound once from what the tier declares.

    :param tier: the tier
    """

    __slots__ = (
        "_filled",
        "commit",
        "defragment",
        "name",
        "restore",
        "set_aside",
        "shared",
        "span",
        "tier",
        "view",
        "write_new",
    )

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.name = tier.name
        self.view: Callable[[SegmentKey], memoryview] | None = None
        """The zero-copy view of a slot (addressable tiers), else ``None``."""
        self.commit: Callable[[SegmentKey], None] | None = None
        self.span: int | None = None
        """The span size a streaming tier reads and writes best, else ``None``."""
        self._filled: _WriteFilled | None = None
        self.shared = tier if isinstance(tier, SharedTier) else None
        """The tier as a shared tier, else ``None``."""
        self.defragment = tier.defragment if isinstance(tier, DefragmentingTier) else None
        self.set_aside = tier.set_aside if isinstance(tier, _SetsAside) else None
        self.write_new: Callable[[SegmentKey, SegmentPlan, Staging], Awaitable[None]]
        """Serialize a planned new segment into the tier's reservation and commit it."""
        self.restore: Callable[
            [
                list[SegmentKey],
                list[SegmentHeader],
                list[int],
                dict[str, torch.Tensor],
                int,
                Staging,
            ],
            Awaitable[None],
        ]
        """Copy a history (its keys, headers and the tokens of each that belong to it) into
        output tensors along a dimension."""
        if isinstance(tier, AddressableTier):
            self.view, self.commit = tier.view, tier.commit
            self.write_new, self.restore = self._write_in_place, self._restore_in_place
        elif isinstance(tier, StreamingTier):
            self.span, self._filled = tier.span_bytes, tier.write_filled
            self.write_new, self.restore = self._write_filled, self._restore_streamed
        else:
            self.write_new, self.restore = self._write_staged, self._restore_staged
            if isinstance(tier, _WritesPieces) and tier.writes_pieces:
                self.write_new = functools.partial(self._write_pieces, tier.write_pieces)

    # -- writing a new segment ------------------------------------------------------------
    async def _write_in_place(self, key: SegmentKey, plan: SegmentPlan, staging: Staging) -> None:
        assert self.view is not None
        assert self.commit is not None
        await run(plan.write_into, self.view(key), big=plan.length > INLINE_COPY)
        self.commit(key)

    async def _write_filled(self, key: SegmentKey, plan: SegmentPlan, staging: Staging) -> None:
        """Each part of the staging buffer is written while the next part is serialized
        (the copy overlaps the device's write). Each part is hashed right after it is
        copied, in the same thread, while its bytes are still in the CPU's cache: hashing
        in a thread of its own cost more than it saved (16 appends of 8 MiB into an open
        cache, 10 alternating rounds on the shared 2 cores: 320 against 299 ms and 101
        against 88 ms of CPU, medians)."""
        assert self._filled is not None
        assert self.span is not None
        with staging.buffer(plan.length) as view:
            cuts = fill_cuts(plan.header, self.span)
            await self._filled(key, view, cuts, PartWriter(plan, view, cuts))

    async def _write_staged(self, key: SegmentKey, plan: SegmentPlan, staging: Staging) -> None:
        with staging.buffer(plan.length) as view:
            await run(plan.write_into, view, big=plan.length > INLINE_COPY)
            await self.tier.write(key, view)

    async def _write_pieces(
        self,
        write: Callable[
            [SegmentKey, Sequence[memoryview], Seal | None],
            Awaitable[None],
        ],
        key: SegmentKey,
        plan: SegmentPlan,
        staging: Staging,
    ) -> None:
        """The segment's header and the tensors' own bytes handed to the tier as they are:
        no copy into a staging buffer, only the body hash over them. A large segment's
        hash is computed in a worker thread when the tier asks for it (``seal``), so the
        tier sends the body meanwhile. Tensors that are not contiguous on the CPU are
        serialized as for any other tier."""
        big = plan.length > INLINE_COPY
        pieces = plan.pieces(sealed=not big)
        if pieces is None:
            await self._write_staged(key, plan, staging)
            return
        seal = functools.partial(anyio.to_thread.run_sync, plan.seal, pieces) if big else None
        try:
            # (plan holds the tensors the pieces view meanwhile; the tier awaits the seal
            # it started before it returns)
            await write(key, pieces, seal)
        finally:
            for piece in pieces:
                piece.release()

    # -- restoring a history into tensors ----------------------------------------------------
    async def _restore_in_place(
        self,
        keys: list[SegmentKey],
        headers: list[SegmentHeader],
        takes: list[int],
        out: dict[str, torch.Tensor],
        dim: int,
        staging: Staging,
    ) -> None:
        """Scatter every segment from the tier's slots into ``out`` in one read (one
        worker-thread hop: each hop waits for the event loop and the GIL on a busy server).
        Copies into CUDA tensors do not block: the pinned slots stay valid (the caller
        holds the session's lock) until the final synchronize."""
        cuda = any(t.is_cuda for t in out.values())
        await self.tier.read(
            keys, consume=Scatter(headers, out, dim, None, non_blocking=cuda, takes=takes)
        )
        if cuda:
            await anyio.to_thread.run_sync(torch.cuda.synchronize)

    async def _restore_streamed(
        self,
        keys: list[SegmentKey],
        headers: list[SegmentHeader],
        takes: list[int],
        out: dict[str, torch.Tensor],
        dim: int,
        staging: Staging,
    ) -> None:
        """One read for the whole history, span by span: the device's queue stays full
        across segments, and each tensor is copied once, from the span that holds it, while
        later spans are read."""
        consume = Scatter(headers, out, dim, self.span, takes=takes)
        await self.tier.read(keys, spans=consume.spans, consume=consume)

    async def _restore_staged(
        self,
        keys: list[SegmentKey],
        headers: list[SegmentHeader],
        takes: list[int],
        out: dict[str, torch.Tensor],
        dim: int,
        staging: Staging,
    ) -> None:
        """Read the segments into reused staging buffers and scatter each (in a worker
        thread) as it arrives, with up to :data:`_READS_AHEAD` reads in flight meanwhile so
        the tier is not idle while the copy runs. A failed read stops the restore at the
        first segment that failed; reads already in flight finish first (a worker thread is
        never abandoned while it writes into a staging buffer)."""
        consume = Scatter(headers, out, dim, None, takes=takes)
        size = max(h.length for h in headers)
        ahead = min(len(keys), _READS_AHEAD)  # reads in flight before the first scatter
        depth = min(len(keys), ahead + 1)  # buffers: those reads', and the one scattered
        failure: dict[int, BaseException] = {}
        done = [anyio.Event() for _ in keys]
        with contextlib.ExitStack() as stack:
            bufs = [stack.enter_context(staging.buffer(size)) for _ in range(depth)]

            async def read(i: int) -> None:
                try:
                    await self.tier.read([keys[i]], [bufs[i % depth][: headers[i].length]])
                except BaseException as exc:  # re-raised below, outside the task group
                    failure[i] = exc
                finally:
                    done[i].set()

            async with anyio.create_task_group() as tg:
                for i in range(ahead):
                    tg.start_soon(read, i)
                for i, header in enumerate(headers):
                    await done[i].wait()  # (read i was started: i < ahead, or below)
                    if failure:
                        break
                    if i + ahead < len(keys):  # into the buffer segment i - 1 came from
                        tg.start_soon(read, i + ahead)
                    view = bufs[i % depth][: header.length]
                    await anyio.to_thread.run_sync(consume, i, 0, view)
        if failure:
            raise failure[min(failure)]

    # -- layer-wise reads ---------------------------------------------------------------------
    async def read_in_place(
        self, keys: list[SegmentKey], use: Callable[[list[memoryview]], None]
    ) -> None:
        """Call ``use(views)`` once with views of the slots of ``keys`` (an addressable
        tier: through its read, which counts it; in a worker thread when large)."""
        views: list[memoryview] = []

        def take(i: int, k: int, view: memoryview) -> None:
            views.append(view)
            if len(views) == len(keys):
                use(views)

        await self.tier.read(keys, consume=take)

    async def read_landing(
        self,
        keys: list[SegmentKey],
        into: list[memoryview],
        ends: list[list[int]],
        landed: Callable[[int], None],
    ) -> None:
        """Read ``keys`` into ``into``, calling ``landed(g)`` (in a worker thread) once span
        group ``g`` of every segment is in: span ``g`` of segment ``i`` ends at
        ``ends[i][g]`` (see :func:`landing_plan`). A streaming tier reads every segment's
        group 0 first, then every segment's group 1, ...; any other tier reads the whole
        segments, then every group lands. Every segment is verified before this returns."""
        if self.span is None:
            await self.tier.read(keys, into)

            def land_all() -> None:
                for g in range(len(ends[0])):
                    landed(g)

            await anyio.to_thread.run_sync(land_all)
            return
        spans, deliver, order = landing_plan([len(b) for b in into], ends, landed)
        await self.tier.read(keys, into, spans=spans, consume=deliver, order=order)


def landing_plan(
    lengths: Sequence[int], ends: Sequence[Sequence[int]], landed: Callable[[int], None]
) -> tuple[list[list[tuple[int, int]]], Consumer, list[tuple[int, int]]]:
    """The read of a layer-wise restore: each segment's spans (``ends`` are its span ends,
    the same number per segment), the consumer that calls ``landed(g)`` once span group
    ``g`` of every segment has arrived (in group order), and the order that reads every
    segment's group 0, then every segment's group 1, ...

    :raises ValueError: span ends that are not non-decreasing multiples of 4 KiB ending at
        each segment's length, or not the same number for every segment
    """
    groups = len(ends[0]) if ends else 0
    spans: list[list[tuple[int, int]]] = []
    group_of: list[list[int]] = []  # each span's group
    for length, cuts in zip(lengths, ends, strict=True):
        if len(cuts) != groups or not cuts or cuts[-1] != length:
            raise ValueError("every segment needs the same number of spans, ending at its length")
        if any(b < a for a, b in itertools.pairwise([0, *cuts])) or any(c % ALIGN for c in cuts):
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
    return spans, deliver, [(i, k) for _, i, k in order]


# -- copies between tiers -----------------------------------------------------------------------
def copier(src: TierIO, dst: TierIO) -> Copy:
    """How segments are copied from tier ``src`` to tier ``dst`` (chosen once per pair)."""
    if dst.view is not None:
        return functools.partial(_into_slots, src, dst)
    if src.view is not None:
        return functools.partial(_from_slots, src, dst)
    return functools.partial(_through_scratch, src, dst)


async def _into_slots(
    src: TierIO, dst: TierIO, keys: list[SegmentKey], written: list[SegmentKey]
) -> None:
    """Read every segment straight into the destination's slots, in one read."""
    assert dst.view is not None
    assert dst.commit is not None
    await src.tier.read(keys, [dst.view(key) for key in keys])
    for key in keys:
        dst.commit(key)
        written.append(key)


async def _from_slots(
    src: TierIO, dst: TierIO, keys: list[SegmentKey], written: list[SegmentKey]
) -> None:
    """Write each segment from the source's slot."""
    assert src.view is not None
    for key in keys:
        await dst.tier.write(key, src.view(key))
        written.append(key)


async def _through_scratch(
    src: TierIO, dst: TierIO, keys: list[SegmentKey], written: list[SegmentKey]
) -> None:
    """Read each segment into a scratch buffer and write it from there."""
    for key in keys:
        with scratch(src.tier.length(key)) as view:
            await src.tier.read([key], [view])
            await dst.tier.write(key, view)
        written.append(key)


def resolve(tiers: Sequence[Tier]) -> tuple[list[TierIO], list[list[Copy]]]:
    """The tiers' I/O and the copier of every pair (``copies[src][dst]``), refused unless
    each tier implements the :class:`~tieredkv.backends.base.Tier` protocol under a name of
    its own."""
    if not tiers:
        raise InvalidArgumentError("TieredKVCache needs at least one tier")
    for tier in tiers:
        if not isinstance(tier, Tier):
            lacks = [m for m in _TIER_MEMBERS if not hasattr(tier, m)]
            raise InvalidTypeError(
                f"{tier!r} does not implement the Tier protocol (it lacks {', '.join(lacks)}; "
                f"see docs/how-to/write-a-tier.md)"
            )
    names = [tier.name for tier in tiers]
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"tier names must be unique, got {names}")
    io = [TierIO(tier) for tier in tiers]
    return io, [[copier(a, b) for b in io] for a in io]


_TIER_MEMBERS = (
    "name",
    "capacity",
    "used",
    "persistent",
    "open",
    "aclose",
    "reserve",
    "release",
    "write",
    "read",
    "delete",
    "contains",
    "length",
    "stats",
)
