"""A load that finds a copy damaged and serves the whole one below it (``turns.load``'s
retry), under every way it can be cut short: native asyncio cancellation (``task.cancel``,
``asyncio.timeout``, ``wait_for``), an anyio scope, and an I/O error at each os call it
makes. Afterwards the cache, the tiers, the channel and the files agree, and the history
is served byte for byte by the next load: the damage cost one copy, an interruption
nothing more."""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

from tests.faults import FaultInjector
from tieredkv import SSDTier, TieredKVCache
from tieredkv.errors import SessionNotFoundError, TierIOError

from ..invariants import problems
from .test_cache import _flip_body, assert_same, kv


def _tiers(directory: Path) -> list[SSDTier]:
    """SSD ``a`` over SSD ``b`` (inclusive: each holds all of ``s0``)."""
    return [
        SSDTier(directory / "a", 4 << 20, name="a"),
        SSDTier(directory / "b", 4 << 20, name="b"),
    ]


async def _damaged(directory: Path) -> None:
    """``s0`` (and a bystander ``s1``) stored whole in both tiers, ``s0``'s copy in ``a``
    then damaged behind the cache's back."""
    async with TieredKVCache(_tiers(directory), mode="inclusive") as cache:
        for i in range(2):
            await cache.append(f"s{i}", kv(8, i), answer_tokens=1)
        await cache.flush()
    _flip_body(directory / "a", "s0")


async def _settled(cache: TieredKVCache) -> None:
    """The cache agrees with its tiers and channel, and serves both histories whole."""
    await cache.flush()
    assert problems(cache) == []
    assert_same(await cache.load("s0"), kv(8, 0))
    assert_same(await cache.load("s1"), kv(8, 1))
    assert problems(cache) == []


async def _reopened(directory: Path) -> None:
    """A restart over the same files finds the same: both histories, whole."""
    async with TieredKVCache(_tiers(directory), mode="inclusive") as cache:
        await _settled(cache)


async def test_a_cancelled_load_of_a_damaged_copy_loses_nothing(tmp_path: Path) -> None:
    """Cancelled after 0, 1, 2, ... event-loop steps, by each kind of cancellation: the load
    is served or cancelled, and nothing else changes."""

    async def by_task_cancel(cache: TieredKVCache, steps: int) -> None:
        task = asyncio.ensure_future(cache.load("s0"))
        for _ in range(steps):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            assert_same(await task, kv(8, 0))

    async def by_timeout(cache: TieredKVCache, steps: int) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(steps * 0.0005):
                assert_same(await cache.load("s0"), kv(8, 0))

    async def by_wait_for(cache: TieredKVCache, steps: int) -> None:
        with contextlib.suppress(TimeoutError):
            assert_same(await asyncio.wait_for(cache.load("s0"), steps * 0.0005), kv(8, 0))

    async def by_anyio_scope(cache: TieredKVCache, steps: int) -> None:
        with anyio.move_on_after(steps * 0.0005):
            assert_same(await cache.load("s0"), kv(8, 0))

    kinds: dict[str, Callable[[TieredKVCache, int], Awaitable[None]]] = {
        "task.cancel": by_task_cancel,
        "asyncio.timeout": by_timeout,
        "wait_for": by_wait_for,
        "anyio": by_anyio_scope,
    }
    for name, cut in kinds.items():
        for steps in range(0, 24, 3):
            directory = tmp_path / f"{name}-{steps}"
            await _damaged(directory)
            async with TieredKVCache(_tiers(directory), mode="inclusive") as cache:
                await cut(cache, steps)
                assert problems(cache) == [], (name, steps)
                await _settled(cache)
            await _reopened(directory)


async def _count(directory: Path) -> Counter[str]:
    """The os calls of one load that meets the damage (and serves from below)."""
    await _damaged(directory)
    with FaultInjector() as faults:
        async with TieredKVCache(_tiers(directory), mode="inclusive") as cache:
            before = Counter(faults.calls)
            assert_same(await cache.load("s0"), kv(8, 0))
            calls = Counter(faults.calls)
    calls.subtract(before)
    return +calls


async def test_an_io_error_at_each_os_call_of_a_load_of_a_damaged_copy_loses_nothing(
    tmp_path: Path,
) -> None:
    """EIO at the 1st, 2nd, ... call of every os call site the load makes: the load is
    served whole, or raises ``TierIOError`` (never a miss: the whole copy below stays
    readable), and the next load, once the error is gone, serves it."""
    counts = await _count(tmp_path / "count")
    assert counts, "the load made no os call"
    tried = 0
    for site, n in sorted(counts.items()):
        for k in range(1, n + 1):
            directory = tmp_path / f"{site}-{k}"
            await _damaged(directory)
            with FaultInjector() as faults:
                async with TieredKVCache(_tiers(directory), mode="inclusive") as cache:
                    faults.fail_nth(site, faults.calls[site] + k, errno.EIO)
                    try:
                        got = await cache.load("s0")
                    except TierIOError:
                        pass
                    except SessionNotFoundError as exc:  # pragma: no cover - the defect
                        raise AssertionError(f"{site} #{k}: a miss, {exc}") from exc
                    else:
                        assert isinstance(got, dict)
                        assert_same(got, kv(8, 0))
                    with faults.paused():
                        assert problems(cache) == [], (site, k)
                        await _settled(cache)
            await _reopened(directory)
            tried += 1
    assert tried == sum(counts.values())
