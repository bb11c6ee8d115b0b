"""ArenaAllocator: first fit, coalescing, fragmentation, and a stateful model check."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from tieredkv.backends.arena import ArenaAllocator

G = 4096


def test_fresh_arena_is_one_free_block() -> None:
    """A new arena has nothing used and its whole capacity as the largest free block."""
    a = ArenaAllocator(16 * G)
    assert a.used == 0
    assert a.largest_free == 16 * G
    assert a.allocate(16 * G) == 0
    assert a.largest_free == 0
    assert a.allocate(1) is None


def test_sizes_round_up_to_granularity() -> None:
    """Sizes (including 0) round up to the granularity, and used counts rounded bytes."""
    a = ArenaAllocator(16 * G)
    assert a.allocate(1) == 0
    assert a.allocate(G + 1) == G
    assert a.allocate(0) == 3 * G
    assert a.used == 4 * G
    a.free(G, G + 1)
    assert a.used == 2 * G
    assert a.allocate(2 * G) == G  # the freed 2-page block is reused whole


def test_invalid_capacity_is_refused() -> None:
    """A capacity that is negative or not a multiple of the granularity raises ValueError."""
    with pytest.raises(ValueError, match="multiple"):
        ArenaAllocator(G + 1)
    with pytest.raises(ValueError, match="non-negative"):
        ArenaAllocator(-G)
    empty = ArenaAllocator(0)
    assert empty.allocate(1) is None
    assert empty.largest_free == 0


def test_first_fit_takes_the_lowest_hole_that_fits() -> None:
    """With holes of 1, 3 and 2 pages (in address order), a 2-page request takes the
    3-page hole (the first that fits), not the exact-size one further up."""
    a = ArenaAllocator(12 * G)
    offs = [a.allocate(G) for _ in range(12)]
    assert offs == [i * G for i in range(12)]
    a.free(1 * G, G)  # hole [1]
    for i in (3, 4, 5):  # hole [3..5]
        a.free(i * G, G)
    for i in (8, 9):  # hole [8..9]
        a.free(i * G, G)
    assert a.allocate(2 * G) == 3 * G
    assert a.allocate(G) == 1 * G
    assert a.allocate(2 * G) == 8 * G
    assert a.allocate(G) == 5 * G
    assert a.allocate(G) is None
    assert a.used == 12 * G


def test_free_coalesces_with_both_neighbours() -> None:
    """Freeing A and C, then B between them, leaves one block spanning all three."""
    a = ArenaAllocator(3 * G)
    x, y, z = a.allocate(G), a.allocate(G), a.allocate(G)
    assert (x, y, z) == (0, G, 2 * G)
    a.free(0, G)
    a.free(2 * G, G)
    assert a.largest_free == G
    assert a.allocate(2 * G) is None  # two separate single pages
    a.free(G, G)
    assert a.largest_free == 3 * G
    assert a.used == 0
    assert a.allocate(3 * G) == 0


def test_free_coalesces_with_following_then_preceding() -> None:
    """Freeing in descending order merges each block with the free block after it."""
    a = ArenaAllocator(4 * G)
    for _ in range(4):
        a.allocate(G)
    for i in (3, 2, 1, 0):
        a.free(i * G, G)
        assert a.largest_free == (4 - i) * G
    assert a.allocate(4 * G) == 0


def test_fragmentation_refuses_a_block_larger_than_any_hole() -> None:
    """Half the arena free in single-page holes cannot serve a 2-page request."""
    a = ArenaAllocator(8 * G)
    for _ in range(8):
        a.allocate(G)
    for i in range(0, 8, 2):
        a.free(i * G, G)
    assert a.capacity - a.used == 4 * G
    assert a.largest_free == G
    assert a.allocate(2 * G) is None
    assert a.used == 4 * G  # a refused request changes nothing


def test_double_free_is_detected() -> None:
    """Freeing a block that is already the start of a free block raises ValueError."""
    a = ArenaAllocator(4 * G)
    a.allocate(G)
    b = a.allocate(G)
    a.allocate(G)
    assert b is not None
    a.free(b, G)
    with pytest.raises(ValueError, match="double free"):
        a.free(b, G)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a model: the set of live blocks.

    The model derives the free holes from the live blocks, so it also checks first fit
    (the new block is at the lowest hole that fits) and full coalescing.
    """

    CAPACITY_PAGES = 64
    blocks = Bundle("blocks")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = ArenaAllocator(self.CAPACITY_PAGES * G)
        self.live: dict[int, int] = {}  # offset -> rounded size
        self.handles: dict[int, tuple[int, int]] = {}  # handle -> (offset, size asked)
        self.next_handle = 0

    def holes(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        cursor = 0
        for off in sorted(self.live):
            if off > cursor:
                out.append((cursor, off - cursor))
            cursor = off + self.live[off]
        if cursor < self.alloc.capacity:
            out.append((cursor, self.alloc.capacity - cursor))
        return out

    @rule(target=blocks, size=st.integers(min_value=0, max_value=20 * G))
    def allocate(self, size: int) -> int:
        rounded = max(1, -(-size // G)) * G
        expected = next((off for off, n in self.holes() if n >= rounded), None)
        got = self.alloc.allocate(size)
        assert got == expected
        self.next_handle += 1
        if got is not None:
            self.live[got] = rounded
            self.handles[self.next_handle] = (got, size)
        return self.next_handle

    @rule(handle=consumes(blocks))
    def free(self, handle: int) -> None:
        block = self.handles.pop(handle, None)
        if block is None:  # the allocation failed, or free_everything freed it
            return
        offset, size = block
        self.alloc.free(offset, size)
        del self.live[offset]

    @precondition(lambda self: bool(self.live))
    @rule()
    def free_everything(self) -> None:
        for offset, size in self.handles.values():
            self.alloc.free(offset, size)
        self.handles.clear()
        self.live.clear()
        assert self.alloc.largest_free == self.alloc.capacity
        assert self.alloc.allocate(self.alloc.capacity) == 0
        self.alloc.free(0, self.alloc.capacity)

    @invariant()
    def used_is_the_sum_of_live_blocks(self) -> None:
        assert self.alloc.used == sum(self.live.values())

    @invariant()
    def blocks_are_aligned_in_bounds_and_disjoint(self) -> None:
        end = 0
        for off in sorted(self.live):
            assert off % G == 0
            assert off >= end
            end = off + self.live[off]
        assert end <= self.alloc.capacity

    @invariant()
    def free_space_is_fully_coalesced(self) -> None:
        holes = self.holes()
        assert self.alloc.largest_free == max((n for _, n in holes), default=0)

    def teardown(self) -> None:
        for offset, size in self.handles.values():
            self.alloc.free(offset, size)
        assert self.alloc.used == 0
        assert self.alloc.largest_free == self.alloc.capacity


AllocatorMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestArenaAllocatorModel = AllocatorMachine.TestCase
