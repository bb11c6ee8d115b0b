"""The Tier contract, run against every tier: host memory, mmap file, SSD (O_DIRECT and
buffered), and Redis (a real ``redis-server``, see :mod:`tests.redis_server`).

Every test uses real segments (:func:`tieredkv.payload.plan_segment`) and compares bytes
exactly. Tier-specific facts (pinned memory, O_DIRECT) are at the end of the module.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch

from tests import redis_server as redis_testing
from tests.redis_server import redis_server as redis_server  # the fixture
from tests.segments import SegmentFactory, aligned_buffer, store
from tieredkv.backends import AddressableTier, HostMemoryTier, MmapTier, SSDTier, Tier
from tieredkv.backends.redis import RedisTier
from tieredkv.errors import ClosedError
from tieredkv.testing import CHECKS, Check, run_check

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
    """Each tier satisfies the runtime-checkable Tier protocol; only SSD and Redis persist;
    its statistics name its kind."""
    assert isinstance(tier, Tier)
    assert tier.persistent is (kind in PERSISTENT)
    assert tier.capacity == CAPACITY
    assert tier.used == 0
    assert tier.stats().kind == STATS_KIND.get(kind, "ssd")


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
async def test_the_tier_contract(kind: str, tmp_path: Path, check: Check) -> None:
    """Every check of the contract kit (:mod:`tieredkv.testing`, what a third-party tier
    runs in its own tests), on every tier of the library, each on a tier of its own."""
    made = itertools.count()

    def make(capacity: int) -> Tier:
        root = tmp_path / str(next(made))
        root.mkdir()
        return new_tier(kind, root, capacity)

    await run_check(check, make, capacity=CAPACITY)


# -- addressable tiers ------------------------------------------------------------------


@pytest.fixture(params=["host", "mmap"])
async def arena_tier(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Tier]:
    t = new_tier(request.param, tmp_path)
    await t.open()
    yield t
    await t.aclose()


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
