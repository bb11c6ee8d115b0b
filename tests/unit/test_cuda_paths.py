"""CUDA code paths: the pinned arena and device copies. Skipped without a CUDA device,
except the checks of what happens when CUDA is absent."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tieredkv import HostMemoryTier, SSDTier, Tier, TieredKVCache

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_pin_true_without_cuda_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(ValueError, match="pin=True needs CUDA"):
        HostMemoryTier(1 << 20, pin=True)


async def test_without_cuda_the_arena_is_pageable_and_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    async with HostMemoryTier(1 << 20) as tier:
        stats = tier.stats()
        assert stats.pinned is False
        assert any("pageable" in note for note in stats.notes)


@cuda
async def test_arena_is_registered_once_whole() -> None:
    tier = HostMemoryTier(8 << 20)
    async with tier:
        stats = tier.stats()
        assert stats.pinned is True
        assert any(f"one cudaHostRegister of {8 << 20:,} bytes" in n for n in stats.notes)
    assert tier.pinned is False  # unregistered at close


@cuda
async def test_device_copies_work_anywhere_in_a_full_pinned_arena() -> None:
    """Entries fill the arena end to end, so some straddle every MiB boundary (with the
    arena registered in pieces, CUDA refused such copies: cudaErrorInvalidValue)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    turns = {
        f"s{i}": torch.randn(2, 4, 300 + 37 * i, 32, device="cuda", generator=g) for i in range(12)
    }
    async with TieredKVCache([HostMemoryTier(8 << 20)], token_dim=2) as cache:
        for session, kv in turns.items():
            await cache.append(session, {"kv": kv}, answer_tokens=1)
        assert cache.stats().tiers[0].used > 5 << 20
        for session, kv in turns.items():
            out = {"kv": torch.empty_like(kv)}
            assert await cache.load_into(session, out) == kv.shape[2]
            assert torch.equal(out["kv"], kv)


@cuda
async def test_device_tensors_round_trip_through_pinned_memory_and_ssd(ssd_dir: Path) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    turns = [torch.randn(2, 8, n, 64, device="cuda", generator=g).half() for n in (17, 5, 9)]
    tiers: list[Tier] = [HostMemoryTier(64 << 10, pin=True), SSDTier(ssd_dir, 16 << 20)]
    async with TieredKVCache(tiers, token_dim=2) as cache:
        for i, kv in enumerate(turns):
            await cache.append("gpu", {"kv": kv}, answer_tokens=i)
        for i in range(4):  # push "gpu" down to the SSD
            await cache.append(f"other{i}", {"kv": turns[0]}, answer_tokens=1)
        out = {"kv": torch.empty(2, 8, 64, 64, device="cuda", dtype=torch.float16)}
        assert await cache.load_into("gpu", out) == 31
        assert torch.equal(out["kv"][:, :, :31], torch.cat(turns, dim=2))
        host = await cache.load("gpu")
        assert host["kv"].device.type == "cpu"
        assert torch.equal(host["kv"].cuda(), torch.cat(turns, dim=2))
