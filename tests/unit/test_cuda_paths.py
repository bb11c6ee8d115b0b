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
async def test_arena_is_registered_once_in_chunks() -> None:
    async with HostMemoryTier(8 << 20, pin_chunk=2 << 20) as tier:
        stats = tier.stats()
        assert stats.pinned is True
        assert any("4 cudaHostRegister chunk(s)" in note for note in stats.notes)


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
