"""Regression tests, one per scenario in which the cache's state machine used to break
under native asyncio cancellation or an I/O error (issue 12). Each names the scenario.

Slow I/O is real I/O made slow: the SSD tier's own ``os`` calls sleep first (in the worker
thread), so a cancellation lands while a thread still reads or writes.
"""

from __future__ import annotations

import asyncio
import errno
import importlib
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import pytest
import torch

from tests.faults import SSD_MODULES
from tests.invariants import problems
from tieredkv import ClosedError, HostMemoryTier, SSDTier, TieredKVCache, TierIOError
from tieredkv.backends.ssd import segment_file_name

KIB = 1024


def kv(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randint(0, 256, (tokens, 64 * KIB), dtype=torch.uint8, generator=g)}


@contextmanager
def slow(
    monkeypatch: pytest.MonkeyPatch, seconds: float, *names: str, calls: int = 1 << 30
) -> Iterator[None]:
    """The SSD tier's first ``calls`` os.<names> calls sleep ``seconds`` first (in their
    worker thread)."""
    proxy = ModuleType("os")
    left = [calls]

    def delayed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if left[0] > 0:
                left[0] -= 1
                time.sleep(seconds)
            return fn(*args, **kwargs)

        return call

    for attr in dir(os):
        setattr(proxy, attr, getattr(os, attr))
    for name in names:
        setattr(proxy, name, delayed(getattr(os, name)))
    with monkeypatch.context() as m:
        for name in SSD_MODULES:
            m.setattr(importlib.import_module(name), "os", proxy)
        yield


def failing(monkeypatch: pytest.MonkeyPatch, name: str, *, times: int = 1 << 30) -> list[int]:
    """os.<name> fails with EIO ``times`` times (everywhere); returns a call counter."""
    real = getattr(os, name)
    calls = [0]

    def call(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] <= times:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, call)
    return calls


async def cancel_natively(kind: str, op: Callable[[], Any], after: float) -> None:
    """Run ``op`` and cancel it with ``kind`` after ``after`` seconds; it must not finish."""
    if kind == "task.cancel":
        task = asyncio.get_running_loop().create_task(op())
        await asyncio.sleep(after)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    elif kind == "asyncio.timeout":
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(after):
                await op()
    else:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(op(), after)


NATIVE = ["task.cancel", "asyncio.timeout", "wait_for"]


def ssd_only(directory: Path, *, fsync: bool = True) -> TieredKVCache:
    return TieredKVCache([SSDTier(directory, 64 << 20, fsync=fsync)])


def two_tier(directory: Path, mode: str = "exclusive", host: int = 1024 * KIB) -> TieredKVCache:
    return TieredKVCache(
        [HostMemoryTier(host), SSDTier(directory, 64 << 20, fsync=True)],
        mode=mode,  # type: ignore[arg-type]
    )


# -- native cancellation ------------------------------------------------------------------


@pytest.mark.parametrize("kind", NATIVE)
async def test_cancelled_load_keeps_its_host_slots_until_the_reader_is_done(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A load promoting from SSD is cancelled while its reader thread fills host slots; a
    session appended right after must not get those slots (it would load the first one's
    bytes, unnoticed: host data carries no checksum)."""
    async with two_tier(ssd_dir, host=600 * KIB) as cache:  # room for one of them
        await cache.append("a", kv(8, 1), answer_tokens=1)  # 512 KiB
        await cache.append("filler", kv(9, 2), answer_tokens=1)  # pushes "a" to the SSD
        assert cache.where("a") == "ssd"
        await cache.drop("filler")
        with slow(monkeypatch, 0.2, "pread", "preadv", "readv"):
            await cancel_natively(kind, lambda: cache.load("a"), after=0.05)
            b = kv(8, 3)
            await cache.append("b", b, answer_tokens=1)
            await asyncio.sleep(0.3)  # a reader left running would have written by now
        assert torch.equal((await cache.load("b"))["kv"], b["kv"])
        assert torch.equal((await cache.load("a"))["kv"], kv(8, 1)["kv"])
        assert problems(cache) == []


@pytest.mark.parametrize("kind", NATIVE)
async def test_cancelled_append_is_not_there_after_a_restart(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """An append reported as cancelled while its writer thread was renaming the file must
    leave no trace, now or after a restart."""
    async with ssd_only(ssd_dir) as cache:
        await cache.append("s", kv(2, 1), answer_tokens=1)
        with slow(monkeypatch, 0.2, "replace"):
            await cancel_natively(kind, lambda: cache.append("s", kv(2, 2), answer_tokens=1), 0.05)
        await asyncio.sleep(0.3)  # a writer thread left running would have renamed by now
        assert cache.channel["s"].turns == 1
        found = problems(cache)
        stats = cache.stats()
    async with ssd_only(ssd_dir) as again:
        assert again.channel["s"].turns == 1
        assert torch.equal((await again.load("s"))["kv"], kv(2, 1)["kv"])
    assert found == []
    assert stats.cancelled == 1


async def test_cancelled_append_cannot_land_after_a_later_acknowledged_one(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancelled append's rename used to land after a later, acknowledged append of the
    same turn, and load then returned the cancelled data."""
    async with ssd_only(ssd_dir) as cache:
        with slow(monkeypatch, 0.2, "replace", calls=1):  # only the cancelled one is slow
            task = asyncio.get_running_loop().create_task(
                cache.append("s", kv(2, 1), answer_tokens=1)
            )
            await asyncio.sleep(0.05)
            task.cancel()
            await cache.append("s", kv(2, 2), answer_tokens=1)  # waits for the cancelled one
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.3)  # a writer thread left running would have renamed by now
        assert torch.equal((await cache.load("s"))["kv"], kv(2, 2)["kv"])
        assert problems(cache) == []
    async with ssd_only(ssd_dir) as again:
        assert torch.equal((await again.load("s"))["kv"], kv(2, 2)["kv"])


@pytest.mark.parametrize("kind", [*NATIVE, "anyio"])
@pytest.mark.parametrize("call", ["append", "load", "drop"])
async def test_a_call_cancelled_while_it_waits_for_the_lock_is_counted_once(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str, call: str
) -> None:
    """A call cancelled while another one holds the conversation's lock does nothing, and
    counts in stats().cancelled like a call rolled back mid-move (the .ci/run of
    fbd3e06 had a layer-wise load whose deadline passed before it took the lock go
    uncounted)."""
    async with ssd_only(ssd_dir) as cache:
        calls: dict[str, Callable[[], Any]] = {
            "append": lambda: cache.append("s", kv(2, 3), answer_tokens=1),
            "load": lambda: cache.load("s"),
            "drop": lambda: cache.drop("s"),
        }
        await cache.append("s", kv(2, 1), answer_tokens=1)
        with slow(monkeypatch, 0.6, "replace", calls=1):  # the holder's rename is slow
            holder = asyncio.get_running_loop().create_task(
                cache.append("s", kv(2, 2), answer_tokens=1)
            )
            await asyncio.sleep(0.05)  # the holder has the lock, in its rename
            if kind == "anyio":
                with anyio.move_on_after(0.05) as scope:
                    await calls[call]()
                assert scope.cancelled_caught
            else:
                await cancel_natively(kind, calls[call], after=0.05)
            assert not holder.done()
            await holder
        assert cache.stats().cancelled == 1
        assert cache.channel["s"].turns == 2
        want = torch.cat([kv(2, 1)["kv"], kv(2, 2)["kv"]])
        assert torch.equal((await cache.load("s"))["kv"], want)
        with anyio.CancelScope() as scope:  # a deadline already passed: it cannot begin
            scope.cancel()
            await calls[call]()
        assert scope.cancelled_caught
        assert cache.stats().cancelled == 2
        assert cache.channel["s"].turns == 2
        assert problems(cache) == []


@pytest.mark.parametrize("kind", [*NATIVE, "anyio"])
async def test_cancelled_drop_in_inclusive_mode_leaves_the_session_whole(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A drop cancelled while it waits for write-through used to leave load raising
    ValueError forever (native), or a 'dropped' flag that silently stopped write-through so
    the session came back with 0 turns after a restart (anyio)."""
    async with two_tier(ssd_dir, "inclusive", host=4096 * KIB) as cache:
        with slow(monkeypatch, 0.05, "pwrite"):
            for i in range(3):
                await cache.append("s", kv(2, i), answer_tokens=1)
            if kind == "anyio":
                with anyio.move_on_after(0.02) as scope:
                    await cache.drop("s")
                assert scope.cancelled_caught
            else:
                await cancel_natively(kind, lambda: cache.drop("s"), after=0.02)
            assert cache.stats().cancelled == 1  # (it did nothing)
            want = torch.cat([kv(2, i)["kv"] for i in range(3)])
            assert torch.equal((await cache.load("s"))["kv"], want)
            await cache.flush()
        assert cache.channel["s"].copies == ("host", "ssd")
        assert problems(cache) == []
    async with two_tier(ssd_dir, "inclusive", host=4096 * KIB) as again:
        assert again.channel["s"].turns == 3
        assert torch.equal((await again.load("s"))["kv"], want)


# -- I/O errors during moves ----------------------------------------------------------------


async def test_failed_cleanup_after_failed_demotion_poisons_nothing(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A demotion fails half-way and deleting what it wrote fails too: the key the SSD tier
    keeps is an orphan, retried later; evicting that session again and unrelated appends
    (561 of 720 used to fail) work once the disk does."""
    async with two_tier(ssd_dir, host=1024 * KIB) as cache:
        await cache.append("v", kv(4, 1), answer_tokens=1)
        await cache.append("v", kv(4, 2), answer_tokens=1)  # two segments, 512 KiB
        writes = [0]
        real_pwrite = os.pwrite

        def second_fails(*args: Any, **kwargs: Any) -> Any:
            writes[0] += 1
            if writes[0] == 2:
                raise OSError(errno.EIO, "injected")
            return real_pwrite(*args, **kwargs)

        monkeypatch.setattr(os, "pwrite", second_fails)
        failing(monkeypatch, "unlink")
        with pytest.raises(TierIOError):
            await cache.append("w", kv(10, 3), answer_tokens=1)  # must demote "v"
        assert cache.where("v") == "host"
        assert cache._core.orphans  # the first segment written could not be deleted
        assert problems(cache) == []
        monkeypatch.undo()
        for i in range(6):  # fault-free appends, each evicting others
            await cache.append(f"u{i}", kv(6, 10 + i), answer_tokens=1)
        want = torch.cat([kv(4, 1)["kv"], kv(4, 2)["kv"]])
        assert torch.equal((await cache.load("v"))["kv"], want)
        assert not cache._core.orphans
        assert problems(cache) == []


async def promoted_undeletable(
    cache: TieredKVCache, monkeypatch: pytest.MonkeyPatch
) -> dict[str, torch.Tensor]:
    """Store "a" (one turn) on SSD in ``cache`` (exclusive, two tiers), make every unlink
    fail, then load it: it moves up to host memory and its SSD copy cannot be deleted.
    Returns what the load gave."""
    await cache.append("a", kv(8, 1), answer_tokens=1)
    await cache.append("filler", kv(9, 2), answer_tokens=1)
    await cache.drop("filler")
    assert cache.where("a") == "ssd"
    failing(monkeypatch, "unlink")
    got = await cache.load("a")
    assert cache.where("a") == "host"
    return got


async def test_failed_delete_after_promotion_keeps_channel_and_policy_truthful(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleting the SSD copy after a promotion fails: the channel used to keep saying "ssd"
    and the session was never admitted to tier 0's eviction policy."""
    async with two_tier(ssd_dir) as cache:
        assert torch.equal((await promoted_undeletable(cache, monkeypatch))["kv"], kv(8, 1)["kv"])
        assert cache.channel["a"].copies == ("host",)
        assert len(cache._core.policies[0]) == 1
        assert problems(cache) == []
        monkeypatch.undo()
    # the deletion is retried at close (no orphan is left), then "a", held only in host
    # memory, is written down again: its one segment is the SSD's only file
    assert (cache.stats().orphans, cache.stats().written_down) == (0, 1)
    assert [p.name for p in (ssd_dir / "segments").rglob("*.seg")] == [
        segment_file_name(("a", 0)).split("/")[1]
    ]


async def test_failed_drop_leaves_no_half_dropped_session(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drop whose deletions fail used to leave the session listed, its primary tier
    pointing at missing segments."""
    async with ssd_only(ssd_dir) as cache:
        for i in range(3):
            await cache.append("s", kv(2, i), answer_tokens=1)
        failing(monkeypatch, "unlink", times=2)
        await cache.drop("s")
        assert not cache.contains("s")
        assert "s" not in cache.channel
        assert problems(cache) == []
        await cache.append("s", kv(1, 9), answer_tokens=1)  # reuses seq 0: orphan purged first
        assert torch.equal((await cache.load("s"))["kv"], kv(1, 9)["kv"])
        assert problems(cache) == []
    async with ssd_only(ssd_dir) as again:
        assert again.channel["s"].turns == 1


async def test_no_turn_is_stored_under_a_key_whose_older_files_cannot_be_deleted(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drop whose deletes of the last two of five turns keep failing leaves those files
    on disk (orphans). A new conversation under the same key must not be stored meanwhile:
    a reopened cache would serve its turns joined to the old turns 3 and 4 (a splice).
    Before, the new turns were acknowledged, and the reopen served 3 new turns + 2 old ones,
    reporting nothing. Once the deletes succeed, the key takes turns again."""
    async with ssd_only(ssd_dir) as cache:
        for i in range(5):
            await cache.append("s", kv(2, i), answer_tokens=1)
        real = os.unlink

        def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            if str(path).endswith((".3.seg", ".4.seg")):
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            real(path, *args, **kwargs)

        monkeypatch.setattr(os, "unlink", unlink)
        await cache.drop("s")
        assert cache.stats().orphans == 2
        with pytest.raises(TierIOError, match=r"an older copy of its turn [34] could not be"):
            await cache.append("s", kv(1, 9), answer_tokens=1)
        assert not cache.contains("s")
        assert problems(cache) == []
        monkeypatch.undo()  # the disk recovers: the next append deletes them first
        for i in range(3):
            await cache.append("s", kv(1, 10 + i), answer_tokens=1)
    async with ssd_only(ssd_dir) as again:
        assert again.truncated() == {}
        got = await again.load("s")
        want = torch.cat([kv(1, 10 + i)["kv"] for i in range(3)])
        assert torch.equal(got["kv"], want)


async def test_a_conversation_whose_older_copy_cannot_be_deleted_takes_no_new_turn(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exclusive mode: a load moves "a" up to host memory and deleting its SSD copy fails
    and keeps failing. A new turn of "a" is refused while that copy remains: the close
    could not write the grown history down over it, and a reopened cache would serve the
    old copy as current. Before, the turn was acknowledged and the reopen served the
    history without it. The old copy is "a"'s whole history then, and is what a reopen
    serves; once the delete succeeds the turn is taken."""
    async with two_tier(ssd_dir) as cache:
        await promoted_undeletable(cache, monkeypatch)
        with pytest.raises(TierIOError, match="an older copy of its turn 0 could not be"):
            await cache.append("a", kv(2, 3), answer_tokens=1)
        assert cache.channel["a"].turns == 1
        monkeypatch.undo()
        await cache.append("a", kv(2, 3), answer_tokens=1)
    async with two_tier(ssd_dir) as again:
        got = await again.load("a")
        assert torch.equal(got["kv"], torch.cat([kv(8, 1)["kv"], kv(2, 3)["kv"]]))


async def test_write_through_stopped_by_an_io_error_is_retried_at_close(
    ssd_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inclusive mode: an EIO stops a session's background copy to the SSD; closing the
    cache tries it once more, so a restart still finds the session (it used to be lost)."""
    async with two_tier(ssd_dir, "inclusive", host=4096 * KIB) as cache:
        failing(monkeypatch, "pwrite", times=1)
        await cache.append("s", kv(2, 1), answer_tokens=1)
        await cache.flush()
        assert cache.channel["s"].copies == ("host",)  # the copy stopped
        assert problems(cache) == []
        monkeypatch.undo()
    async with two_tier(ssd_dir, "inclusive", host=4096 * KIB) as again:
        assert torch.equal((await again.load("s"))["kv"], kv(2, 1)["kv"])


async def test_close_does_not_rewrite_a_copy_the_policy_evicted(tmp_path: Path) -> None:
    """Inclusive mode: a session whose SSD copy was evicted to make room for another's is not
    copied back at close (that would evict the other's copy in turn): what the SSD held
    before close is exactly what a restart finds. (Found by the stateful test: the retry at
    close once restarted every incomplete copy, not only those an I/O error stopped.)"""

    def turn(tokens: int) -> dict[str, torch.Tensor]:
        return {
            "kv": torch.arange(tokens * 1000, dtype=torch.int32).to(torch.uint8).view(tokens, 1000)
        }

    def tiers() -> list[Any]:
        return [HostMemoryTier(16 << 10), SSDTier(tmp_path, 48 << 10, fsync=False)]

    cache = TieredKVCache(tiers(), mode="inclusive")
    await cache.open()
    for session, tokens in [("a", 4), ("a", 1), ("a", 1), ("a", 1), ("a", 4), ("a", 4)]:
        await cache.append(session, turn(tokens), answer_tokens=tokens)
        await cache.flush()
    for session in ("b", "c"):
        await cache.append(session, turn(4), answer_tokens=4)
        await cache.flush()
    assert cache.channel["b"].copies == ("host",)  # evicted from the SSD for c's copy
    on_ssd = {k for k in cache.sessions() if "ssd" in cache.channel[k].copies}
    assert on_ssd == {"a", "c"}
    await cache.aclose()
    async with TieredKVCache(tiers(), mode="inclusive") as reopened:
        assert set(reopened.sessions()) == on_ssd
        got = await reopened.load("c")
        assert torch.equal(got["kv"], turn(4)["kv"])


@pytest.mark.parametrize(
    ("call", "names"), [("append", ("replace", "fsync")), ("load", ("pread", "preadv"))]
)
async def test_a_call_still_under_way_when_the_close_times_out_is_undone_or_done_whole(
    ssd_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    call: str,
    names: tuple[str, ...],
) -> None:
    """A close whose ``close_timeout`` passes while a call is in the SSD tier's worker thread
    (a slow disk) used to close the tier's directory under the thread: the append's rename
    landed, its fsync and clean-up failed, and the caller got a bare ``KeyError('tmp')``
    for a turn a reopen then served. Now the close cancels what is still under way and
    waits for it before closing the tiers: the call completes, or raises ClosedError and
    is undone, and a reopen serves exactly the acknowledged history."""

    def cache() -> TieredKVCache:
        return TieredKVCache([SSDTier(ssd_dir, 64 << 20)], close_timeout=0.05)

    async with cache() as first:
        await first.append("s", kv(2, 1), answer_tokens=1)
    closing = cache()
    await closing.open()
    outcome: list[BaseException | None] = []

    async def under_way() -> None:
        try:
            if call == "append":
                await closing.append("s", kv(2, 2), answer_tokens=1)
            else:
                assert torch.equal((await closing.load("s"))["kv"], kv(2, 1)["kv"])
            outcome.append(None)
        except BaseException as exc:  # (what the caller sees is what is tested)
            outcome.append(exc)

    with slow(monkeypatch, 0.5, *names), caplog.at_level("WARNING", logger="tieredkv.cache"):
        async with anyio.create_task_group() as tg:
            tg.start_soon(under_way)
            await anyio.sleep(0.1)  # in the slowed call
            await closing.aclose()
    [exc] = outcome
    if exc is not None:
        assert isinstance(exc, ClosedError), repr(exc)
        assert "closed while this call was under way" in str(exc)
    assert closing.stats().cancelled == 0  # (not cancelled by its caller)
    acknowledged = [kv(2, 1)] + ([kv(2, 2)] if call == "append" and exc is None else [])
    async with cache() as reopened:
        got = await reopened.load("s")
        assert torch.equal(got["kv"], torch.cat([t["kv"] for t in acknowledged]))
        assert problems(reopened) == []
    left = [
        p for p in ssd_dir.rglob("*") if p.is_file() and p.relative_to(ssd_dir).parts[0] == "tmp"
    ]
    assert left == []
    assert "still under way after close_timeout (0.05 s): cancelling them" in caplog.text
