"""``aclose()`` keeps what the cache holds (issue 22 case 13, invariant I7).

In exclusive mode a conversation held in host memory has no other copy. Before, closing
dropped every such conversation without a word (a user's program: 39 of 50 came back
after a close and a reopen), and after a restart, loading a conversation moved it into
host memory and deleted its SSD copy, so the next close lost it too. Now the close writes
each conversation that only volatile tiers hold down to the SSD tier, into free room
(evicting nothing), most recently used first, within ``close_timeout``; it logs what it
does, and counts in ``stats().unsaved`` what it could not write. Cancelling the close (any
kind) does not interrupt it: the write-down and the tiers' closing complete, then the
cancellation is raised.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

from tests.cancellation import CANCELS, cancellable
from tests.invariants import problems
from tieredkv import ClosedError, HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.errors import HistoryLostError, InvalidArgumentError, InvalidTypeError

CONVERSATIONS = 50
TURNS = 3
HOST = 512 << 10  # about 14 conversations of 36 KiB
SSD = 64 << 20


def turn(conversation: int, t: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * conversation + t)
    return {name: torch.randint(0, 256, (4, 1024), dtype=torch.uint8, generator=g) for name in "kv"}


def history(conversation: int, turns: int = TURNS) -> dict[str, torch.Tensor]:
    """The last ``turns`` turns (a conversation evicted for good starts again)."""
    parts = [turn(conversation, t) for t in range(TURNS - turns, TURNS)]
    return {name: torch.cat([p[name] for p in parts]) for name in "kv"}


def make(directory: Path, *, ssd: int = SSD, close_timeout: float = 60.0) -> TieredKVCache:
    tiers = [HostMemoryTier(HOST), SSDTier(directory, ssd, fsync=False)]
    return TieredKVCache(tiers, mode="exclusive", close_timeout=close_timeout)


async def fill(cache: TieredKVCache) -> None:
    for t in range(TURNS):
        for c in range(CONVERSATIONS):
            try:
                await cache.append(f"c{c}", turn(c, t), answer_tokens=5)
            except HistoryLostError:  # evicted for good: told once, it starts again
                await cache.append(f"c{c}", turn(c, t), answer_tokens=5)


async def came_back(directory: Path, turns: dict[str, int] | None = None) -> list[int]:
    """Reopen the directory; the conversations that load back exactly, each with ``turns``
    turns (all by default): a partial or wrong history fails the test."""
    back = []
    async with make(directory) as cache:
        assert problems(cache) == []
        for c in range(CONVERSATIONS):
            if cache.contains(f"c{c}"):
                got = await cache.load(f"c{c}")
                want = history(c, TURNS if turns is None else turns[f"c{c}"])
                assert all(torch.equal(got[n], want[n]) for n in "kv"), f"c{c} differs"
                back.append(c)
    return back


def in_host(cache: TieredKVCache) -> list[str]:
    return [s for s in cache.sessions() if cache.where(s) == "host"]


async def test_a_program_that_closes_and_reopens_keeps_all_50_conversations(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """50 conversations of 3 turns, about 14 of them in host memory at the end: after the
    close and a reopen all 50 load back exactly; the close logged what it wrote and counted
    it. Then a restarted program loads every conversation (each moves into host memory,
    its SSD copy deleted), closes, and reopens: all 50 again."""
    root = tmp_path / "ssd"
    caplog.set_level(logging.INFO, logger="tieredkv.cache")
    cache = make(root)
    async with cache:
        await fill(cache)
        resident = in_host(cache)
        assert 5 < len(resident) < CONVERSATIONS
        nbytes = sum(cache.channel[s].nbytes for s in resident)
    stats = cache.stats()
    assert (stats.written_down, stats.unsaved) == (len(resident), 0)
    messages = [r.getMessage() for r in caplog.records if r.name == "tieredkv.cache"]
    assert (
        f"closing: writing {len(resident)} conversation(s) ({nbytes:,} bytes) held only in "
        f"volatile tiers down to 'ssd' (close_timeout 60 s)" in messages
    )
    assert any(
        m.startswith(f"closing: wrote {len(resident)} conversation(s) ({nbytes:,} bytes) down")
        for m in messages
    )
    assert await came_back(root) == list(range(CONVERSATIONS))

    async with make(root) as again:  # the restarted program loads them all, then closes
        for c in range(CONVERSATIONS):
            await again.load(f"c{c}")
        assert len(in_host(again)) > 5
    assert again.stats().unsaved == 0
    assert await came_back(root) == list(range(CONVERSATIONS))


async def test_close_writes_into_free_room_only_and_counts_the_rest(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An SSD tier too small for everything: the close evicts none of what the SSD holds,
    writes what fits, counts the others in stats().unsaved and says so in a warning; the
    reopened cache has exactly the SSD's conversations and those written."""
    root = tmp_path / "ssd"
    cache = make(root, ssd=30 * 40 << 10)
    async with cache:
        await fill(cache)
        on_ssd = {s for s in cache.sessions() if cache.where(s) == "ssd"}
        resident = set(in_host(cache))
        assert on_ssd
        assert resident
        turns = {s: cache.channel[s].turns for s in cache.sessions()}
    stats = cache.stats()
    assert stats.unsaved > 0
    assert stats.written_down + stats.unsaved == len(resident)
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage().startswith(
        f"closing: {stats.unsaved} of {len(resident)} conversation(s) held only in volatile "
        f"tiers could not be written down ({stats.unsaved} for want of room in 'ssd', 0 by "
        f"I/O errors, 0 by the close timeout of 60 s): they are lost with this close"
    )
    back = {f"c{c}" for c in await came_back(root, turns)}
    assert on_ssd <= back <= on_ssd | resident
    assert len(back) == len(on_ssd) + stats.written_down


async def test_the_close_timeout_bounds_the_write_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """close_timeout=0 writes nothing down: every host-resident conversation is counted as
    unsaved (and the warning names the timeout); the SSD's come back."""
    root = tmp_path / "ssd"
    cache = make(root, close_timeout=0)
    async with cache:
        await fill(cache)
        resident = in_host(cache)
    assert (cache.stats().written_down, cache.stats().unsaved) == (0, len(resident))
    assert "by the close timeout of 0 s" in caplog.text
    assert len(await came_back(root)) == CONVERSATIONS - len(resident)


@pytest.mark.parametrize("bad", [-1, float("nan"), "5", True])
def test_a_bad_close_timeout_is_refused(tmp_path: Path, bad: object) -> None:
    """close_timeout must be a number of seconds from 0 (inf for no bound)."""
    with pytest.raises((InvalidArgumentError, InvalidTypeError), match="close_timeout"):
        make(tmp_path, close_timeout=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("delay", [0.0, 0.002, 0.02])
@pytest.mark.parametrize("kind", CANCELS)
async def test_a_cancelled_close_still_writes_down_and_closes(
    tmp_path: Path, kind: str, delay: float, caplog: pytest.LogCaptureFixture
) -> None:
    """Cancelling aclose() (task.cancel, asyncio.timeout, wait_for, an anyio scope) at
    several moments: the cancellation reaches the caller only once the close is complete
    (everything written down, every tier closed: the directory's lock is free), nothing is
    logged as an error, no task is left behind, and all 50 conversations come back."""
    root = tmp_path / "ssd"
    cache = make(root)
    await cache.open()
    await fill(cache)
    resident = len(in_host(cache))
    before = asyncio.all_tasks()
    done, _ = await cancellable(kind, delay, cache.aclose)
    # natively cancelled at 0 s every time (an anyio scope's cancellation is delivered at a
    # checkpoint, and the close, shielded throughout, may finish without reaching one)
    assert not done or delay > 0 or kind == "anyio"
    assert asyncio.all_tasks() <= before
    if cache.sessions():  # wait_for(..., 0) cancels the call before it starts: still open
        assert (kind, delay, cache.stats().written_down) == ("wait_for", 0.0, 0)
        await cache.aclose()
    assert (cache.stats().written_down, cache.stats().unsaved) == (resident, 0)
    with pytest.raises(ClosedError):
        await cache.load("c0")
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert await came_back(root) == list(range(CONVERSATIONS))


async def test_out_of_time_in_inclusive_mode_leaves_no_older_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inclusive mode with a slow SSD (each write sleeps 10 ms in its worker thread), each
    conversation's three turns appended back to back, closed with close_timeout=0 right
    after the appends, while the write-through is far behind:
    the copies stop at a segment's end, and each conversation whose SSD copy is incomplete
    has that part removed and is counted as unsaved. After a reopen every conversation is
    back whole (all three turns) or not at all: never an older, shorter history."""
    real_pwrite = os.pwrite

    def slow_pwrite(*args: Any) -> int:
        time.sleep(0.01)
        return real_pwrite(*args)

    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    root = tmp_path / "ssd"
    tiers = [HostMemoryTier(8 << 20), SSDTier(root, SSD, fsync=False)]
    cache = TieredKVCache(tiers, mode="inclusive", close_timeout=0)
    async with cache:
        for c in range(CONVERSATIONS):
            for t in range(TURNS):
                await cache.append(f"c{c}", turn(c, t), answer_tokens=5)
        behind = [s for s in cache.sessions() if "ssd" not in cache.channel[s].copies]
    monkeypatch.undo()
    assert len(behind) > 10
    stats = cache.stats()
    assert 0 < stats.unsaved <= len(behind)
    assert stats.written_down == 0
    back = await came_back(root)
    assert len(back) == CONVERSATIONS - stats.unsaved


@pytest.mark.parametrize("operation", ["load", "prefetch"])
async def test_a_promotion_under_way_when_the_close_begins_keeps_its_conversation(
    tmp_path: Path, operation: str
) -> None:
    """A conversation on SSD alone is being moved up into host memory (a load or a
    prefetch, in exclusive mode: its SSD copy goes once it is up) when the close begins.
    The close waits for the move, then writes the conversation down with the others, so a
    reopened cache serves it. Before, the close looked for conversations held only in host
    memory before the move ended, missed it, and let host memory go: it was lost, and
    ``stats().unsaved`` said nothing was."""
    root = tmp_path / "ssd"
    async with make(root) as cache:
        for t in range(TURNS):
            await cache.append("c0", turn(0, t), answer_tokens=5)
    for ticks in (1, 2, 3, 5, 8):
        cache = make(root)
        await cache.open()
        await cache.append("c1", turn(1, 0), answer_tokens=5)  # in host memory alone
        assert cache.where("c0") == "ssd"
        moved: list[object] = []

        async def move(cache: TieredKVCache = cache, moved: list[object] = moved) -> None:
            if operation == "load":
                moved.append(await cache.load("c0"))
            else:
                moved.append(await cache.prefetch("c0"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(move)
            for _ in range(ticks):
                await anyio.lowlevel.checkpoint()
            await cache.aclose()
        assert len(moved) == 1, ticks  # (it began before the close: it completed)
        assert (cache.stats().written_down, cache.stats().unsaved) == (2, 0), ticks
        async with make(root) as again:
            assert problems(again) == []
            for c, turns in (("c0", TURNS), ("c1", 1)):
                got = await again.load(c)
                want = history(int(c[1]), turns) if c == "c0" else turn(1, 0)
                assert all(torch.equal(got[n], want[n]) for n in "kv"), (c, ticks)
            await again.drop("c1")
