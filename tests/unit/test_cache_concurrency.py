"""Cancellation at any await, and concurrent operations on the same and different sessions."""

from __future__ import annotations

import functools
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest
import torch

from tests.cancellation import CANCELS, cancellable
from tests.invariants import problems
from tests.unit.test_forest_faults import PausingSSD
from tieredkv import HostMemoryTier, SessionNotFoundError, SSDTier, Tier, TieredKVCache

KIB = 1024
Segment = dict[str, torch.Tensor]


def seg(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # 48 KiB per token row: big enough that copies go through worker threads
    return {"kv": torch.randint(0, 256, (tokens, 48 * KIB), dtype=torch.uint8, generator=g)}


def accounted(cache: TieredKVCache) -> list[tuple[int, int]]:
    """(used, bytes of the complete copies the channel knows) for every tier."""
    out = []
    for tier in cache.stats().tiers:
        held = sum(m.nbytes for m in cache.channel.values() if tier.name in m.copies)
        out.append((tier.used, held))
    return out


def describe(cache: TieredKVCache) -> str:
    """Per tier: used bytes, and each session's copy as the channel reports it."""
    tiers = [f"{t.name}: used {t.used} in {t.segments} segments" for t in cache.stats().tiers]
    sessions = [
        f"  {m.session}: {m.nbytes} B, {m.turns} turns, copies {m.copies}"
        for m in cache.channel.values()
    ]
    return "\n".join(tiers + sessions)


async def cancel_after(delay: int | float, op: Callable[[], Awaitable[object]]) -> bool:
    """Run ``op``, cancelling it after ``delay`` (int: scheduler passes; float: seconds).

    Returns True if ``op`` completed.
    """
    done = False
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            nonlocal done
            await op()
            done = True

        async def cancel() -> None:
            if isinstance(delay, int):
                for _ in range(delay):
                    await anyio.lowlevel.checkpoint()
            else:
                await anyio.sleep(delay)
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(cancel)
    return done


async def append_while_loading(cache: TieredKVCache, key: str, new: Segment, stored: bool) -> None:
    """Append, with a load of the same session holding its lock first (if it is stored)."""
    async with anyio.create_task_group() as both:
        if stored:
            both.start_soon(cache.load, key)
        both.start_soon(functools.partial(cache.append, key, new, answer_tokens=1))


@pytest.mark.parametrize("mode", ["exclusive", "inclusive"])
async def test_cancelling_append_or_load_at_any_await_leaks_nothing(
    ssd_dir: Path, mode: str
) -> None:
    """Cancel at many points: the entry is either whole or absent, and no tier leaks."""
    tiers = [HostMemoryTier(1200 * KIB), SSDTier(ssd_dir, 64 << 20, fsync=False)]
    async with TieredKVCache(tiers, mode=mode) as cache:  # type: ignore[arg-type]
        model: dict[str, list[dict[str, torch.Tensor]]] = {}
        delays: list[int | float] = [*range(30), *(i * 0.0005 for i in range(30))]
        outcomes = {True: 0, False: 0}
        for step, delay in enumerate(delays):
            key = f"s{step % 5}"
            new = seg(6 + step % 3, 1000 + step)  # ~300-400 KiB: copies go to threads
            if step % 2 == 0 or key not in model:
                before = cache.channel.get(key)
                turns_before = before.turns if before and before.tier else 0
                op = functools.partial(append_while_loading, cache, key, new, key in model)
                finished = await cancel_after(delay, op)
                after = cache.channel.get(key)
                grew = (
                    after is not None and after.tier is not None and after.turns == turns_before + 1
                )
                if finished:
                    assert grew
                if grew:
                    if turns_before == 0:
                        model[key] = []
                    model[key].append(new)
                else:  # cancelled before it took effect: untouched
                    assert (after.turns if after and after.tier else 0) == turns_before
            else:
                finished = await cancel_after(delay, functools.partial(cache.load, key))
            outcomes[finished] += 1
            await cache.flush()
            for tier_used, held in accounted(cache):
                assert tier_used == held, (step, delay, mode, describe(cache))
            for name, turns in model.items():
                assert cache.contains(name)
                got = await cache.load(name)
                assert torch.equal(got["kv"], torch.cat([t["kv"] for t in turns]))
        assert outcomes[False] >= 10  # really cancelled mid-way, many times
        assert outcomes[True] >= 5


async def test_concurrent_operations_keep_per_session_order(ssd_dir: Path) -> None:
    """Many tasks append, load and drop at once; each session's history keeps call order."""
    tiers: list[Tier] = [HostMemoryTier(600 * KIB), SSDTier(ssd_dir, 64 << 20, fsync=False)]
    rng = random.Random(7)
    async with TieredKVCache(tiers) as cache:
        expected: dict[str, list[dict[str, torch.Tensor]]] = {f"u{i}": [] for i in range(6)}
        loads_ok = 0

        async def append(session: str, payload: dict[str, torch.Tensor]) -> None:
            await cache.append(session, payload, answer_tokens=1)

        async def load(session: str, prefix: int) -> None:
            nonlocal loads_ok
            got = await cache.load(session)
            # everything started before this load is in it, in order
            assert torch.equal(got["kv"], torch.cat([t["kv"] for t in expected[session][:prefix]]))
            loads_ok += 1

        async with anyio.create_task_group() as tg:
            for step in range(120):
                session = f"u{rng.randrange(6)}"
                if rng.random() < 0.7 or not expected[session]:
                    payload = seg(rng.randrange(1, 4), step)
                    expected[session].append(payload)
                    tg.start_soon(append, session, payload)  # started in this order
                else:
                    tg.start_soon(load, session, len(expected[session]))
                if step % 10 == 0:
                    await anyio.lowlevel.checkpoint()
        assert loads_ok > 10
        for session, turns in expected.items():
            got = await cache.load(session)
            assert torch.equal(got["kv"], torch.cat([t["kv"] for t in turns]))
        # drops racing with appends on the same session: the session ends up either dropped
        # with nothing, or holding exactly the appends that came after the drop
        async with anyio.create_task_group() as tg:
            tg.start_soon(append, "u0", seg(1, 1))
            tg.start_soon(cache.drop, "u0")
            tg.start_soon(append, "u0", seg(2, 2))
        got = await cache.load("u0")
        assert torch.equal(got["kv"], seg(2, 2)["kv"])
        for tier_used, held in accounted(cache):
            assert tier_used == held


async def test_load_racing_drop_is_a_clean_miss(ssd_dir: Path) -> None:
    async with TieredKVCache([HostMemoryTier(600 * KIB), SSDTier(ssd_dir, 8 << 20)]) as cache:
        await cache.append("a", seg(2, 1), answer_tokens=1)
        results: list[str] = []

        async def load() -> None:
            try:
                await cache.load("a")
                results.append("loaded")
            except SessionNotFoundError:
                results.append("missing")

        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.drop, "a")
            tg.start_soon(load)
        assert results == ["missing"]
        assert [t.used for t in cache.stats().tiers] == [0, 0]


@pytest.mark.parametrize("tiers", ["ssd", "host+ssd"])
async def test_a_new_conversation_under_a_key_being_dropped_waits_for_the_deletes(
    ssd_dir: Path, tiers: str
) -> None:
    """A conversation is dropped; while its files are still being deleted, a new one is
    stored under the same key. Its turn waits for those deletes, then is stored and served
    byte for byte. (Its segments' keys are the dropped one's: it used to find them still
    held, and the append, or in host+SSD the background copy into SSD, failed with a
    ``ValueError``, the campaign's seed 2436.)"""
    ssd = PausingSSD(ssd_dir, ("a", 0), op="delete")  # (its file's delete waits)
    layout: list[Tier] = [ssd] if tiers == "ssd" else [HostMemoryTier(8 << 20), ssd]
    async with TieredKVCache(layout, mode="inclusive") as cache:
        await cache.append("a", seg(2, 1), answer_tokens=1)
        await cache.flush()
        order: list[str] = []

        async def drop() -> None:
            await cache.drop("a")
            order.append("dropped")

        async def append() -> None:
            await cache.append("a", seg(3, 2), answer_tokens=1)
            order.append("appended")

        async with anyio.create_task_group() as tg:
            tg.start_soon(drop)
            with anyio.fail_after(10):
                await ssd.reached.wait()
            tg.start_soon(append)
            try:
                await anyio.sleep(0.1)
                assert order == []  # (the new turn waits)
            finally:
                ssd.go.set()
        assert order == ["dropped", "appended"]
        await cache.flush()
        got = await cache.load("a")
        assert torch.equal(got["kv"], seg(3, 2)["kv"])
        assert cache.stats().tiers[-1].segments == 1
        assert cache.stats().errors == 0


@pytest.mark.parametrize("kind", CANCELS)
async def test_an_append_cancelled_while_it_waits_for_a_drops_deletes_leaves_no_trace(
    ssd_dir: Path, kind: str
) -> None:
    """A new conversation's append under a key whose drop is still deleting its file is
    cancelled (each way users cancel) while it waits for those deletes: nothing of it is
    stored, the drop completes, and the key takes a new conversation afterwards, served
    byte for byte."""
    ssd = PausingSSD(ssd_dir, ("a", 0), op="delete")  # (its file's delete waits)
    async with TieredKVCache([HostMemoryTier(8 << 20), ssd], mode="inclusive") as cache:
        await cache.append("a", seg(2, 1), answer_tokens=1)
        await cache.flush()
        outcome: list[bool] = []

        async def cancelled_append() -> None:
            done, _ = await cancellable(
                kind, 0.1, lambda: cache.append("a", seg(3, 2), answer_tokens=1)
            )
            outcome.append(done)

        async with anyio.create_task_group() as tg:
            tg.start_soon(cache.drop, "a")
            try:
                with anyio.fail_after(10):
                    await ssd.reached.wait()
                await cancelled_append()
            finally:
                ssd.go.set()
        assert outcome == [False]  # (it was still waiting when cancelled)
        assert not cache.contains("a")
        with pytest.raises(SessionNotFoundError):
            await cache.load("a")
        assert [(t.used, t.segments) for t in cache.stats().tiers] == [(0, 0), (0, 0)]
        assert sorted(p.name for p in ssd_dir.rglob("*.seg")) == []
        await cache.append("a", seg(1, 3), answer_tokens=1)
        await cache.flush()
        got = await cache.load("a")
        assert torch.equal(got["kv"], seg(1, 3)["kv"])
        assert cache.stats().errors == 0
        assert problems(cache) == []


async def test_a_second_drop_of_a_conversation_dropped_meanwhile_finds_it_gone(
    ssd_dir: Path,
) -> None:
    """Two drops of one conversation at once, and a new conversation stored under its key
    once the first drop's deletes are done: the second drop finds the conversation gone
    (it used to go on with the dropped one: a second drop counted, and with a shared tier
    the key discarded there again, whatever was stored under it meanwhile)."""
    ssd = PausingSSD(ssd_dir, ("a", 0), op="delete")  # (its file's delete waits)
    async with TieredKVCache([ssd]) as cache:
        await cache.append("a", seg(2, 1), answer_tokens=1)
        results: list[str] = []

        async def drop() -> None:
            try:
                await cache.drop("a")
                results.append("dropped")
            except SessionNotFoundError:
                results.append("missing")

        async with anyio.create_task_group() as tg:
            tg.start_soon(drop)
            tg.start_soon(drop)  # (it finds the conversation, and waits for its lock)
            try:
                with anyio.fail_after(10):
                    await ssd.reached.wait()
                tg.start_soon(functools.partial(cache.append, "a", seg(3, 2), answer_tokens=1))
                await anyio.sleep(0.1)
            finally:
                ssd.go.set()
        assert sorted(results) == ["dropped", "missing"]
        assert torch.equal((await cache.load("a"))["kv"], seg(3, 2)["kv"])
        assert cache.stats().drops == 1
        assert problems(cache) == []
