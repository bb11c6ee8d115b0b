"""TieredKVCache runs every registered eviction policy, byte-exact, within budget."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tieredkv import HostMemoryTier, SSDTier, TieredKVCache, UnknownPolicyError
from tieredkv.policies import BidawEviction, eviction_names, make_eviction
from tieredkv.policies.scheduling import Request

KIB = 1024


def seg(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randint(0, 256, (tokens, KIB), dtype=torch.uint8, generator=g)}


@pytest.mark.parametrize("name", eviction_names())
async def test_cache_serves_exact_history_under_every_policy(name: str, ssd_dir: Path) -> None:
    """A conversation workload through a small host tier: every load is exact, the host
    tier stays within budget, and the policy's victims really move down."""
    rng = random.Random(3)
    tiers = [HostMemoryTier(96 * KIB), SSDTier(ssd_dir, 8 << 20, fsync=False)]
    async with TieredKVCache(tiers, eviction=name) as cache:
        history: dict[str, list[dict[str, torch.Tensor]]] = {}
        for step in range(120):
            user = f"user{rng.randrange(12)}"
            cache.channel.hint_next_access(user, None)
            # the waiting queue, for queue-aware policies: the next few users to come
            cache.channel.publish_waiting(f"user{rng.randrange(12)}" for _ in range(3))
            if user in history:
                got = await cache.load(user)
                assert torch.equal(got["kv"], torch.cat([t["kv"] for t in history[user]]))
            new = seg(rng.randrange(1, 6), step)
            history.setdefault(user, []).append(new)
            await cache.append(user, new, answer_tokens=rng.randrange(5, 200))
            host = cache.stats().tiers[0]
            assert host.used <= host.capacity
        stats = cache.stats()
        assert stats.demotions > 0
        assert stats.promotions > 0
        assert stats.lost == 0
        assert 0 < stats.hits < stats.loads


def test_unknown_policy_name_lists_the_known_ones(ssd_dir: Path) -> None:
    with pytest.raises(UnknownPolicyError, match="known: belady, bidaw"):
        TieredKVCache([HostMemoryTier(KIB)], eviction="lru2")


async def test_scheduler_drives_prefetch_through_the_channel(ssd_dir: Path) -> None:
    """The Bidaw scheduler sees where each session's KV is through the cache's channel:
    a request whose KV is on SSD waits in the preparing queue until its load lands."""
    from tieredkv.policies import BidawScheduler

    tiers = [HostMemoryTier(32 * KIB), SSDTier(ssd_dir, 8 << 20)]
    async with TieredKVCache(tiers, eviction=make_eviction("lru")) as cache:
        for i in range(4):
            await cache.append(f"u{i}", seg(8, i), answer_tokens=1)
        on_ssd = [f"u{i}" for i in range(4) if cache.where(f"u{i}") == "ssd"]
        in_host = [f"u{i}" for i in range(4) if cache.where(f"u{i}") == "host"]
        assert on_ssd
        assert in_host
        sched = BidawScheduler(max_loads=1)
        for t, session in enumerate(on_ssd + in_host):
            sched.submit(
                Request(id=str(t), session=session, arrival=float(t)), float(t), cache.channel
            )
        # ready requests come first; the SSD one is loaded meanwhile
        loads = sched.start_loads(10.0)
        assert [r.session for r in loads] == on_ssd[:1]
        first = sched.pop_ready(10.0)
        assert first is not None
        assert first.session in in_host
        assert await cache.prefetch(on_ssd[0]) == "host"
        sched.load_finished(on_ssd[0], 11.0)
        order = []
        while (request := sched.pop_ready(12.0)) is not None:
            order.append(request.session)
        assert on_ssd[0] in order


async def test_bidaw_learns_the_think_gap_not_the_first_turn() -> None:
    """The cache tells Bidaw about an append before admitting it: a session's first turn is
    its first access (no reuse to record), and the gap before its second turn is the sample,
    measured in the bytes of the other sessions stored meanwhile."""
    policy = BidawEviction(capacity=1 << 20)
    async with TieredKVCache([HostMemoryTier(1 << 20)], eviction=policy) as cache:
        first = await cache.append("a", seg(8, 0), answer_tokens=3)
        assert policy.observed(policy.bucket_of(3)) == []  # no fabricated reuse at distance 0
        other = await cache.append("b", seg(8, 1), answer_tokens=50)  # another user meanwhile
        await cache.load("a")  # a's second turn reuses its history after b's bytes
        await cache.append("a", seg(8, 2), answer_tokens=3)
        assert policy.observed(policy.bucket_of(3)) == [other.nbytes]
        assert first.turns == 1


@pytest.mark.parametrize("name", eviction_names())
async def test_a_policy_object_is_used_even_while_empty(name: str, ssd_dir: Path) -> None:
    """An empty policy is falsy (it has ``__len__``): the cache once swapped it for LRU."""
    policy = make_eviction(name)
    assert len(policy) == 0
    tiers = [HostMemoryTier(1 << 20), SSDTier(ssd_dir, 16 << 20)]
    async with TieredKVCache(tiers, eviction=policy, token_dim=0) as cache:
        await cache.append("a", {"x": torch.zeros(4, 16)}, answer_tokens=1)
        assert len(policy) == 1
