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
import torch

from tests.faults import SITES, FaultInjector
from tieredkv import HostMemoryTier, RetentionHint, SSDTier, TieredKVCache
from tieredkv.backends.base import SegmentKey
from tieredkv.backends.ssd import segment_file_name
from tieredkv.errors import TierIOError
from tieredkv.payload import RETIRED_SEQ

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
    """An SSD tier whose write (or delete) of one segment waits for a signal (the copy, or
    the delete, is under way)."""

    def __init__(self, directory: Path, pause: tuple[str, int], op: str = "write") -> None:
        super().__init__(directory, CAPACITY, fsync=False)
        self.pause = pause
        self.op = op
        self.reached = anyio.Event()
        self.go = anyio.Event()

    async def _wait(self, op: str, key: SegmentKey) -> None:
        if op == self.op and key == self.pause and not self.go.is_set():
            self.reached.set()
            await self.go.wait()

    async def write(self, key: SegmentKey, data: memoryview) -> None:
        await self._wait("write", key)
        await super().write(key, data)

    async def delete(self, key: SegmentKey) -> None:
        await self._wait("delete", key)
        await super().delete(key)


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


async def test_a_turn_a_fork_is_copying_down_stays_in_place_while_room_is_made(
    tmp_path: Path,
) -> None:
    """A fork moving down to SSD copies its parent's turn from its host-memory slot; while
    that copy is under way, another append needs a gap that only moving segments aside
    (defragmenting host memory) can make. The parent is idle, but its turn is being read:
    it must not move. Before, only the turns of busy conversations' own keys stayed put:
    the parent's turn moved, the new turn was written where it had been, and the fork's
    copy in SSD held those bytes (a restart found it damaged: the fork and its parent lost)."""
    a0 = kv(8, 1)  # 12 KiB segments: x, a; b's own turn 8 KiB
    ssd = PausingSSD(tmp_path / "ssd", ("a", 0))
    tiers = [HostMemoryTier(44 * KIB), ssd]
    async with TieredKVCache(tiers, eviction="lru") as c:
        await c.append("x", kv(8, 9), answer_tokens=1)
        await c.append("a", a0, answer_tokens=1)
        await c.append("b", B0, answer_tokens=1, parent="a", parent_tokens=6)
        c.hint("a", RetentionHint(pin=True, ttl=60))  # b is the one to leave host memory
        await c.drop("x")  # host memory: [12 KiB free][a 12][b 8][12 KiB free]
        d0 = kv(20, 6)  # 24 KiB: fits only once a's turn moves aside
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(c.append, "c", kv(24, 5), answer_tokens=1))
            with anyio.fail_after(30):
                await ssd.reached.wait()  # b's demotion is copying a's turn into SSD
            await c.append("d", d0, answer_tokens=1)
            ssd.go.set()
        assert c.where("b") == "ssd"
        await c.flush()
        assert problems(c) == []
    # (a load would promote b and delete its SSD copy: the restart reads what was copied)
    async with TieredKVCache([HostMemoryTier(44 * KIB), SSDTier(tmp_path / "ssd", CAPACITY)]) as c:
        assert c.truncated() == {}
        assert problems(c) == []
        same(await c.load("b"), cat(head(a0, 6), B0))
        same(await c.load("a"), a0)
        same(await c.load("d"), d0)


async def _dropped_parent_of_two_forks(
    c: TieredKVCache, a0: dict[str, torch.Tensor], c0: dict[str, torch.Tensor]
) -> None:
    """Parent ``a`` (``a0``) dropped, kept for fork ``b`` (in SSD, with ``a``'s turn: a
    marker of ``a`` there) and fork ``c`` (``c0``, in host memory)."""
    await c.append("a", a0, answer_tokens=1)
    await c.append("b", B0, answer_tokens=1, parent="a", parent_tokens=6)
    c.hint("a", RetentionHint(pin=True, ttl=60))
    await c.append("x", kv(20, 9), answer_tokens=1)  # b moves down, a's turn with it
    await c.drop("x")
    await c.append("c", c0, answer_tokens=1, parent="a", parent_tokens=8)
    await c.drop("a")  # kept for b (SSD) and c (host): a marker in SSD
    assert (c.where("b"), c.where("c")) == ("ssd", "host")


async def _check_the_parent_stays_dropped(
    c: TieredKVCache,
    ssd: Path,
    a0: dict[str, torch.Tensor],
    c0: dict[str, torch.Tensor],
    d0: dict[str, torch.Tensor],
) -> None:
    """After :func:`_dropped_parent_of_two_forks`, ``b`` promoted and ``c`` moved down by
    ``d``'s append (``d0``): the cache agrees with itself, and after a restart the parent
    is still dropped and every fork loads whole."""
    assert (c.where("b"), c.where("c")) == ("host", "ssd")
    await c.flush()
    assert problems(c) == []
    await c.aclose()
    async with TieredKVCache([HostMemoryTier(40 * KIB), SSDTier(ssd, CAPACITY)]) as again:
        assert problems(again) == []
        assert not again.contains("a"), "the dropped parent came back"
        same(await again.load("c"), cat(a0, c0))
        same(await again.load("b"), cat(head(a0, 6), B0))
        same(await again.load("d"), d0)


async def test_a_retired_turn_copied_down_while_its_marker_is_deleted_keeps_a_marker(
    tmp_path: Path,
) -> None:
    """A dropped parent's turn, kept for two forks, leaves SSD with the fork that held it
    there (promoted to host memory); its retirement marker is deleted from SSD after it.
    While that delete is under way, the other fork moves down to SSD and copies the turn
    back. The turn must not stay in SSD without a marker (a restart would bring the
    dropped parent back). Before, the copy saw the marker still listed and wrote none; the
    delete then took it away."""
    a0, c0, d0 = kv(8, 1), kv(5, 7), kv(12, 6)  # 12, 8 and 16 KiB segments
    ssd = PausingSSD(tmp_path / "ssd", ("a", RETIRED_SEQ), op="delete")
    tiers = [HostMemoryTier(40 * KIB), ssd]
    async with TieredKVCache(tiers, eviction="lru") as c:
        await _dropped_parent_of_two_forks(c, a0, c0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(c.load, "b")  # promoted: a's turn leaves SSD, then its marker
            with anyio.fail_after(30):
                await ssd.reached.wait()
            tg.start_soon(functools.partial(c.append, "d", d0, answer_tokens=1))  # c moves down
            await anyio.sleep(0.2)
            ssd.go.set()
        await _check_the_parent_stays_dropped(c, tmp_path / "ssd", a0, c0, d0)


async def test_a_parent_complete_in_ssd_through_its_fork_leaves_its_policy_when_it_grows(
    tmp_path: Path,
) -> None:
    """A fork moved down to SSD took all of its parent's turns there: the parent, served
    from host memory, has a complete copy in SSD too, and SSD's policy tracks it. Its next
    turn goes to host memory only: its SSD copy is no longer complete, and SSD's policy
    must stop tracking it (else it counts bytes that are not a copy of the parent, and
    picks it as a victim of SSD). Before, the policy went on tracking it."""
    tiers = [HostMemoryTier(40 * KIB), SSDTier(tmp_path / "ssd", CAPACITY, fsync=False)]
    async with TieredKVCache(tiers, eviction="lru") as c:
        a0, a1 = kv(8, 1), kv(4, 2)
        await c.append("a", a0, answer_tokens=1)
        await c.append("b", B0, answer_tokens=1, parent="a")
        c.hint("a", RetentionHint(pin=True, ttl=60))  # b is the one to leave host memory
        await c.append("x", kv(20, 9), answer_tokens=1)
        assert (c.where("a"), c.where("b")) == ("host", "ssd")
        assert list(c.channel["a"].copies) == ["host", "ssd"]
        assert problems(c) == []
        await c.append("a", a1, answer_tokens=1)
        assert list(c.channel["a"].copies) == ["host"]
        assert problems(c) == []
        same(await c.load("a"), cat(a0, a1))
        same(await c.load("b"), cat(a0, B0))


async def test_a_promotion_that_fails_leaves_no_shared_turn_behind(tmp_path: Path) -> None:
    """A fork being promoted into host memory keeps the turn it shares with another fork
    there while that one leaves (to make room for the promoted fork's own turn; their
    parent was dropped). The copy of the promoted fork's own turn then fails (EIO): neither
    fork has a complete copy in host memory, and the shared turn must not stay there (a
    partial copy at rest: space that no policy tracks or frees). Before, it stayed."""
    a0, g0 = kv(8, 1), kv(5, 7)  # 12 and 8 KiB segments; b's own turn 8 KiB
    tiers = [HostMemoryTier(40 * KIB), SSDTier(tmp_path / "ssd", CAPACITY, fsync=False)]
    with FaultInjector() as faults:
        async with TieredKVCache(tiers, eviction="lru", max_pinned_bytes=40 * KIB) as c:
            await c.append("a", a0, answer_tokens=1)
            await c.append("b", B0, answer_tokens=1, parent="a", parent_tokens=6)
            await c.append("g", g0, answer_tokens=1, parent="a")
            for keep in "ab":
                c.hint(keep, RetentionHint(pin=True, ttl=60))
            await c.append("x", kv(12, 9), answer_tokens=1)  # g moves down
            await c.drop("x")
            await c.drop("a")  # its turn stays, for b (host memory) and g (SSD)
            c.hint("b", RetentionHint(pin=False))
            await c.append("y", kv(16, 8), answer_tokens=1)  # host memory: 0 KiB free
            c.hint("y", RetentionHint(pin=True, ttl=60))
            assert [c.where(k) for k in "bgy"] == ["host", "ssd", "host"]
            # g's promotion: b leaves host memory for room, then g's turn fails to load
            faults.fail_nth("preadv", faults.calls["preadv"] + 1)
            with pytest.raises(TierIOError):
                await c.load("g")
            assert [c.where(k) for k in "bg"] == ["ssd", "ssd"]
            assert problems(c) == []
            same(await c.load("g"), cat(a0, g0))
            same(await c.load("b"), cat(head(a0, 6), B0))
            assert problems(c) == []


async def test_a_parent_evicted_from_its_last_tier_is_lost_or_kept_as_a_restart_finds_it(
    tmp_path: Path,
) -> None:
    """Room in the last tier is made by evicting a parent whose every turn a fork lists
    (the fork keeps them there). The parent is retired first (a marker: a restart does
    not bring it back); it must then be lost, not stay served, since a restart would not
    find it. Before, it stayed: complete there through its fork's turns, served live, and
    gone after a restart."""
    a0, b0, c0 = kv(8, 1), kv(5, 3), kv(8, 2)  # 12, 8 and 12 KiB segments, a marker 4
    async with TieredKVCache([SSDTier(tmp_path / "ssd", 28 * KIB)], eviction="lru") as c:
        await c.append("a", a0, answer_tokens=1)
        await c.append("b", b0, answer_tokens=1, parent="a")
        await c.append("c", c0, answer_tokens=1)  # a is the first victim
        live = {k: c.contains(k) for k in "abc"}
        assert problems(c) == []
    async with TieredKVCache([SSDTier(tmp_path / "ssd", 28 * KIB)]) as c:
        assert problems(c) == []
        assert {k: c.contains(k) for k in "abc"} == live
        if live["a"]:
            same(await c.load("a"), a0)
        if live["b"]:
            same(await c.load("b"), cat(a0, b0))
        same(await c.load("c"), c0)


class _HostWatchingDeletes(HostMemoryTier):
    """Host memory whose deletes, once ``armed``, signal ``deleting`` and take a moment
    (so that a test can cancel the operation that deletes)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.armed = False
        self.deleting = asyncio.Event()

    async def delete(self, key: SegmentKey) -> None:
        if self.armed:
            self.deleting.set()
            await asyncio.sleep(0.05)
        await super().delete(key)


async def _parent_whole_above_its_primary(c: TieredKVCache) -> None:
    """``a`` served from SSD with a whole copy in host memory too, that its fork ``b`` kept
    there when ``a`` moved down (``b`` then moved down as well); ``y`` in host memory."""
    await c.append("a", A_ROOT, answer_tokens=1)
    await c.append("b", B0, answer_tokens=1, parent="a")
    await c.flush()  # both written through to SSD
    c.hint("b", RetentionHint(pin=True, ttl=60))
    await c.append("x", kv(20, 9), answer_tokens=1)  # a moves down; b keeps a's turn
    assert [c.where(k) for k in "abx"] == ["ssd", "host", "ssd"]
    c.hint("a", RetentionHint(pin=True, ttl=60))
    c.hint("b", RetentionHint(pin=False))
    await c.append("y", kv(20, 8), answer_tokens=1)  # b moves down; a's turn stays
    assert [c.where(k) for k in "aby"] == ["ssd", "ssd", "host"]
    await c.flush()
    assert sorted(c.channel["a"].copies) == ["host", "ssd"]  # whole in both
    assert problems(c) == []


A_ROOT, A_NEXT = kv(8, 1), kv(4, 2)


async def test_a_turn_stored_below_a_copy_that_forks_kept_complete_leaves_no_partial_copy(
    tmp_path: Path,
) -> None:
    """A parent moved down to SSD while its fork kept its turn in host memory; the fork
    then left host memory too, and the turn stayed there as the parent's own complete copy
    (inclusive mode keeps copies above the primary). The parent's next turn goes to SSD,
    its primary: the host copy would no longer be complete, and no policy would track it,
    so it leaves host memory. Before, its turns stayed there (a partial copy at rest: host
    memory that nothing would ever free; the fault campaign's cancellation storm found it
    in about 1 run of 60 under load)."""
    tiers = [HostMemoryTier(40 * KIB), SSDTier(tmp_path / "ssd", CAPACITY, fsync=False)]
    async with TieredKVCache(
        tiers, mode="inclusive", eviction="lru", max_pinned_bytes=40 * KIB
    ) as c:
        await _parent_whole_above_its_primary(c)
        await c.append("a", A_NEXT, answer_tokens=1)  # stored in SSD, a's primary
        await c.flush()
        assert list(c.channel["a"].copies) == ["ssd"]
        assert problems(c) == []
        assert c.stats().tiers[0].used == 24 * KIB, "only y stays in host memory"
        same(await c.load("a"), cat(A_ROOT, A_NEXT))
        same(await c.load("b"), cat(A_ROOT, B0))
        assert problems(c) == []


async def test_a_cancelled_turn_below_a_copy_kept_above_leaves_the_channel_agreeing(
    tmp_path: Path,
) -> None:
    """The same, the append cancelled while the host copy it made outdated was being
    removed: the turn is not stored, the host copy is gone, and the channel says so (it
    must not list a host copy that the index no longer has)."""
    host = _HostWatchingDeletes(40 * KIB)
    tiers = [host, SSDTier(tmp_path / "ssd", CAPACITY, fsync=False)]
    async with TieredKVCache(
        tiers, mode="inclusive", eviction="lru", max_pinned_bytes=40 * KIB
    ) as c:
        await _parent_whole_above_its_primary(c)
        host.armed = True
        task = asyncio.create_task(c.append("a", A_NEXT, answer_tokens=1))
        with anyio.fail_after(10):  # (the copy in host memory is removed, or this fails)
            await host.deleting.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        host.armed = False
        await c.flush()
        assert c.channel["a"].turns == 1
        assert list(c.channel["a"].copies) == ["ssd"]
        assert problems(c) == []
        same(await c.load("a"), A_ROOT)
        assert problems(c) == []


async def test_a_drop_whose_marker_fails_leaves_the_write_through_running(
    tmp_path: Path,
) -> None:
    """In inclusive mode, a fork that other forks build on is dropped, and writing its
    retirement marker into SSD fails: the drop does nothing (it raises), and the
    conversation's background copy into SSD must go on as before. Before, the drop had
    stopped that copy for good: the conversation's next turn never reached SSD, and its
    other turns stayed there, a partial copy that no policy tracked or freed."""
    ssd_dir = tmp_path / "ssd"
    tiers = [HostMemoryTier(CAPACITY), SSDTier(ssd_dir, CAPACITY)]
    marker = segment_file_name(("b", RETIRED_SEQ))
    async with TieredKVCache(tiers, mode="inclusive") as c:
        await c.append("a", A0, answer_tokens=1)
        await c.append("b", B0, answer_tokens=1, parent="a")
        await c.append("c", A2, answer_tokens=1, parent="b")  # c lists b's own turn
        await c.flush()
        with FaultInjector() as faults:
            faults.fail_matching("open", marker.split("/")[-1])
            with pytest.raises(TierIOError):
                await c.drop("b")
            assert faults.total_injected == 1
        assert c.contains("b")
        await c.append("b", A1, answer_tokens=1)
        await c.flush()
        assert problems(c) == []
        assert list(c.channel["b"].copies) == ["host", "ssd"]
    async with TieredKVCache([SSDTier(ssd_dir, CAPACITY)]) as c:
        assert problems(c) == []
        same(await c.load("b"), cat(A0, B0, A1))
        same(await c.load("c"), cat(A0, B0, A2))


async def test_a_marker_whose_delete_failed_is_written_again_when_its_turn_comes_back(
    tmp_path: Path,
) -> None:
    """A dropped parent's turn, kept for two forks, leaves SSD with the fork that held it
    there (promoted to host memory), and deleting the parent's retirement marker from SSD
    then fails (it is left to be deleted later). The other fork then moves down to SSD and
    copies the turn back. The marker must be there once the turn is, and stay: at the close
    the failed delete is tried again. Before, the copy took the marker for present (still
    listed) and wrote none; the close then deleted it, and a restart brought the dropped
    parent back."""
    a0, c0, d0 = kv(8, 1), kv(5, 7), kv(12, 6)  # 12, 8 and 16 KiB segments
    marker = segment_file_name(("a", RETIRED_SEQ)).split("/")[-1]
    tiers = [HostMemoryTier(40 * KIB), SSDTier(tmp_path / "ssd", CAPACITY)]
    async with TieredKVCache(tiers, eviction="lru") as c:
        await _dropped_parent_of_two_forks(c, a0, c0)
        with FaultInjector() as faults:
            faults.fail_matching("unlink", marker)
            same(await c.load("b"), cat(head(a0, 6), B0))  # promoted: a's turn leaves SSD
            assert faults.total_injected == 1  # (the marker's delete failed)
        await c.append("d", d0, answer_tokens=1)  # c moves down, a's turn with it
        await _check_the_parent_stays_dropped(c, tmp_path / "ssd", a0, c0, d0)


async def test_a_name_whose_old_marker_cannot_be_deleted_stores_nothing_new(
    tmp_path: Path,
) -> None:
    """A dropped parent's last fork is dropped; deleting the parent's retirement marker
    fails, and keeps failing. A new conversation under the parent's name must not be
    stored while that marker may still be on disk: a restart would take the new one for
    the retired parent, and serve none of its acknowledged turns. Its append fails with
    nothing stored; once the marker is gone, the name is free."""
    marker = segment_file_name(("a", RETIRED_SEQ)).split("/")[-1]
    ssd = tmp_path / "ssd"
    async with TieredKVCache([SSDTier(ssd, CAPACITY)]) as c:
        await c.append("a", A0, answer_tokens=1)
        await c.append("b", B0, answer_tokens=1, parent="a")
        await c.drop("a")  # kept for b: a marker
        with FaultInjector() as faults:
            faults.fail_matching("unlink", marker, times=100)
            await c.drop("b")  # a's turn goes; its marker's delete fails
            with pytest.raises(TierIOError, match="retirement marker"):
                await c.append("a", A1, answer_tokens=1)
            assert not c.contains("a")
            assert problems(c) == []
            await c.aclose()  # (its delete fails again)
            assert faults.total_injected >= 3
    async with TieredKVCache([SSDTier(ssd, CAPACITY)]) as c:
        assert problems(c) == []
        assert not c.contains("a")
        assert not c.contains("b")
        await c.append("a", A1, answer_tokens=1)
    async with TieredKVCache([SSDTier(ssd, CAPACITY)]) as c:
        assert c.truncated() == {}
        same(await c.load("a"), A1)
