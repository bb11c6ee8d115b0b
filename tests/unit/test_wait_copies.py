"""``TieredKVCache.wait_copies``: waits for the background write-throughs under way when it
is called, not for those that start while it waits.

The copies run on a real SSD tier whose writes of a conversation wait for a gate the test
opens (a disk busy with someone else's writes, at the moment the test chooses).
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.backends.base import SegmentKey
from tieredkv.errors import ClosedError


class GatedSSD(SSDTier):
    """An SSD tier whose writes of a conversation in ``gates`` wait until its gate is set."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, 64 << 20, fsync=False)
        self.gates: dict[str, anyio.Event] = {}

    async def write(self, key: SegmentKey, data: memoryview) -> None:
        gate = self.gates.get(key[0])
        if gate is not None:
            await gate.wait()
        await super().write(key, data)


def turn(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"k": torch.randn(16, 64, generator=g), "v": torch.randn(16, 64, generator=g)}


async def waited(cache: TieredKVCache, seconds: float) -> bool:
    """Whether ``wait_copies`` returned within ``seconds``."""
    with anyio.move_on_after(seconds):
        await cache.wait_copies()
        return True
    return False


async def test_it_waits_for_the_copies_under_way_and_not_for_later_ones(tmp_path: Path) -> None:
    ssd = GatedSSD(tmp_path)
    ssd.gates = {"a": anyio.Event(), "b": anyio.Event()}
    async with TieredKVCache([HostMemoryTier(8 << 20), ssd], mode="inclusive") as cache:
        await cache.append("a", turn(1), answer_tokens=4)
        assert not await waited(cache, 0.05)  # a's copy waits at its gate
        assert not ssd.contains(("a", 0))

        results: list[bool] = []

        async def waiter() -> None:
            await cache.wait_copies()
            results.append(True)

        with anyio.fail_after(5):  # (a wait for b's copy too would not end: b's gate is shut)
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.sleep(0.05)
                await cache.append("b", turn(2), answer_tokens=4)  # its copy starts meanwhile
                await anyio.sleep(0.05)
                assert results == []  # a's copy is still under way
                ssd.gates["a"].set()
        # the waiter returned with a's copy done, though b's still waits at its gate
        assert results == [True]
        assert ssd.contains(("a", 0))
        assert not ssd.contains(("b", 0))
        assert not await waited(cache, 0.05)  # b's copy is under way now
        ssd.gates["b"].set()
        assert await waited(cache, 5.0)
        assert await waited(cache, 0.01)  # nothing under way: it returns at once
        # both copies reached the SSD tier, byte for byte
        host = cache.tiers[0]
        for name in ("a", "b"):
            key = (name, 0)
            here, there = bytearray(host.length(key)), bytearray(ssd.length(key))
            await host.read([key], [memoryview(here)])
            await ssd.read([key], [memoryview(there)])
            assert here == there
        assert cache.stats().errors == 0
        for name, seed in (("a", 1), ("b", 2)):
            loaded = await cache.load(name)
            for k, v in turn(seed).items():
                assert torch.equal(loaded[k], v)


async def test_a_closed_cache_refuses_it(tmp_path: Path) -> None:
    cache = TieredKVCache([HostMemoryTier(8 << 20), SSDTier(tmp_path, 64 << 20)])
    async with cache:
        await cache.append("a", turn(1), answer_tokens=4)
    with pytest.raises(ClosedError):
        await cache.wait_copies()
