"""A cache with a tier shared between replicas refuses forks with a message that says what
to do, and stores nothing (the shared tier's fencing and manifests know no references)."""

from __future__ import annotations

import pytest
import torch

from tests.redis_server import RedisServer, new_prefix, own_redis_server
from tieredkv import HostMemoryTier, TieredKVCache
from tieredkv.backends.redis import RedisTier

__all__ = ["own_redis_server"]  # fixtures used below


async def test_a_fork_is_refused_with_a_shared_tier(own_redis_server: RedisServer) -> None:
    shared = RedisTier(own_redis_server.url, 64 << 20, prefix=new_prefix(), timeout=2.0)
    tiers = [HostMemoryTier(8 << 20), shared]
    async with TieredKVCache(tiers, mode="inclusive") as cache:
        kv = {"kv": torch.arange(8 * 256, dtype=torch.float32).reshape(8, 256)}
        await cache.append("a", kv, answer_tokens=1)
        with pytest.raises(ValueError, match="shared between replicas"):
            await cache.append("b", kv, answer_tokens=1, parent="a")
        assert not cache.contains("b")
        await cache.flush()
        assert torch.equal((await cache.load("a"))["kv"], kv["kv"])
