"""TieredKVCache.load_layerwise: a history streamed group by group, byte-exact, from the
SSD tier (read span by span), the host tier, and both (promoted on the way); damaged
files, I/O errors and cancellation at random points leave every part of the cache agreeing.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
import torch

from tests.faults import FaultInjector
from tests.invariants import problems
from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.backends.ssd import segment_file_name
from tieredkv.cache import LayerwiseLoad
from tieredkv.errors import (
    InvalidArgumentError,
    RestoreFailedError,
    SessionNotFoundError,
    TierIOError,
)

LAYERS = 4
GROUPS = [[f"layers.{i}.k", f"layers.{i}.v"] for i in range(LAYERS)]
TURNS = (37, 5, 61)  # tokens per turn: segments of 0.2-2 MiB, boundaries inside pages


def turn(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        f"layers.{i}.{t}": torch.randn(2, tokens, 640, generator=g)
        for i in range(LAYERS)
        for t in ("k", "v")
    }


def history(session: int) -> dict[str, torch.Tensor]:
    turns = [turn(n, 100 * session + i) for i, n in enumerate(TURNS)]
    return {name: torch.cat([t[name] for t in turns], dim=1) for name in turns[0]}


async def fill(cache: TieredKVCache, session: int) -> None:
    for i, n in enumerate(TURNS):
        await cache.append(f"s{session}", turn(n, 100 * session + i), answer_tokens=3)


def room(extra: int = 7) -> dict[str, torch.Tensor]:
    """Output tensors with room after the history (left untouched)."""
    tokens = sum(TURNS) + extra
    return {
        f"layers.{i}.{t}": torch.full((2, tokens, 640), -1.0)
        for i in range(LAYERS)
        for t in ("k", "v")
    }


async def stream_checked(cache: TieredKVCache, session: int) -> dict[str, torch.Tensor]:
    """Stream a session in; in a worker thread, check each group's bytes as soon as it is
    said to have landed (so a group signalled early would be caught)."""
    want = history(session)
    out = room()
    tokens = sum(TURNS)
    seen: list[int] = []

    def model() -> None:
        for g, names in enumerate(GROUPS):
            assert load.wait(g, timeout=30)
            for name in names:
                assert torch.equal(out[name][:, :tokens], want[name]), (g, name)
            seen.append(load.landed())

    async with cache.load_layerwise(f"s{session}", out, GROUPS) as load:
        assert load.tokens == tokens
        assert load.groups == LAYERS
        await anyio.to_thread.run_sync(model)
        await load.finished()
    assert seen[-1] == LAYERS
    for name, t in out.items():
        assert torch.equal(t[:, :tokens], want[name])
        assert bool((t[:, tokens:] == -1).all())  # the room is untouched
    return out


def ssd(directory: Path, **kw: object) -> SSDTier:
    return SSDTier(directory, 1 << 30, fsync=False, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk", [8 << 20, 64 << 10])
async def test_from_the_ssd_tier_alone(ssd_dir: Path, chunk: int) -> None:
    async with TieredKVCache([ssd(ssd_dir, chunk_size=chunk)], token_dim=1) as cache:
        await fill(cache, 1)
        before = cache.stats().tiers[0].bytes_read
        await stream_checked(cache, 1)
        stats = cache.stats()
        assert stats.loads == 1
        assert stats.misses == 0
        assert stats.hits == 1
        assert stats.tiers[0].bytes_read - before == cache.channel[("s1")].nbytes
        assert problems(cache) == []


async def test_with_a_secret(ssd_dir: Path) -> None:
    async with TieredKVCache([ssd(ssd_dir, secret=b"k" * 32)], token_dim=1) as cache:
        await fill(cache, 1)
        await stream_checked(cache, 1)
        assert problems(cache) == []


async def test_from_the_host_tier_and_promoted_from_the_ssd(ssd_dir: Path) -> None:
    # the host tier holds one session: s1 goes down to the SSD when s2 arrives
    one = sum(TURNS) * 8 * 2 * 640 * 4 + 3 * 8 * 4096 + 4096
    tiers = [HostMemoryTier(one + (64 << 10)), ssd(ssd_dir)]
    for mode in ("exclusive", "inclusive"):
        async with TieredKVCache(tiers, token_dim=1, mode=mode) as cache:
            await fill(cache, 1)
            await cache.flush()  # write-through done: s1 can be moved down
            await fill(cache, 2)
            await cache.flush()
            assert cache.where("s1") == "ssd"
            assert cache.where("s2") == "host"
            await stream_checked(cache, 2)  # from host memory
            assert cache.stats().hits == 1
            ssd_read = cache.stats().tiers[1].bytes_read
            await stream_checked(cache, 1)  # read once from the SSD, promoted on the way
            stats = cache.stats()
            assert cache.where("s1") == "host"
            assert cache.where("s2") == "ssd"
            assert stats.promotions == 1
            assert stats.misses == 1
            assert stats.tiers[1].bytes_read - ssd_read == cache.channel["s1"].nbytes
            assert torch.equal((await cache.load("s1"))["layers.3.v"], history(1)["layers.3.v"])
            await cache.flush()
            assert problems(cache) == []
            for s in ("s1", "s2"):
                await cache.drop(s)


async def test_groups_must_split_the_names_in_order(ssd_dir: Path) -> None:
    async with TieredKVCache([ssd(ssd_dir)], token_dim=1) as cache:
        await fill(cache, 1)
        for bad in ([GROUPS[1], GROUPS[0], *GROUPS[2:]], GROUPS[:-1], [*GROUPS, []]):
            with pytest.raises(InvalidArgumentError):
                async with cache.load_layerwise("s1", room(), bad):
                    pass
        with pytest.raises(SessionNotFoundError):
            async with cache.load_layerwise("nobody", room(), GROUPS):
                pass
        assert cache.stats().loads == 0
        assert problems(cache) == []


def damage(directory: Path, key: tuple[str, int], at: int) -> None:
    path = directory / "segments" / segment_file_name(key)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("where", ["header", "last layer"])
async def test_a_damaged_segment_is_a_miss_never_wrong_bytes(ssd_dir: Path, where: str) -> None:
    async with TieredKVCache([ssd(ssd_dir)], token_dim=1) as cache:
        await fill(cache, 1)
        size = os.path.getsize(ssd_dir / "segments" / segment_file_name(("s1", 2)))
        damage(ssd_dir, ("s1", 2), 30 if where == "header" else size - 8192)
        out = room()
        failed = []
        waiting: LayerwiseLoad | None = None

        def model() -> None:
            assert waiting is not None
            try:
                for g in range(LAYERS):
                    waiting.wait(g)
            except RestoreFailedError:
                failed.append(True)

        async def attempt() -> None:
            async with cache.load_layerwise("s1", out, GROUPS) as load:
                nonlocal waiting
                waiting = load
                await anyio.to_thread.run_sync(model)
                await load.finished()

        with pytest.raises(SessionNotFoundError):
            await attempt()
        assert failed == ([True] if where == "header" else [])  # a body error: at the end
        assert not cache.contains("s1")
        stats = cache.stats()
        assert stats.corrupt == 1
        assert stats.misses == 1
        assert stats.loads == 0
        assert problems(cache) == []


async def test_an_io_error_leaves_the_history_where_it_was(ssd_dir: Path) -> None:
    tiers = [HostMemoryTier(16 << 20), ssd(ssd_dir)]
    async with TieredKVCache(tiers, token_dim=1) as cache:
        await fill(cache, 1)
        await fill(cache, 2)
        await fill(cache, 3)
        await fill(cache, 4)  # 4 x 4 MiB: the first went down to the SSD
        assert cache.where("s1") == "ssd"
        with FaultInjector() as faults:
            faults.fail_nth("preadv", 3)
            with pytest.raises(TierIOError):
                async with cache.load_layerwise("s1", room(), GROUPS) as load:
                    # the wait is left to the exit, which raises what went wrong
                    await anyio.to_thread.run_sync(lambda: load.wait(0, timeout=30))
        assert cache.where("s1") == "ssd"
        assert cache.stats().errors >= 1
        assert problems(cache) == []
        await stream_checked(cache, 1)
        assert problems(cache) == []


async def _streamed(cache: TieredKVCache, session: str, gate: threading.Event) -> None:
    out = room()
    async with cache.load_layerwise(session, out, GROUPS) as load:

        def model() -> None:
            for g in range(LAYERS):
                load.wait(g)
            gate.wait(0.05)

        await anyio.to_thread.run_sync(model)  # shielded: anyio cancels after it
        await anyio.lowlevel.checkpoint()
        await load.finished()


@pytest.mark.parametrize("kind", ["task.cancel", "asyncio.timeout", "anyio"])
async def test_cancelled_at_random_points_leaves_no_trace(ssd_dir: Path, kind: str) -> None:
    rng = random.Random(kind)
    tiers = [HostMemoryTier(10 << 20), ssd(ssd_dir)]
    async with TieredKVCache(tiers, token_dim=1) as cache:
        for s in range(1, 5):
            await fill(cache, s)
        gate = threading.Event()
        cancelled = 0
        for step in range(12):
            session = f"s{rng.randrange(1, 5)}"
            delay = rng.uniform(0, 0.03)
            if kind == "task.cancel":
                task = asyncio.get_running_loop().create_task(_streamed(cache, session, gate))
                await asyncio.sleep(delay)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    cancelled += 1
            elif kind == "asyncio.timeout":
                try:
                    async with asyncio.timeout(delay):
                        await _streamed(cache, session, gate)
                except TimeoutError:
                    cancelled += 1
            else:
                with anyio.move_on_after(delay) as scope:
                    await _streamed(cache, session, gate)
                cancelled += scope.cancelled_caught
            assert problems(cache) == [], step
        assert cancelled >= 3
        # each, wherever it landed (a deadline may pass before the load takes its lock)
        assert cache.stats().cancelled == cancelled
        for s in range(1, 5):
            await stream_checked(cache, s)
        assert problems(cache) == []
