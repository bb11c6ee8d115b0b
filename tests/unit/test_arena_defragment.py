"""Defragmenting an arena tier: segments move aside so one gap fits a reservation.

An arena tier places every segment in one contiguous block. Once segments of different
sizes have come and gone, free space is split into gaps, and a reservation can fail with
enough bytes free in all; the cache would then evict sessions only to join gaps.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tieredkv import LRU, HostMemoryTier, MmapTier, TieredKVCache
from tieredkv.backends.arena import ArenaAllocator, ArenaTier
from tieredkv.backends.base import SegmentKey

G = 4096


def test_take_allocates_an_exact_free_range() -> None:
    """``take`` carves the asked range out of its free block (head and tail stay free)."""
    a = ArenaAllocator(8 * G)
    a.take(2 * G, 3 * G)
    assert a.free_blocks() == [(0, 2 * G), (5 * G, 3 * G)]
    assert a.used == 3 * G
    a.take(0, 2 * G)  # a whole block
    assert a.free_blocks() == [(5 * G, 3 * G)]
    a.take(7 * G, 1)  # rounds up, at a block's end
    assert a.free_blocks() == [(5 * G, 2 * G)]
    a.free(2 * G, 3 * G)
    assert a.free_blocks() == [(2 * G, 5 * G)]


def test_take_refuses_a_range_that_is_not_free() -> None:
    """Overlapping an allocated block, or an unaligned offset, raises and changes nothing."""
    a = ArenaAllocator(8 * G)
    assert a.allocate(2 * G) == 0
    for offset, size in ((G, G), (G, 3 * G), (7 * G, 2 * G), (2 * G + 1, G)):
        with pytest.raises(ValueError, match="not free"):
            a.take(offset, size)
    assert a.free_blocks() == [(2 * G, 6 * G)]
    assert a.used == 2 * G


def pattern(i: int, size: int) -> bytes:
    return bytes((i * 37 + j) % 251 for j in range(size))


async def fill(tier: ArenaTier, sizes: list[int]) -> list[SegmentKey]:
    """Store one segment per size, back to back, each with its own byte pattern."""
    keys: list[SegmentKey] = []
    for i, size in enumerate(sizes):
        key = ("s", i)
        assert tier.reserve(key, size)
        await tier.write(key, memoryview(pattern(i, size)))
        keys.append(key)
    return keys


async def assert_intact(tier: ArenaTier, keys: list[SegmentKey], sizes: list[int]) -> None:
    for key in keys:
        out = bytearray(sizes[key[1]])
        await tier.read([key], [memoryview(out)])
        assert bytes(out) == pattern(key[1], sizes[key[1]])


@pytest.mark.parametrize("kind", ["memory", "mmap"])
async def test_defragment_moves_the_cheapest_window(kind: str, tmp_path: object) -> None:
    """Gaps of 1, 2 and 1 pages: the cheapest 4-page window is the last three pages and the
    1-page segment between them, which moves into the first gap; every segment keeps its
    bytes."""
    tier: ArenaTier
    if kind == "memory":
        tier = HostMemoryTier(10 * G, prefault=False)
    else:
        tier = MmapTier(str(tmp_path) + "/arena", 10 * G)
    sizes = [G, G, 3 * G, G, 2 * G, G]  # 9 pages: 0 1 2-4 5 6-7 8, page 9 free
    async with tier:
        keys = await fill(tier, sizes)
        await tier.delete(keys[1])  # gap: page 1
        await tier.delete(keys[4])  # gap: pages 6-7
        live = [k for k in keys if k not in (keys[1], keys[4])]
        assert not tier.reserve(("t", 0), 4 * G)  # 4 pages free, none 4 contiguous
        assert tier.defragment(4 * G, lambda key: True) == G  # segment 5, not 2 (3 pages)
        assert tier.reserve(("t", 0), 4 * G)
        await assert_intact(tier, live, sizes)
        stats = tier.stats()
        assert (stats.relocations, stats.relocated_bytes) == (1, G)


async def test_defragment_leaves_unmovable_segments_and_reservations() -> None:
    """Segments the caller will not let move, and uncommitted reservations, stay put:
    with them in every window the call returns None and nothing changes."""
    sizes = [G, G, G, G, G]
    async with HostMemoryTier(6 * G, prefault=False) as tier:
        keys = await fill(tier, sizes)
        await tier.delete(keys[1])
        await tier.delete(keys[3])  # free: pages 1, 3, 5
        assert tier.defragment(2 * G, lambda key: False) is None
        assert tier.reserve(("r", 0), G)  # an uncommitted reservation takes page 1
        # page 0 cannot join page 3 across it: segment 2 moves to page 5 instead
        assert tier.defragment(2 * G, lambda key: True) == G
        assert tier.reserve(("t", 0), 2 * G)
        await assert_intact(tier, [keys[0], keys[2], keys[4]], sizes)
        assert tier.stats().relocations == 1


async def test_defragment_needs_enough_free_bytes() -> None:
    """Fewer bytes free than asked: None; already one gap large enough: 0 bytes moved."""
    async with HostMemoryTier(4 * G, prefault=False) as tier:
        keys = await fill(tier, [G, G, G])
        assert tier.defragment(2 * G, lambda key: True) is None
        assert tier.defragment(G, lambda key: True) == 0
        await tier.delete(keys[1])
        assert tier.defragment(2 * G, lambda key: True) == G
        assert tier.stats().relocations == 1


def kv(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(tokens, 1024, generator=g),
        "v": torch.randn(tokens, 1024, generator=g),
    }


async def test_cache_defragments_instead_of_evicting() -> None:
    """Five one-turn sessions fill a host tier; two leave, so 2 segments' worth of bytes
    are free in two gaps. A session twice as large is stored by moving one idle session
    aside: nobody is evicted (LRU would have lost the oldest) and every history loads back
    byte for byte."""
    one = 8 * 1024 * 8  # 8 tokens x (k + v) x 1024 floats x 4 bytes
    seg = one + G  # with its header, aligned
    async with TieredKVCache([HostMemoryTier(5 * seg, prefault=False)], eviction=LRU()) as c:
        stored = {}
        for i, name in enumerate("abcde"):
            stored[name] = kv(8, i)
            await c.append(name, stored[name], answer_tokens=1)
        assert c.tiers[0].used == 5 * seg
        await c.drop("b")
        await c.drop("d")
        big = kv(16, 9)
        await c.append("f", big, answer_tokens=1)
        stored["f"] = big
        del stored["b"], stored["d"]
        for name, tensors in stored.items():
            assert c.where(name) == "host"
            got = await c.load(name)
            for key in tensors:
                assert np.array_equal(got[key].numpy(), tensors[key].numpy())
        assert c.stats().tiers[0].relocations == 1


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 2 * G), min_size=1, max_size=12),
    gone=st.sets(st.integers(0, 11)),
    fixed=st.sets(st.integers(0, 11)),
    share=st.floats(0.3, 1.0),
)
def test_defragment_keeps_every_byte(
    sizes: list[int], gone: set[int], fixed: set[int], share: float
) -> None:
    """Whatever the layout and the size asked (up to all free bytes): a cleared window
    leaves one gap of ``need`` bytes and used bytes unchanged; a refusal moves nothing;
    unmovable segments never move; every segment reads back its own bytes."""

    async def run() -> None:
        pages = sum(-(-size // G) for size in sizes) + 1  # one page free at the end
        async with HostMemoryTier(pages * G, prefault=False) as tier:
            keys = await fill(tier, sizes)
            for i in gone & set(range(len(keys))):
                await tier.delete(keys[i])
            live = [k for k in keys if k[1] not in gone]
            where = {k: tier._slots[k].offset for k in live}
            used = tier.used
            need = max(1, int((tier.capacity - used) * share))
            moved = tier.defragment(need, lambda key: key[1] not in fixed)
            after = {k: tier._slots[k].offset for k in live}
            assert tier.used == used
            if moved is None:
                assert after == where
            else:
                assert tier._alloc.largest_free >= need
                shifted = [k for k in live if after[k] != where[k]]
                assert moved == sum(-(-sizes[k[1]] // G) * G for k in shifted)
                assert not any(k[1] in fixed for k in shifted)
            await assert_intact(tier, live, sizes)

    anyio.run(run)
