"""``TieredKVCache.addressable``: whether a session is served from a tier whose bytes a load
copies out directly (what the transformers adapter asks before streaming a history)."""

from __future__ import annotations

from pathlib import Path

import torch

from tieredkv import HostMemoryTier, MmapTier, SSDTier, TieredKVCache


def _turn(tokens: int) -> dict[str, torch.Tensor]:
    return {"k": torch.arange(tokens * 64, dtype=torch.float32).view(tokens, 64)}


async def test_a_history_is_addressable_in_memory_and_mmap_not_on_the_ssd(
    ssd_dir: Path, tmp_path: Path
) -> None:
    host = HostMemoryTier(64 << 10)
    tiers = [host, MmapTier(tmp_path / "mmap.bin", 64 << 10), SSDTier(ssd_dir, 1 << 24)]
    async with TieredKVCache(tiers, token_dim=0) as cache:
        assert not cache.addressable("a")  # stored nowhere
        await cache.append("a", _turn(100), answer_tokens=1)  # about 25 KiB
        assert cache.where("a") == "host"
        assert cache.addressable("a")
        for session in ("b", "c", "d", "e"):  # push "a" down past the mmap tier
            await cache.append(session, _turn(100), answer_tokens=1)
        places = {s: cache.where(s) for s in "abcde"}
        assert set(places.values()) == {"host", "mmap", "ssd"}, places
        for session, where in places.items():
            assert cache.addressable(session) == (where != "ssd"), (session, where)
        await cache.drop("a")
        assert not cache.addressable("a")
