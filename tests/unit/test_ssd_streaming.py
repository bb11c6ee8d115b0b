"""Streamed reads: ``SSDTier.read`` with spans, and the cache's loads through it.

A load from an SSD tier streams the history span by span (each span holding whole tensors)
into the output tensors, with the checksum computed as the spans arrive. These tests pin
what that must never change: exact bytes for any span size and layout, damage caught (and
quarantined) even though bytes reached the consumer before the check, I/O errors reported
as such, a failing consumer's exception propagated, and a tier that stays usable after
every failure.
"""

from __future__ import annotations

import errno
import itertools
import mmap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cancellation import CANCELS, cancellable
from tests.faults import FaultInjector
from tests.invariants import problems
from tests.segments import SegmentFactory, read_back, store
from tieredkv import SSDTier, TieredKVCache
from tieredkv._cache.gather import fill_cuts, span_plan
from tieredkv.backends.base import Consumer, SegmentKey, Spans, StreamingTier
from tieredkv.backends.ssd import segment_file_name
from tieredkv.errors import CorruptSegmentError, SessionNotFoundError, TierIOError
from tieredkv.payload import ALIGN, PartWriter, align_up, plan_segment

CAPACITY = 256 << 20


def aligned(n: int) -> mmap.mmap:
    """A page-aligned buffer of ``n`` bytes (what the cache's staging buffers are)."""
    return mmap.mmap(-1, n)


async def read_spans(
    tier: SSDTier,
    items: Sequence[tuple[SegmentKey, Spans]],
    consume: Consumer,
    *,
    into: Sequence[memoryview] | None = None,
    order: Sequence[tuple[int, int]] | None = None,
) -> None:
    """``tier.read`` of the segments and spans ``items`` (``(key, spans)`` pairs)."""
    await tier.read(
        [key for key, _ in items],
        into,
        spans=[spans for _, spans in items],
        consume=consume,
        order=order,
    )


def reassemble(length: int, spans: list[tuple[int, int]], got: list[bytes]) -> bytes:
    """One segment's bytes from its spans' deliveries (where consecutive spans share a
    page, both must have delivered the same bytes for it)."""
    whole = bytearray(length)
    end = 0
    for (start, stop), data in zip(spans, got, strict=True):
        assert len(data) == stop - start
        shared = max(0, end - start)
        assert data[:shared] == whole[start : start + shared]
        whole[start:stop] = data
        end = stop
    return bytes(whole)


def history(turns: int, *, big: bool = False) -> list[dict[str, torch.Tensor]]:
    """Turns of mixed tensors joined along dim 1: several dtypes, odd sizes (so tensors
    straddle pages), one tensor larger than a 64 KiB span when ``big``, and an empty one."""
    g = torch.Generator().manual_seed(turns)
    out = []
    for t in range(turns):
        n = 37 + 11 * t
        turn = {
            "a.k": torch.randn(3, n, 40, generator=g).half(),
            "a.v": torch.randn(3, n, 40, generator=g),
            "b.k": torch.randint(-100, 100, (5, n, 7), generator=g, dtype=torch.int8),
            "b.v": torch.randn(1, n, 1000 if big else 9, generator=g).bfloat16(),
            "empty": torch.empty(2, n, 0),
        }
        out.append(turn)
    return out


@pytest.mark.parametrize("span", [ALIGN, 3 * ALIGN, 64 << 10, 8 << 20])
def test_span_plan_covers_the_segment_with_whole_tensors(span: int) -> None:
    """Spans start at page boundaries, continue each other, cover the segment, and each
    tensor lies whole in the one span that lists it; a tensor larger than the span size
    gets one of its own."""
    turn = history(2, big=True)[1]
    plan = plan_segment("s", 1, turn, token_dim=1, answer_tokens=1)
    header = plan.header
    spans, groups = span_plan(header, span)
    assert spans[0][0] == 0
    assert spans[-1][1] == header.length
    end = 0
    for start, stop in spans:
        assert start % ALIGN == 0
        assert start <= end < stop
        end = stop
    listed = [spec.name for group in groups for spec in group]
    assert listed == [spec.name for spec in header.tensors]
    for (start, stop), group in zip(spans, groups, strict=True):
        for spec in group:
            lo = header.body_offset + spec.offset
            assert start <= lo
            assert lo + spec.nbytes <= stop
        if stop - start > span and start > 0:  # only a tensor too large for one span
            first = group[0]  # makes it larger (the rest share its last page)
            assert align_up(header.body_offset + first.offset + first.nbytes) - start > span
            assert all(
                align_up(header.body_offset + spec.offset + spec.nbytes) <= stop
                for spec in group[1:]
            )


@pytest.mark.parametrize("span", [ALIGN, 64 << 10, 1 << 20, 8 << 20])
def test_a_small_last_span_joins_the_one_before(span: int) -> None:
    """A turn of 64 tensors of 128 KiB (8 MiB) and its header is one span at the default
    span size of 8 MiB, not 8 MiB and a lone tensor; at any span size a last span of its
    own holds at least ``span // 8`` bytes the one before does not."""
    turn = {f"t{i}": torch.full((64, 1024), i, dtype=torch.float16) for i in range(64)}
    header = plan_segment("s", 0, turn, token_dim=0, answer_tokens=1).header
    assert header.length > 8 << 20
    spans, groups = span_plan(header, span)
    assert [spec.name for g in groups for spec in g] == list(turn)
    assert spans[-1][1] == header.length
    if span == 8 << 20:
        assert spans == [(0, header.length)]
    else:
        assert len(spans) > 1
        assert header.length - spans[-2][1] >= span // 8


async def test_read_spans_delivers_every_span_in_order(ssd_dir: Path, seg: SegmentFactory) -> None:
    """Several segments streamed in one call: spans arrive in order, and put together they
    are each segment's exact bytes; the read counters count each segment once."""
    segs = [seg(seq=i, tokens=900 + 300 * i, seed=i) for i in range(4)]
    async with SSDTier(ssd_dir, CAPACITY, chunk_size=3 * ALIGN) as tier:
        assert isinstance(tier, StreamingTier)
        for s in segs:
            await store(tier, s)
        plans = [span_plan(s.header, tier.span_bytes)[0] for s in segs]
        got: list[list[bytes]] = [[] for _ in segs]
        order: list[tuple[int, int]] = []

        def consume(item: int, k: int, view: memoryview) -> None:
            order.append((item, k))
            got[item].append(bytes(view))

        await read_spans(tier, [(s.key, p) for s, p in zip(segs, plans, strict=True)], consume)
        assert order == [(i, k) for i, p in enumerate(plans) for k in range(len(p))]
        for s, p, g in zip(segs, plans, got, strict=True):
            assert reassemble(s.length, p, g) == s.data
        assert tier.stats().reads == len(segs)
        assert tier.stats().bytes_read == sum(s.length for s in segs)


async def test_bad_spans_are_refused_before_any_io(ssd_dir: Path, seg: SegmentFactory) -> None:
    """Unaligned starts, gaps, and spans that stop short of (or run past) the segment are
    ValueErrors naming the problem; nothing is read."""
    s = seg(tokens=3000, seed=1)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, s)
        n = s.length
        for spans, match in [
            ([(0, 100), (100, n)], "aligned"),
            ([(0, ALIGN), (2 * ALIGN, n)], "continue"),
            ([(0, ALIGN)], "end at"),
            ([(0, n + ALIGN)], "continue"),
        ]:
            with pytest.raises(ValueError, match=match):
                await read_spans(tier, [(s.key, spans)], lambda *a: None)
        assert tier.stats().reads == 0


async def store_and_damage(tier: SSDTier, ssd_dir: Path, segs: Sequence[Any], victim: int) -> None:
    """Store ``segs``, then flip a bit in the middle of segment ``victim``'s file."""
    for s in segs:
        await store(tier, s)
    path = ssd_dir / "segments" / segment_file_name(segs[victim].key)
    data = bytearray(path.read_bytes())
    data[segs[victim].length // 2] ^= 0x01
    path.write_bytes(bytes(data))


async def test_damage_stops_the_stream_and_is_quarantined(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """A flipped byte in the second of three segments: the first was delivered whole, the
    damage is raised as CorruptSegmentError and the file quarantined although its bytes
    reached the consumer first, and the third stays in service."""
    segs = [seg(seq=i, tokens=2000, seed=10 + i) for i in range(3)]
    async with SSDTier(ssd_dir, CAPACITY, chunk_size=ALIGN) as tier:
        await store_and_damage(tier, ssd_dir, segs, 1)
        plans = [span_plan(s.header, tier.span_bytes)[0] for s in segs]
        got: list[list[bytes]] = [[] for _ in segs]
        with pytest.raises(CorruptSegmentError, match="checksum"):
            await read_spans(
                tier,
                [(s.key, p) for s, p in zip(segs, plans, strict=True)],
                lambda i, k, v: got[i].append(bytes(v)),
            )
        assert reassemble(segs[0].length, plans[0], got[0]) == segs[0].data
        assert not got[2]
        assert not tier.contains(segs[1].key)
        assert tier.stats().corrupt == 1
        assert tier.stats().reads == 1
        assert await read_back(tier, segs[2]) == segs[2].data


async def test_io_error_mid_stream_is_tier_io_error(ssd_dir: Path, seg: SegmentFactory) -> None:
    """An EIO on the third read call is a TierIOError, not damage: every segment stays in
    service and streams back whole once the device recovers."""
    segs = [seg(seq=i, tokens=2000, seed=20 + i) for i in range(2)]
    async with SSDTier(ssd_dir, CAPACITY, chunk_size=ALIGN) as tier:
        for s in segs:
            await store(tier, s)
        items = [(s.key, span_plan(s.header, tier.span_bytes)[0]) for s in segs]
        with FaultInjector() as faults:
            faults.fail_nth("preadv", faults.calls["preadv"] + 3, errno.EIO)
            with pytest.raises(TierIOError) as info:
                await read_spans(tier, items, lambda *a: None)
        assert info.value.errno == errno.EIO
        assert all(tier.contains(s.key) for s in segs)
        got: list[list[bytes]] = [[] for _ in segs]
        await read_spans(tier, items, lambda i, k, v: got[i].append(bytes(v)))
        for s, (_, p), g in zip(segs, items, got, strict=True):
            assert reassemble(s.length, list(p), g) == s.data


@pytest.mark.parametrize("secret", [None, b"0123456789abcdef-streamed"])
async def test_damage_in_a_segment_streamed_whole_never_reaches_the_consumer(
    ssd_dir: Path, seg: SegmentFactory, secret: bytes | None
) -> None:
    """Segments of one span each are read and verified in one reader job before their span
    is consumed: a flipped byte in the second of three is a CorruptSegmentError, the file
    is quarantined, and the consumer got the first segment whole and nothing of the
    others."""
    segs = [seg(seq=i, tokens=2000, seed=40 + i) for i in range(3)]
    async with SSDTier(ssd_dir, CAPACITY, secret=secret) as tier:
        await store_and_damage(tier, ssd_dir, segs, 1)
        got: list[list[bytes]] = [[] for _ in segs]
        with pytest.raises(CorruptSegmentError, match="checksum"):
            await read_spans(
                tier,
                [(s.key, [(0, s.length)]) for s in segs],
                lambda i, k, v: got[i].append(bytes(v)),
            )
        stored = [await read_back(tier, segs[0]), await read_back(tier, segs[2])]
        assert got == [[stored[0]], [], []]
        if secret is None:
            assert stored == [segs[0].data, segs[2].data]
        assert not tier.contains(segs[1].key)
        assert tier.stats().corrupt == 1


async def test_a_truncated_segment_streamed_whole_is_damage(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """A segment of one span whose file lost its last page: its one read comes back short,
    which is damage (CorruptSegmentError naming the truncation, quarantined), and nothing
    of it is consumed."""
    s = seg(tokens=2000, seed=5)
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        await store(tier, s)
        path = ssd_dir / "segments" / segment_file_name(s.key)
        path.write_bytes(path.read_bytes()[:-ALIGN])
        got: list[bytes] = []
        with pytest.raises(CorruptSegmentError, match="truncated"):
            await read_spans(tier, [(s.key, [(0, s.length)])], lambda i, k, v: got.append(bytes(v)))
        assert got == []
        assert not tier.contains(s.key)
        assert tier.stats().corrupt == 1


async def test_a_failing_consumer_propagates_and_the_tier_stays_usable(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """The consumer's own exception comes out of the read as it is; no segment is taken
    out of service and the next stream works."""
    s = seg(tokens=5000, seed=3)
    async with SSDTier(ssd_dir, CAPACITY, chunk_size=ALIGN) as tier:
        await store(tier, s)
        spans = span_plan(s.header, tier.span_bytes)[0]
        assert len(spans) == 2  # one per tensor

        def consume(item: int, k: int, view: memoryview) -> None:
            if k == 1:
                raise RuntimeError("consumer gave up")

        with pytest.raises(RuntimeError, match="consumer gave up"):
            await read_spans(tier, [(s.key, spans)], consume)
        assert tier.contains(s.key)
        assert tier.stats().corrupt == 0
        got: list[bytes] = []
        await read_spans(tier, [(s.key, spans)], lambda i, k, v: got.append(bytes(v)))
        assert reassemble(s.length, spans, got) == s.data


@pytest.mark.parametrize("chunk", [ALIGN, 64 << 10, 8 << 20])
@pytest.mark.parametrize("secret", [None, b"0123456789abcdef-streamed"])
async def test_cache_loads_stream_byte_exact(
    ssd_dir: Path, chunk: int, secret: bytes | None
) -> None:
    """A cache over one SSD tier (which streams) returns exactly what was appended, through
    load and load_into, for span sizes from a page (tensors straddle spans' shared pages)
    to larger than a whole turn, with and without authentication, across a reopen."""
    turns = history(4, big=True)
    want = {k: torch.cat([t[k] for t in turns], dim=1) for k in turns[0]}
    async with TieredKVCache([SSDTier(ssd_dir, CAPACITY, chunk_size=chunk, secret=secret)]) as c:
        for i, t in enumerate(turns):
            await c.append("user", t, answer_tokens=i, token_dim=1)
    async with TieredKVCache([SSDTier(ssd_dir, CAPACITY, chunk_size=chunk, secret=secret)]) as c:
        got = await c.load("user")
        assert set(got) == set(want)
        for k, v in want.items():
            assert got[k].dtype == v.dtype, k
            assert torch.equal(got[k], v), k
        room = {
            k: torch.full((v.shape[0], v.shape[1] + 5, v.shape[2]), 7, dtype=v.dtype)
            for k, v in want.items()
        }
        assert await c.load_into("user", room) == want["a.k"].shape[1]
        for k, v in want.items():
            assert torch.equal(room[k][:, : v.shape[1]], v), k
            assert bool((room[k][:, v.shape[1] :] == 7).all()), k
        assert problems(c) == []


async def test_cache_load_of_a_damaged_history_is_a_miss(ssd_dir: Path) -> None:
    """Damage found while streaming (the outputs already got some of the bytes) makes the
    load a miss, drops the session everywhere, and leaves the cache consistent."""
    turns = history(3)
    async with TieredKVCache([SSDTier(ssd_dir, CAPACITY, chunk_size=ALIGN)]) as c:
        for i, t in enumerate(turns):
            await c.append("user", t, answer_tokens=i, token_dim=1)
        victim = ssd_dir / "segments" / segment_file_name(("user", 2))
        data = bytearray(victim.read_bytes())
        data[-ALIGN - 1] ^= 0x10
        victim.write_bytes(bytes(data))
        with pytest.raises(SessionNotFoundError):
            await c.load("user")
        assert not c.contains("user")
        assert c.stats().misses == 1
        assert problems(c) == []


# -- writes filled part by part ------------------------------------------------------------


def planned(turns: int = 2, *, big: bool = True) -> Any:
    return plan_segment("w", 0, history(turns, big=big)[-1], token_dim=1, answer_tokens=3)


def cuts_for(plan: Any, span: int) -> list[int]:
    _, groups = span_plan(plan.header, span)
    starts = [plan.header.body_offset + g[0].offset for g in groups if g]
    return sorted({0, *starts, plan.length})


@pytest.mark.parametrize("span", [ALIGN, 64 << 10, 8 << 20])
@pytest.mark.parametrize("secret", [None, b"0123456789abcdef-filled"])
async def test_write_filled_stores_exactly_what_write_into_serializes(
    ssd_dir: Path, span: int, secret: bytes | None
) -> None:
    """A segment written part by part while it is filled is, byte for byte, the segment
    that SegmentPlan.write_into serializes in one go (authenticated tiers fill first and
    then authenticate), and it reads back after a reopen."""
    plan = planned()
    whole = aligned(plan.length)
    plan.write_into(memoryview(whole))
    key = ("w", 0)
    async with SSDTier(ssd_dir, CAPACITY, chunk_size=ALIGN, secret=secret) as tier:
        buf = aligned(plan.length)
        view = memoryview(buf)
        cuts = cuts_for(plan, span)
        assert tier.reserve(key, plan.length)
        await tier.write_filled(key, view, cuts, PartWriter(plan, view, cuts))
        tier.release(key)
        if secret is None:
            assert (ssd_dir / "segments" / segment_file_name(key)).read_bytes() == bytes(whole)
        assert bytes(buf) == bytes(whole)
    async with SSDTier(ssd_dir, CAPACITY, secret=secret) as tier:
        out = aligned(plan.length)
        await tier.read([key], [memoryview(out)])
        if secret is None:
            assert bytes(out) == bytes(whole)
        assert bytes(out)[plan.header.body_offset :] == bytes(whole)[plan.header.body_offset :]


async def test_a_failing_fill_or_write_commits_nothing(ssd_dir: Path) -> None:
    """A fill that raises, and an I/O error on a part's write, each leave no file behind
    and the reservation held (the caller releases it); the same segment is then written
    whole."""
    plan = planned()
    key = ("w", 0)
    buf = aligned(plan.length)
    view = memoryview(buf)
    cuts = cuts_for(plan, ALIGN)
    assert len(cuts) > 4
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        assert tier.reserve(key, plan.length)
        writer = PartWriter(plan, view, cuts)

        def failing(k: int) -> None:
            if k == 3:
                raise RuntimeError("serializer gave up")
            writer(k)

        with pytest.raises(RuntimeError, match="gave up"):
            await tier.write_filled(key, view, cuts, failing)
        with FaultInjector() as faults:
            faults.fail_nth("pwrite", faults.calls["pwrite"] + 2, errno.EIO)
            with pytest.raises(TierIOError):
                await tier.write_filled(key, view, cuts, PartWriter(plan, view, cuts))
        assert not tier.contains(key)
        assert tier.used == plan.length  # still reserved
        assert [p for p in ssd_dir.rglob("*") if p.is_file() and p.name != "LOCK"] == []
        with pytest.raises(ValueError, match="cuts"):
            await tier.write_filled(key, view, [0, 10, 5, plan.length], writer)
        await tier.write_filled(key, view, cuts, PartWriter(plan, view, cuts))
        tier.release(key)
        whole = aligned(plan.length)
        plan.write_into(memoryview(whole))
        assert (ssd_dir / "segments" / segment_file_name(key)).read_bytes() == bytes(whole)


# -- straight into given buffers, in any order --------------------------------------------------


def layer_major(plans: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """Every segment's span 0, then every segment's span 1, ... (a layer-wise restore)."""
    deepest = max(len(p) for p in plans)
    return [(i, k) for k in range(deepest) for i, p in enumerate(plans) if k < len(p)]


async def test_spans_read_straight_into_buffers_in_layer_order(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """With ``into`` and a layer-major ``order``, each span lands at its offset in its
    segment's buffer, consume sees them in exactly that order, and the buffers end up
    holding the segments' exact bytes."""
    segs = [seg(seq=i, tokens=1500 + 200 * i, seed=30 + i) for i in range(3)]
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        for s in segs:
            await store(tier, s)
        # overlapping spans too (the second re-reads the first's last page)
        plans = [
            [(0, 2 * ALIGN), (ALIGN, half), (half, s.length)]
            for s in segs
            for half in [s.length // 2 // ALIGN * ALIGN]
        ]
        bufs = [aligned(s.length) for s in segs]
        order = layer_major(plans)
        seen: list[tuple[int, int]] = []
        await read_spans(
            tier,
            list(zip([s.key for s in segs], plans, strict=True)),
            lambda i, k, v: seen.append((i, k)),
            into=[memoryview(b) for b in bufs],
            order=order,
        )
        assert seen == order
        assert [bytes(b) for b in bufs] == [s.data for s in segs]
        assert tier.stats().reads == 3


async def test_damage_found_in_layer_order_names_the_segment(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """Layer-major, every segment is verified only with its last span: the damaged one is
    quarantined and raised, the one verified before it counts as read, the rest stay."""
    segs = [seg(seq=i, tokens=2048, seed=40 + i) for i in range(3)]
    async with SSDTier(ssd_dir, CAPACITY) as tier:
        for s in segs:
            await store(tier, s)
        path = ssd_dir / "segments" / segment_file_name(segs[1].key)
        data = bytearray(path.read_bytes())
        data[100] ^= 0x08  # in the header: caught at once, in the first span
        path.write_bytes(bytes(data))
        plans = [span_plan(s.header, ALIGN)[0] for s in segs]
        with pytest.raises(CorruptSegmentError):
            await read_spans(
                tier,
                list(zip([s.key for s in segs], plans, strict=True)),
                lambda *a: None,
                into=[memoryview(aligned(s.length)) for s in segs],
                order=layer_major(plans),
            )
        assert not tier.contains(segs[1].key)
        assert tier.contains(segs[0].key)
        assert tier.contains(segs[2].key)
        assert await read_back(tier, segs[2]) == segs[2].data


async def test_bad_order_and_buffers_are_refused(ssd_dir: Path, seg: SegmentFactory) -> None:
    """An order that skips, repeats or reorders an item's spans, and buffers of the wrong
    size or alignment, are ValueErrors before any I/O."""
    s = seg(tokens=3000, seed=50)
    async with SSDTier(ssd_dir, CAPACITY, direct_io=True) as tier:
        await store(tier, s)
        spans = [(0, ALIGN), (ALIGN, s.length)]
        items = [(s.key, spans)]
        for order in ([(0, 1), (0, 0)], [(0, 0)], [(0, 0), (0, 0), (0, 1)], [(1, 0)]):
            with pytest.raises(ValueError, match="order"):
                await read_spans(tier, items, lambda *a: None, order=order)
        with pytest.raises(ValueError, match="bytes"):
            await read_spans(tier, items, lambda *a: None, into=[memoryview(aligned(ALIGN))])
        odd = memoryview(aligned(s.length + 1))[1:]
        with pytest.raises(ValueError, match="aligned"):
            await read_spans(tier, items, lambda *a: None, into=[odd])
        assert tier.stats().reads == 0


async def test_a_first_span_shorter_than_the_header_is_refused(
    ssd_dir: Path, seg: SegmentFactory
) -> None:
    """A 10 kB session key makes a header longer than a page: a first span that cuts it
    is a ValueError before any I/O (it must not make a sound segment look damaged)."""
    s = seg(session="k" * 10_000, tokens=3000, seed=60)
    async with SSDTier(ssd_dir, CAPACITY, secret=b"0123456789abcdef-header") as tier:
        await store(tier, s)
        with pytest.raises(ValueError, match="header"):
            await read_spans(tier, [(s.key, [(0, ALIGN), (ALIGN, s.length)])], lambda *a: None)
        assert tier.contains(s.key)
        got: list[bytes] = []
        spans = span_plan(s.header, ALIGN)[0]
        await read_spans(tier, [(s.key, spans)], lambda i, k, v: got.append(bytes(v)))
        assert tier.stats().corrupt == 0


@pytest.mark.parametrize("how", CANCELS)
async def test_streamed_load_and_filled_append_survive_cancellation(
    ssd_dir: Path, how: str
) -> None:
    """An SSD-only cache's streamed load and part-by-part append, cancelled at several
    points by each kind of cancellation: afterwards the index, tier, channel and files
    agree, and the history loads back exactly what was committed."""
    turns = history(3, big=True)
    async with TieredKVCache([SSDTier(ssd_dir, CAPACITY, chunk_size=ALIGN)]) as cache:
        for i, t in enumerate(turns[:2]):
            await cache.append("user", t, answer_tokens=i, token_dim=1)
        for delay in (0.0, 0.0002, 0.001, 0.005):
            await cancellable(how, delay, lambda: cache.load("user"))
            assert problems(cache) == []
            await cancellable(
                how, delay, lambda: cache.append("user", turns[2], answer_tokens=2, token_dim=1)
            )
            assert problems(cache) == []
            n = cache.channel["user"].turns
            want = {k: torch.cat([t[k] for t in turns[:n]], dim=1) for k in turns[0]}
            got = await cache.load("user")
            assert all(torch.equal(got[k], v) for k, v in want.items())
            if n == 3:
                await cache.drop("user")
                for i, t in enumerate(turns[:2]):
                    await cache.append("user", t, answer_tokens=i, token_dim=1)


async def test_an_io_error_at_each_os_call_of_a_streamed_load_loses_nothing(
    ssd_dir: Path,
) -> None:
    """Fail each os call of a streamed load in turn: the load raises (a miss or an I/O
    error), never returns wrong bytes, the cache stays consistent, and whatever is still
    stored loads back exactly."""
    turns = history(3)
    want = {k: torch.cat([t[k] for t in turns], dim=1) for k in turns[0]}
    async with TieredKVCache([SSDTier(ssd_dir, CAPACITY, chunk_size=ALIGN)]) as cache:
        for i, t in enumerate(turns):
            await cache.append("user", t, answer_tokens=i, token_dim=1)
        with FaultInjector() as faults:
            with faults.paused():
                before = dict(faults.calls)
                await cache.load("user")
            calls = {site: n - before.get(site, 0) for site, n in faults.calls.items()}
        assert calls.get("preadv", 0) >= 3, calls
        for site, count in calls.items():
            for nth in range(1, count + 1):
                if "user" not in cache:  # lost to a damaged read: store it again
                    for i, t in enumerate(turns):
                        await cache.append("user", t, answer_tokens=i, token_dim=1)
                with FaultInjector() as faults:
                    faults.fail_nth(site, faults.calls[site] + nth, errno.EIO)
                    try:
                        got = await cache.load("user")
                    except (TierIOError, SessionNotFoundError):
                        pass
                    else:
                        assert all(torch.equal(got[k], v) for k, v in want.items())
                assert problems(cache) == [], (site, nth)
                if "user" in cache:
                    got = await cache.load("user")
                    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_fill_cuts_ramp_up_from_1_mib_at_tensor_starts() -> None:
    """An append's parts: the header alone, then 1, 2, 4 MiB of whole tensors (the device
    gets its first write early), then spans, covering the segment exactly."""
    tensors = {f"t{i:02}": torch.zeros(256, 1024, dtype=torch.float16) for i in range(40)}
    header = plan_segment("s", 0, tensors, token_dim=0, answer_tokens=1).header
    cuts = fill_cuts(header, 8 << 20)
    starts = {header.body_offset + spec.offset for spec in header.tensors}
    assert cuts[0] == 0
    assert cuts[1] == header.body_offset
    assert cuts[-1] == header.length
    assert set(cuts[1:-1]) <= starts
    sizes = [b - a for a, b in itertools.pairwise(cuts[1:])]
    assert sizes[:4] == [1 << 20, 2 << 20, 4 << 20, 8 << 20]
    assert all(size <= 8 << 20 for size in sizes)


def mib_turns(turns: int) -> list[dict[str, torch.Tensor]]:
    """Turns of eight 1 MiB tensors: appended in ramped parts (1, 2, 4 MiB, ...), loaded
    into outputs the cache reuses once dropped."""
    g = torch.Generator().manual_seed(100 + turns)
    return [
        {f"l{i}": torch.randn(512, 1024, generator=g).half() for i in range(8)}
        for _ in range(turns)
    ]


@pytest.mark.parametrize("how", CANCELS)
async def test_ramped_appends_and_pooled_loads_survive_cancellation(
    ssd_dir: Path, how: str
) -> None:
    """Appends cut into ramped parts and loads into reused output memory, cancelled at
    several points by each kind of cancellation: the cache stays whole, and what was
    committed loads back exactly, in memory earlier loads left behind."""
    turns = mib_turns(3)
    tier = SSDTier(ssd_dir, CAPACITY)
    header = plan_segment("u", 0, turns[0], token_dim=0, answer_tokens=0).header
    assert len(fill_cuts(header, tier.span_bytes)) >= 5  # the header and 4 parts
    async with TieredKVCache([tier]) as cache:
        for i, t in enumerate(turns[:2]):
            await cache.append("user", t, answer_tokens=i)
        for delay in (0.0, 0.001, 0.005, 0.02):
            await cancellable(how, delay, lambda: cache.load("user"))
            assert problems(cache) == []
            await cancellable(how, delay, lambda: cache.append("user", turns[2], answer_tokens=2))
            assert problems(cache) == []
            n = cache.channel["user"].turns
            got = await cache.load("user")
            assert all(torch.equal(got[k], torch.cat([t[k] for t in turns[:n]])) for k in got)
            del got
            if n == 3:
                await cache.drop("user")
                for i, t in enumerate(turns[:2]):
                    await cache.append("user", t, answer_tokens=i)
        assert cache.stats().outputs_reused > 0


async def test_an_io_error_at_each_os_call_of_a_ramped_append_loses_nothing(
    ssd_dir: Path,
) -> None:
    """Fail each os call of an append cut into ramped parts, in turn: the append raises an
    I/O error and leaves no trace, or it committed; the cache stays consistent, and the
    history loads back exactly what was committed."""
    turns = mib_turns(2)
    async with TieredKVCache([SSDTier(ssd_dir, CAPACITY)]) as cache:
        await cache.append("user", turns[0], answer_tokens=0)
        with FaultInjector() as faults:
            with faults.paused():
                before = dict(faults.calls)
                await cache.append("probe", turns[1], answer_tokens=0)
            calls = {site: n - before.get(site, 0) for site, n in faults.calls.items()}
        await cache.drop("probe")
        assert calls.get("pwrite", 0) + calls.get("pwritev", 0) >= 5, calls
        failed = 0
        for site, count in calls.items():
            for nth in range(1, count + 1):
                with FaultInjector() as faults:
                    faults.fail_nth(site, faults.calls[site] + nth, errno.EIO)
                    try:
                        await cache.append("user", turns[1], answer_tokens=1)
                    except TierIOError:
                        failed += 1
                assert problems(cache) == [], (site, nth)
                n = cache.channel["user"].turns
                got = await cache.load("user")
                want = {k: torch.cat([t[k] for t in turns[:n]]) for k in turns[0]}
                assert all(torch.equal(got[k], v) for k, v in want.items()), (site, nth)
                if n == 2:  # committed despite the fault (it struck after the commit point)
                    await cache.drop("user")
                    await cache.append("user", turns[0], answer_tokens=0)
        assert failed >= sum(calls.values()) // 2, (failed, calls)
