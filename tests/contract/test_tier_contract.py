"""The Tier contract, run against every tier: host memory, mmap file, SSD (O_DIRECT and
buffered), and Redis (a real ``redis-server``, see :mod:`tests.redis_server`).

Every test uses real segments (:func:`tieredkv.payload.plan_segment`) and compares bytes
exactly. Tier-specific facts (pinned memory, O_DIRECT) are at the end of the module.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch

from tests import redis_server as redis_testing
from tests.redis_server import redis_server as redis_server  # the fixture
from tests.segments import (
    SegmentFactory,
    aligned_buffer,
    read_back,
    store,
)
from tieredkv.backends import AddressableTier, HostMemoryTier, MmapTier, SSDTier, Tier
from tieredkv.backends.redis import RedisTier
from tieredkv.errors import ClosedError
from tieredkv.payload import ALIGN

CAPACITY = 4 << 20
KINDS = ["host", "mmap", "ssd-direct", "ssd-buffered", "redis"]
PERSISTENT = {"ssd-direct", "ssd-buffered", "redis"}
STATS_KIND = {"host": "memory", "mmap": "mmap", "redis": "redis"}


def new_tier(kind: str, root: Path, capacity: int = CAPACITY) -> Tier:
    """A tier of ``kind`` whose files (if any) live under ``root``."""
    if kind == "host":
        return HostMemoryTier(capacity)
    if kind == "mmap":
        return MmapTier(root / "tier.mmap", capacity)
    if kind == "ssd-direct":
        return SSDTier(root / "ssd", capacity, direct_io=True)
    if kind == "ssd-buffered":
        return SSDTier(root / "ssd", capacity, direct_io=False)
    if kind == "redis":  # on the session's server (the kind fixture starts it)
        assert redis_testing.current is not None
        return RedisTier(redis_testing.current.url, capacity, prefix=redis_testing.new_prefix())
    raise AssertionError(kind)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    value: str = request.param
    if value == "redis":
        request.getfixturevalue("redis_server")
    return value


@pytest.fixture
async def tier(kind: str, tmp_path: Path) -> AsyncIterator[Tier]:
    """An open tier of every kind, closed after the test."""
    t = new_tier(kind, tmp_path)
    assert await t.open() == []
    yield t
    await t.aclose()


def test_every_tier_implements_the_protocol(tier: Tier, kind: str) -> None:
    """Each tier satisfies the runtime-checkable Tier protocol; only SSD and Redis persist."""
    assert isinstance(tier, Tier)
    assert tier.persistent is (kind in PERSISTENT)
    assert tier.capacity == CAPACITY
    assert tier.used == 0


@pytest.mark.parametrize("tokens", [1, 8, 1200, 8000], ids=["1tok", "4KiB", "300KiB", "2MiB"])
async def test_write_then_read_into_is_byte_exact(
    tier: Tier, seg: SegmentFactory, tokens: int
) -> None:
    """reserve + write + read returns exactly the segment's bytes (small and large)."""
    s = seg(tokens=tokens, seed=tokens)
    await store(tier, s)
    assert await read_back(tier, s) == s.data
    assert await read_back(tier, s, aligned=False) == s.data


async def test_segments_of_different_sessions_stay_apart(tier: Tier, seg: SegmentFactory) -> None:
    """Several sessions and seqs, written interleaved, each read back as written."""
    segs = [seg(session=f"user-{i % 3}", seq=i // 3, tokens=50 + 97 * i, seed=i) for i in range(9)]
    for s in segs:
        await store(tier, s)
    for s in reversed(segs):
        assert await read_back(tier, s) == s.data


async def test_contains_and_length_follow_commit(tier: Tier, seg: SegmentFactory) -> None:
    """A reservation is not contained; a committed segment is, with its stored length."""
    s = seg(tokens=1200)
    assert not tier.contains(s.key)
    with pytest.raises(KeyError):
        tier.length(s.key)
    assert tier.reserve(s.key, s.length)
    assert not tier.contains(s.key)
    with pytest.raises(KeyError):
        tier.length(s.key)
    await tier.write(s.key, s.view)
    assert tier.contains(s.key)
    assert tier.length(s.key) == s.length
    assert not tier.contains((s.key[0], s.key[1] + 1))
    assert not tier.contains(("other", s.key[1]))


async def test_reserve_beyond_capacity_returns_false(tier: Tier, seg: SegmentFactory) -> None:
    """A reservation that does not fit returns False and changes nothing; used <= capacity."""
    assert not tier.reserve(("big", 0), CAPACITY + 4096)
    assert tier.used == 0
    s = seg(tokens=3000)  # 768 KiB + header
    granted = 0
    for i in range(CAPACITY // s.length + 2):
        ok = tier.reserve(("fill", i), s.length)
        assert tier.used <= tier.capacity
        if not ok:
            break
        granted += 1
    assert granted == CAPACITY // s.length
    assert tier.used == granted * s.length
    assert not tier.reserve(("fill", granted), s.length)
    assert tier.used == granted * s.length


async def test_release_gives_space_back(tier: Tier, seg: SegmentFactory) -> None:
    """release() returns a reservation's bytes; a second release is a no-op; the key is free."""
    s = seg(tokens=1200)
    assert tier.reserve(s.key, s.length)
    assert tier.used == s.length
    tier.release(s.key)
    assert tier.used == 0
    tier.release(s.key)
    tier.release(("never", 0))
    assert tier.used == 0
    await store(tier, s)  # the key can be reserved again
    assert await read_back(tier, s) == s.data


async def test_release_of_committed_segment_keeps_it(tier: Tier, seg: SegmentFactory) -> None:
    """release() after a successful write is a no-op: the segment and its bytes stay."""
    s = seg(tokens=8)
    await store(tier, s)
    tier.release(s.key)
    assert tier.contains(s.key)
    assert tier.used == s.length
    assert await read_back(tier, s) == s.data


async def test_delete_frees_space(tier: Tier, seg: SegmentFactory) -> None:
    """delete() removes a committed segment and its bytes; deleting an absent key is a no-op."""
    a, b = seg(seq=0, tokens=1200, seed=1), seg(seq=1, tokens=8, seed=2)
    await store(tier, a)
    await store(tier, b)
    assert tier.used == a.length + b.length
    await tier.delete(a.key)
    assert not tier.contains(a.key)
    assert tier.used == b.length
    with pytest.raises(KeyError):
        await read_back(tier, a)
    await tier.delete(a.key)
    await tier.delete(("never", 3))
    assert tier.used == b.length
    assert await read_back(tier, b) == b.data
    await store(tier, a)  # the key can be written again
    assert await read_back(tier, a) == a.data


async def test_double_reserve_is_an_error(tier: Tier, seg: SegmentFactory) -> None:
    """Reserving a key that is reserved or committed raises ValueError and leaves used alone."""
    s = seg(tokens=8)
    assert tier.reserve(s.key, s.length)
    with pytest.raises(ValueError, match="already"):
        tier.reserve(s.key, s.length)
    assert tier.used == s.length
    await tier.write(s.key, s.view)
    with pytest.raises(ValueError, match="already"):
        tier.reserve(s.key, s.length)
    assert tier.used == s.length


async def test_write_without_reservation_is_an_error(tier: Tier, seg: SegmentFactory) -> None:
    """write() of a key that was never reserved raises ValueError and commits nothing."""
    s = seg(tokens=8)
    with pytest.raises(ValueError, match="reserv"):
        await tier.write(s.key, s.view)
    assert not tier.contains(s.key)
    assert tier.used == 0
    assert tier.stats().writes == 0


async def test_write_of_wrong_length_is_an_error(tier: Tier, seg: SegmentFactory) -> None:
    """write() of data longer than the reservation raises ValueError; the reservation stays."""
    s, big = seg(tokens=8), seg(tokens=100, seq=1)
    assert tier.reserve(s.key, s.length)
    with pytest.raises(ValueError, match="bytes"):
        await tier.write(s.key, big.view)
    assert not tier.contains(s.key)
    assert tier.used == s.length
    tier.release(s.key)
    assert tier.used == 0


async def test_read_into_wrong_size_buffer_is_an_error(tier: Tier, seg: SegmentFactory) -> None:
    """read() with a buffer of another length raises ValueError."""
    s = seg(tokens=8)
    await store(tier, s)
    with aligned_buffer(s.length + 4096) as out, pytest.raises(ValueError, match="bytes"):
        await tier.read([s.key], [out])


async def test_read_of_absent_key_raises_keyerror(tier: Tier, seg: SegmentFactory) -> None:
    """read() of a key never written, or only reserved, raises KeyError."""
    s = seg(tokens=8)
    with aligned_buffer(s.length) as out:
        with pytest.raises(KeyError):
            await tier.read([s.key], [out])
        assert tier.reserve(s.key, s.length)
        with pytest.raises(KeyError):
            await tier.read([s.key], [out])


async def test_stats_counters_are_exact(tier: Tier, seg: SegmentFactory, kind: str) -> None:
    """bytes_read/bytes_written/reads/writes/segments/used count exactly what happened."""
    a, b = seg(seq=0, tokens=1200, seed=3), seg(seq=1, tokens=8000, seed=4)
    st = tier.stats()
    assert (st.bytes_read, st.bytes_written, st.reads, st.writes, st.segments) == (0, 0, 0, 0, 0)
    assert st.name == tier.name
    assert st.capacity == CAPACITY
    await store(tier, a)
    await store(tier, b)
    await read_back(tier, a)
    await read_back(tier, a)
    await read_back(tier, b)
    st = tier.stats()
    assert st.writes == 2
    assert st.bytes_written == a.length + b.length
    assert st.reads == 3
    assert st.bytes_read == 2 * a.length + b.length
    assert st.segments == 2
    assert st.used == a.length + b.length
    assert st.corrupt == 0
    assert st.kind == STATS_KIND.get(kind, "ssd")
    await tier.delete(a.key)
    st = tier.stats()
    assert (st.segments, st.used, st.writes, st.reads) == (1, b.length, 2, 3)


async def test_use_after_aclose_raises_closed_error(tier: Tier, seg: SegmentFactory) -> None:
    """After aclose(), reserve/write/read/delete raise ClosedError (aclose is idempotent)."""
    s, t = seg(seq=0, tokens=8), seg(seq=1, tokens=8)
    await store(tier, s)
    assert tier.reserve(t.key, t.length)
    await tier.aclose()
    await tier.aclose()
    with pytest.raises(ClosedError):
        tier.reserve(("x", 0), 4096)
    with pytest.raises(ClosedError):
        await tier.write(t.key, t.view)
    with aligned_buffer(s.length) as out, pytest.raises(ClosedError):
        await tier.read([s.key], [out])
    with pytest.raises(ClosedError):
        await tier.delete(s.key)


async def test_tier_reopens_after_aclose(kind: str, tmp_path: Path, seg: SegmentFactory) -> None:
    """A closed tier can be opened again; a volatile one comes back empty, the SSD keeps data."""
    s = seg(tokens=1200)
    t = new_tier(kind, tmp_path)
    async with anyio.create_task_group():  # one event loop for both opens
        await t.open()
        await store(t, s)
        await t.aclose()
        recovered = await t.open()
        try:
            if t.persistent:
                assert [(h.session, h.seq) for h in recovered] == [s.key]
                assert await read_back(t, s) == s.data
            else:
                assert recovered == []
                assert not t.contains(s.key)
                assert t.used == 0
        finally:
            await t.aclose()


@pytest.mark.parametrize("delay", [0.0, 0.0005, 0.003, 0.02])
async def test_cancelled_write_is_all_or_nothing(
    tier: Tier, seg: SegmentFactory, delay: float
) -> None:
    """A write cancelled at any point either committed the exact bytes or left nothing.

    Per the protocol, if it did not commit, the reservation is still held and release()
    frees it.
    """
    s = seg(tokens=8000, seed=7)
    assert tier.reserve(s.key, s.length)
    with anyio.move_on_after(delay):
        await tier.write(s.key, s.view)
    if tier.contains(s.key):
        assert tier.used == s.length
        assert await read_back(tier, s) == s.data
    else:
        assert tier.used == s.length
        tier.release(s.key)
        assert tier.used == 0
        await store(tier, s)
        assert await read_back(tier, s) == s.data


# -- the one read: several segments, spans, a consumer, an order ---------------------------


def three_spans(length: int) -> list[tuple[int, int]]:
    """Spans of a segment of ``length`` bytes as the read allows them: the first two pages
    (the whole header), a second span that re-reads the first's last page, then the rest."""
    half = length // 2 // ALIGN * ALIGN
    assert 2 * ALIGN < half < length
    return [(0, 2 * ALIGN), (ALIGN, half), (half, length)]


async def test_one_read_of_several_segments_is_byte_exact(tier: Tier, seg: SegmentFactory) -> None:
    """One read of three segments into three buffers: each buffer holds its segment's exact
    bytes, and each segment counts as one read."""
    segs = [seg(seq=i, tokens=300 + 700 * i, seed=20 + i) for i in range(3)]
    for s in segs:
        await store(tier, s)
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(aligned_buffer(s.length)) for s in segs]
        await tier.read([s.key for s in segs], outs)
        assert [bytes(out) for out in outs] == [s.data for s in segs]
    assert tier.stats().reads == 3
    assert tier.stats().bytes_read == sum(s.length for s in segs)
    await tier.read([], [])  # nothing to read is no error
    assert tier.stats().reads == 3


@pytest.mark.parametrize("into", [False, True], ids=["own-memory", "into"])
@pytest.mark.parametrize("layer_major", [False, True], ids=["segment-order", "layer-order"])
async def test_read_hands_every_span_to_consume_exactly(
    tier: Tier, seg: SegmentFactory, into: bool, layer_major: bool
) -> None:
    """With spans and a consumer, every span of every segment reaches ``consume`` once,
    each segment's in their order, holding exactly the segment's bytes of that range (the
    overlapping page included); with ``into`` the buffers also end up holding the segments.
    In any ``order`` the caller asks (a tier that reads whole segments may deliver each
    segment's spans together)."""
    segs = [seg(seq=i, tokens=3000 + 500 * i, seed=30 + i) for i in range(3)]
    for s in segs:
        await store(tier, s)
    spans = [three_spans(s.length) for s in segs]
    order = [(i, k) for k in range(3) for i in range(3)] if layer_major else None
    got: dict[tuple[int, int], bytes] = {}
    seen: list[tuple[int, int]] = []

    def consume(i: int, k: int, view: memoryview) -> None:
        seen.append((i, k))
        got[i, k] = bytes(view)

    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(aligned_buffer(s.length)) for s in segs] if into else None
        await tier.read([s.key for s in segs], outs, spans=spans, consume=consume, order=order)
        if outs is not None:
            assert [bytes(out) for out in outs] == [s.data for s in segs]
    assert sorted(seen) == [(i, k) for i in range(3) for k in range(3)]
    for i in range(3):
        assert [k for j, k in seen if j == i] == [0, 1, 2]
    for (i, k), data in got.items():
        start, end = spans[i][k]
        assert data == segs[i].data[start:end]
    assert tier.stats().reads == 3


async def test_bad_reads_are_refused_before_any_io(tier: Tier, seg: SegmentFactory) -> None:
    """Spans that are unaligned, leave a gap or stop short, an order that skips or repeats a
    span, and buffers or span lists that do not match the keys: ValueErrors, nothing read;
    an absent key among present ones: KeyError, nothing read."""
    s, t = seg(seq=0, tokens=3000, seed=40), seg(seq=1, tokens=3000, seed=41)
    await store(tier, s)
    await store(tier, t)
    n = s.length
    keys = [s.key, t.key]
    ok = three_spans(n)
    for spans, order, match in [
        ([[(0, 100), (100, n)], ok], None, "aligned"),
        ([[(0, 2 * ALIGN), (3 * ALIGN, n)], ok], None, "continue"),  # a gap
        ([[(0, 2 * ALIGN)], ok], None, "end at"),  # stops short
        ([ok], None, "span lists"),  # one span list for two segments
        ([ok, ok], [(0, 1), (0, 0), (0, 2), (1, 0), (1, 1), (1, 2)], "order"),
        ([ok, ok], [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)], "order"),  # one left out
        ([ok, ok], [(0, 0), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)], "order"),
    ]:
        with pytest.raises(ValueError, match=match):
            await tier.read(keys, spans=spans, consume=lambda *a: None, order=order)
    with aligned_buffer(n) as out, pytest.raises(ValueError, match="buffers"):
        await tier.read(keys, [out])  # one buffer for two segments
    with aligned_buffer(n) as a, aligned_buffer(n) as b, pytest.raises(KeyError):
        await tier.read([s.key, ("absent", 0), t.key], [a, b, b])
    assert tier.stats().reads == 0
    assert await read_back(tier, s) == s.data


async def test_a_failing_consumer_propagates_and_keeps_the_segment(
    tier: Tier, seg: SegmentFactory
) -> None:
    """What ``consume`` raises comes out of the read as it is; the segment stays in service,
    undamaged, and reads back exactly."""
    s = seg(tokens=3000, seed=50)
    await store(tier, s)

    def consume(i: int, k: int, view: memoryview) -> None:
        if k == 1:
            raise RuntimeError("consumer gave up")

    with pytest.raises(RuntimeError, match="consumer gave up"):
        await tier.read([s.key], spans=[three_spans(s.length)], consume=consume)
    assert tier.contains(s.key)
    assert tier.stats().corrupt == 0
    assert await read_back(tier, s) == s.data


@pytest.mark.parametrize("delay", [0.0, 0.0005, 0.003, 0.02])
async def test_a_cancelled_read_writes_nothing_afterwards(
    tier: Tier, seg: SegmentFactory, delay: float
) -> None:
    """A read cancelled at any point leaves its buffers alone once the cancellation is
    through (no thread still writes into them), and the segments read back exactly."""
    segs = [seg(seq=i, tokens=4000, seed=60 + i) for i in range(3)]
    for s in segs:
        await store(tier, s)
    with contextlib.ExitStack() as stack:
        outs = [stack.enter_context(aligned_buffer(s.length)) for s in segs]
        with anyio.move_on_after(delay):
            await tier.read([s.key for s in segs], outs)
        after = [bytes(out) for out in outs]
        await anyio.sleep(0.05)
        assert [bytes(out) for out in outs] == after
    for s in segs:
        assert await read_back(tier, s) == s.data


# -- addressable tiers ------------------------------------------------------------------


@pytest.fixture(params=["host", "mmap"])
async def arena_tier(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Tier]:
    t = new_tier(request.param, tmp_path)
    await t.open()
    yield t
    await t.aclose()


async def test_arena_view_and_commit_round_trip(arena_tier: Tier, seg: SegmentFactory) -> None:
    """Filling view(key) in place and commit() stores the segment; read returns it."""
    assert isinstance(arena_tier, AddressableTier)
    s = seg(tokens=1200, seed=11)
    assert arena_tier.reserve(s.key, s.length)
    slot = arena_tier.view(s.key)
    assert len(slot) == s.length
    assert not slot.readonly
    slot[:] = s.view
    assert not arena_tier.contains(s.key)
    arena_tier.commit(s.key)
    arena_tier.commit(s.key)  # idempotent: counted once
    assert arena_tier.contains(s.key)
    st = arena_tier.stats()
    assert (st.writes, st.bytes_written, st.segments) == (1, s.length, 1)
    assert await read_back(arena_tier, s) == s.data
    assert bytes(arena_tier.view(s.key)) == s.data  # a committed slot is viewable too


async def test_arena_view_of_unreserved_key_is_an_error(
    arena_tier: Tier, seg: SegmentFactory
) -> None:
    """view() and commit() of a key with no reservation raise ValueError."""
    assert isinstance(arena_tier, AddressableTier)
    with pytest.raises(ValueError, match="reserv"):
        arena_tier.view(("s", 0))
    with pytest.raises(ValueError, match="reserv"):
        arena_tier.commit(("s", 0))
    assert arena_tier.stats().writes == 0


async def test_arena_slots_do_not_overlap(arena_tier: Tier, seg: SegmentFactory) -> None:
    """Slots filled through view() do not clobber each other, and freed space is reused."""
    assert isinstance(arena_tier, AddressableTier)
    segs = [seg(seq=i, tokens=300 * (i + 1), seed=i) for i in range(5)]
    for s in segs:
        assert arena_tier.reserve(s.key, s.length)
    for s in segs:
        arena_tier.view(s.key)[:] = s.view
        arena_tier.commit(s.key)
    await arena_tier.delete(segs[1].key)
    again = seg(session="t", seq=0, tokens=300, seed=99)
    await store(arena_tier, again)
    for s in [again, segs[0], *segs[2:]]:
        assert bytes(arena_tier.view(s.key)) == s.data


async def test_arena_views_after_aclose_raise_closed_error(
    arena_tier: Tier, seg: SegmentFactory
) -> None:
    """view()/commit() after aclose() raise ClosedError."""
    assert isinstance(arena_tier, AddressableTier)
    s = seg(tokens=8)
    await store(arena_tier, s)
    await arena_tier.aclose()
    with pytest.raises(ClosedError):
        arena_tier.view(s.key)
    with pytest.raises(ClosedError):
        arena_tier.commit(s.key)


def test_ssd_tier_is_not_addressable(tmp_path: Path) -> None:
    """The SSD tier has no in-place view: the cache must go through write/read."""
    assert not isinstance(SSDTier(tmp_path / "ssd", CAPACITY), AddressableTier)
    assert isinstance(HostMemoryTier(CAPACITY), AddressableTier)
    assert isinstance(MmapTier(tmp_path / "m", CAPACITY), AddressableTier)


# -- tier-specific facts ----------------------------------------------------------------


async def test_host_memory_pinned_only_with_cuda() -> None:
    """By default the host arena is pinned exactly when CUDA is present; stats notes say which."""
    async with HostMemoryTier(CAPACITY) as t:
        st = t.stats()
        assert st.kind == "memory"
        assert st.direct_io is None
        if torch.cuda.is_available():
            assert st.pinned is True
            assert any("pinned" in n for n in st.notes)
        else:
            assert st.pinned is False
            assert any("pageable" in n for n in st.notes)


async def test_host_memory_pin_false_is_pageable() -> None:
    """pin=False never pins, and says so."""
    async with HostMemoryTier(CAPACITY, pin=False) as t:
        assert t.stats().pinned is False
        assert any("pageable" in n for n in t.stats().notes)


def test_host_memory_pin_true_without_cuda_is_refused() -> None:
    """pin=True on a machine without CUDA raises ValueError at construction."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: pin=True is valid here")
    with pytest.raises(ValueError, match="CUDA"):
        HostMemoryTier(CAPACITY, pin=True)


async def test_ssd_uses_o_direct_on_this_filesystem(tmp_path: Path) -> None:
    """The default SSD tier uses O_DIRECT on ext4 (the test disk) and reports it."""
    async with SSDTier(tmp_path / "ssd", CAPACITY) as t:
        st = t.stats()
        assert st.direct_io is True
        assert t.direct_io is True
        assert st.pinned is None
        assert st.notes == ()


async def test_ssd_direct_io_false_is_buffered_with_a_note(tmp_path: Path) -> None:
    """direct_io=False uses buffered I/O and says so in stats().notes."""
    async with SSDTier(tmp_path / "ssd", CAPACITY, direct_io=False) as t:
        st = t.stats()
        assert st.direct_io is False
        assert any("O_DIRECT disabled" in n for n in st.notes)


async def test_mmap_tier_file_exists_only_while_open(tmp_path: Path) -> None:
    """The mmap tier's file has the capacity's size while open and is removed at close."""
    path = tmp_path / "tier.mmap"
    t = MmapTier(path, CAPACITY)
    await t.open()
    try:
        assert await anyio.Path(path).exists()
        assert (await anyio.Path(path).stat()).st_size == CAPACITY
    finally:
        await t.aclose()
    assert not await anyio.Path(path).exists()


async def test_arena_aclose_while_a_view_is_held(arena_tier: Tier, seg: SegmentFactory) -> None:
    """aclose() with a caller still holding view() neither raises nor unmaps that memory.

    (Unmapping it would crash the process on the next access; the mapping must outlive
    the view.)
    """
    assert isinstance(arena_tier, AddressableTier)
    s = seg(tokens=1200, seed=5)
    await store(arena_tier, s)
    held = arena_tier.view(s.key)
    await arena_tier.aclose()
    assert bytes(held) == s.data
    held.release()


async def test_arena_aclose_after_a_failed_read(arena_tier: Tier, seg: SegmentFactory) -> None:
    """A read that raised (its traceback referencing the tier's memory) does not make
    aclose() fail, however long the exception lives."""
    s = seg(tokens=1200)
    await store(arena_tier, s)
    with aligned_buffer(s.length + 4096) as out, pytest.raises(ValueError, match="bytes") as info:
        await arena_tier.read([s.key], [out])
    await arena_tier.aclose()
    assert info.value is not None
