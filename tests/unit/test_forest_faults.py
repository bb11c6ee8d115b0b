"""Forks under I/O errors at every os call of the SSD tier, and under a kill.

A fault anywhere in a fork's first append, or in dropping a parent that forks still need
(its retirement marker, then its deletions), leaves the cache consistent, and a restart
finds the fork whole or absent, and the parent stored or dropped: never a fork without
its inherited turns, never a dropped parent back.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from tests.faults import SITES, FaultInjector
from tieredkv import HostMemoryTier, RetentionHint, SSDTier, TieredKVCache
from tieredkv.backends.base import SegmentKey
from tieredkv.errors import TierIOError

from ..invariants import problems
from .test_forest import cat, head, kv, same

A0, A1, A2, B0 = kv(8, 1), kv(6, 2), kv(4, 4), kv(5, 3)
CAPACITY = 8 << 20
KIB = 1024

Op = Callable[[TieredKVCache], Awaitable[None]]


async def _fork(c: TieredKVCache) -> None:
    await c.append("b", B0, answer_tokens=1, parent="a", parent_tokens=10)


async def _drop_parent(c: TieredKVCache) -> None:
    await c.drop("a")


async def _setup(directory: Path, with_fork: bool) -> None:
    async with TieredKVCache([SSDTier(directory, CAPACITY)]) as c:
        await c.append("a", A0, answer_tokens=1)
        await c.append("a", A1, answer_tokens=1)
        await c.append("a", A2, answer_tokens=1)  # a turn no fork lists
        if with_fork:
            await _fork(c)


def _calls(faults: FaultInjector) -> dict[str, int]:
    return {site: faults.calls[site] for site in SITES}


async def _count(tmp_path: Path, op: Op, with_fork: bool) -> dict[str, int]:
    """How many times the operation calls each os site, in a run without faults."""
    directory = tmp_path / "count"
    await _setup(directory, with_fork)
    with FaultInjector() as faults:
        async with TieredKVCache([SSDTier(directory, CAPACITY)]) as c:
            before = _calls(faults)
            await op(c)
            after = _calls(faults)
    return {s: after[s] - before[s] for s in SITES if after[s] > before[s]}


async def _outcome(directory: Path) -> tuple[bool, bool]:
    """After a restart: (a stored, b stored), each checked byte for byte."""
    async with TieredKVCache([SSDTier(directory, CAPACITY)]) as c:
        assert problems(c) == []
        assert c.truncated() == {}
        a, b = c.contains("a"), c.contains("b")
        if a:
            same(await c.load("a"), cat(A0, A1, A2))
        if b:
            same(await c.load("b"), cat(A0, head(A1, 2), B0))
        return a, b


@pytest.mark.parametrize(
    ("name", "op", "with_fork", "before", "after"),
    [
        ("fork", _fork, False, (True, False), (True, True)),
        ("drop-parent", _drop_parent, True, (True, True), (False, True)),
    ],
)
async def test_a_fault_at_any_os_call_leaves_the_fork_whole_or_absent(
    tmp_path: Path,
    name: str,
    op: Op,
    with_fork: bool,
    before: tuple[bool, bool],
    after: tuple[bool, bool],
) -> None:
    counts = await _count(tmp_path, op, with_fork)
    assert counts, "the operation made no os call"
    tried = 0
    for site, n in sorted(counts.items()):
        for k in range(1, n + 1):
            directory = tmp_path / f"{name}-{site}-{k}"
            await _setup(directory, with_fork)
            with FaultInjector() as faults:
                async with TieredKVCache([SSDTier(directory, CAPACITY)]) as c:
                    faults.fail_nth(site, faults.calls[site] + k, errno.EIO)
                    try:
                        await op(c)
                    except TierIOError:
                        failed = True
                    else:
                        failed = False
                    with faults.paused():
                        await c.flush()
                        assert problems(c) == [], (site, k)
                        state = (c.contains("a"), c.contains("b"))
                        assert state == (before if failed else after), (site, k, failed)
            got = await _outcome(directory)
            # what the cache said is what a restart finds (a failed step left nothing)
            assert got == state, (site, k, failed, got)
            tried += 1
    assert tried == sum(counts.values())


async def test_a_cancelled_drop_of_a_parent_is_all_or_nothing(tmp_path: Path) -> None:
    for delay in range(6):
        directory = tmp_path / f"d{delay}"
        await _setup(directory, with_fork=True)
        async with TieredKVCache([SSDTier(directory, CAPACITY)]) as c:
            task = asyncio.ensure_future(c.drop("a"))
            for _ in range(delay):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            state = (c.contains("a"), c.contains("b"))
            assert state in ((True, True), (False, True))
            assert problems(c) == []
        assert await _outcome(directory) == state


class PausingSSD(SSDTier):
    """An SSD tier whose write of one segment waits for a signal (the copy is under way)."""

    def __init__(self, directory: Path, pause: tuple[str, int]) -> None:
        super().__init__(directory, CAPACITY, fsync=False)
        self.pause = pause
        self.reached = anyio.Event()
        self.go = anyio.Event()

    async def write(self, key: SegmentKey, data: memoryview) -> None:
        if key == self.pause and not self.go.is_set():
            self.reached.set()
            await self.go.wait()
        await super().write(key, data)


async def test_a_parent_dropped_while_a_fork_copies_its_turn_down_stays_dropped(
    tmp_path: Path,
) -> None:
    """A fork moving down to SSD copies its parent's turn there; the parent is dropped
    while that copy is under way. The parent's retirement marker must be in SSD once its
    turn is (else a restart brings the dropped parent back). Before, the drop saw the turn
    only in host memory, wrote no marker, and the copy then landed without one."""
    ssd = PausingSSD(tmp_path / "ssd", ("a", 0))
    tiers = [HostMemoryTier(40 * KIB), ssd]
    async with TieredKVCache(tiers, eviction="lru") as c:
        await c.append("a", kv(8, 1), answer_tokens=1)  # 16 KiB
        await c.append("b", B0, answer_tokens=1, parent="a", parent_tokens=6)
        c.hint("a", RetentionHint(pin=True, ttl=60))  # b is the one to leave host memory
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(c.append, "c", kv(20, 5), answer_tokens=1))
            with anyio.fail_after(30):
                await ssd.reached.wait()  # b's demotion is copying a's turn into SSD
            tg.start_soon(c.drop, "a")
            await anyio.sleep(0.2)
            ssd.go.set()
        assert c.where("b") == "ssd"
        await c.flush()
        assert problems(c) == []
    async with TieredKVCache([HostMemoryTier(40 * KIB), SSDTier(tmp_path / "ssd", CAPACITY)]) as c:
        assert problems(c) == []
        assert not c.contains("a"), "the dropped parent came back"
        same(await c.load("b"), cat(head(kv(8, 1), 6), B0))
