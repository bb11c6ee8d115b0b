"""Prefetch on a hint: a conversation whose caller said when its next turn comes is brought
up from SSD by the idle predictive prefetch just before that turn, ahead of conversations
without a hint; a caller whose hints prove wrong loses that preference."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.hinting import Clock
from tieredkv import HostMemoryTier, RetentionHint, SSDTier, TieredKVCache
from tieredkv.policies import LRU, AdaptiveBidaw

KIB = 1024
HOST = 12 * KIB  # room for one conversation (4 KiB of KV and its header: an 8 KiB slot)


def seg(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randint(0, 256, (2, 2 * KIB), dtype=torch.uint8, generator=g)}


async def warm(cache: TieredKVCache, clock: Clock, users: int, rounds: int) -> None:
    """Round-robin traffic of ``users`` people (one 4 KiB conversation each, a turn every
    second overall), enough for the policy's tables."""
    for r in range(rounds):
        for u in range(users):
            clock.now += 1.0
            key = f"user{u}"
            if key in cache:
                await cache.load(key)
                await cache.drop(key)  # keep sizes even: one segment of history each
            await cache.append(key, seg(100 * r + u), answer_tokens=40)


async def test_a_hinted_conversation_comes_up_from_ssd_before_its_turn(ssd_dir: Path) -> None:
    clock = Clock()
    policy = AdaptiveBidaw(capacity=HOST, refresh_every=32, hint_lead=30.0)
    tiers = [HostMemoryTier(HOST), SSDTier(ssd_dir, 8 << 20, fsync=False)]
    async with TieredKVCache(tiers, eviction=[policy, LRU()], clock=clock) as cache:
        hinted, plain = seg(1), seg(2)
        # the agent's turn ends in a tool call its caller says returns in 120 s
        await cache.append(
            "agent", hinted, answer_tokens=30, hint=RetentionHint(next_turn_in=120.0)
        )
        told = cache.channel["agent"].next_turn
        assert told == clock.now + 120.0
        clock.now += 1.0
        await cache.append("person", plain, answer_tokens=30)  # the same answer, no hint
        await warm(cache, clock, users=6, rounds=8)  # both pushed down to SSD meanwhile
        assert cache.where("agent") == "ssd"
        assert cache.where("person") == "ssd"
        assert clock.now < told - 30.0
        # Long before the hinted turn, the hint gives the agent no preference.
        early = policy.foresee_at("agent", clock.now)
        assert early == policy.foresee_at("person", clock.now)
        # Idle, 20 s before the hinted turn: the agent's conversation comes up first.
        clock.now = told - 20.0
        assert policy.foresee_at("agent", clock.now) == policy.hint_trust() == 1.0
        assert await cache.prefetch_predicted(limit=1) == ["agent"]
        assert cache.where("agent") == "host"
        assert cache.where("person") == "ssd"
        # Its turn: a host hit, byte-exact; the hint was kept.
        clock.now = told + 1.0
        hits = cache.stats().hits
        got = await cache.load("agent")
        assert torch.equal(got["kv"], hinted["kv"])
        assert cache.stats().hits == hits + 1


async def test_a_conversation_brought_up_for_its_hint_stays_until_its_turn(
    ssd_dir: Path,
) -> None:
    """As above, but other users keep taking turns between the prefetch and the hinted
    turn, each needing room in host memory. The agent's conversation, brought up for its
    hint, is not their victim: it stays in host memory, and its turn is a hit. Before, the
    next user's turn evicted it again at once (its learned potential is low): every idle
    moment brought it back up, and its turn still found it on SSD."""
    clock = Clock()
    host = 24 * KIB  # room for three conversations
    policy = AdaptiveBidaw(capacity=host, refresh_every=32, hint_lead=30.0)
    tiers = [HostMemoryTier(host), SSDTier(ssd_dir, 8 << 20, fsync=False)]
    async with TieredKVCache(tiers, eviction=[policy, LRU()], clock=clock) as cache:
        hinted = seg(1)
        await cache.append(
            "agent", hinted, answer_tokens=30, hint=RetentionHint(next_turn_in=120.0)
        )
        told = cache.channel["agent"].next_turn
        assert told is not None
        await warm(cache, clock, users=6, rounds=8)
        assert cache.where("agent") == "ssd"
        clock.now = told - 25.0
        assert await cache.prefetch_predicted(limit=1) == ["agent"]
        agent_up = cache.stats().predicted
        assert policy.kept_for_hint(clock.now) == {"agent"}
        u = 0
        while clock.now < told - 1.0:  # a turn of another user every second, from SSD
            u = (u + 1) % 6
            clock.now += 1.0
            await cache.load(f"user{u}")
            await cache.drop(f"user{u}")  # (one 8 KiB segment each, as in warm)
            await cache.append(f"user{u}", seg(1000 + u), answer_tokens=40)
            assert cache.where("agent") == "host", clock.now
        assert cache.stats().predicted == agent_up  # never brought up again
        clock.now = told + 1.0
        hits = cache.stats().hits
        got = await cache.load("agent")
        assert torch.equal(got["kv"], hinted["kv"])
        assert cache.stats().hits == hits + 1
        assert policy.kept_for_hint(clock.now) == frozenset()  # (accessed: no longer)


async def test_wrong_hints_lose_their_preference(ssd_dir: Path) -> None:
    """A caller whose turns never come when it says: each late turn lowers the learned
    trust in hints, so a due hint no longer lifts its conversation above what the policy
    learned; a caller whose turns come on time keeps full trust."""
    clock = Clock()
    policy = AdaptiveBidaw(capacity=HOST, refresh_every=32)
    tiers = [HostMemoryTier(HOST), SSDTier(ssd_dir, 8 << 20, fsync=False)]
    async with TieredKVCache(tiers, eviction=[policy, LRU()], clock=clock) as cache:
        for i in range(4):
            clock.now += 1.0
            await cache.append(f"on-time{i}", seg(i), answer_tokens=30,
                               hint=RetentionHint(next_turn_in=40.0))  # fmt: skip
            clock.now += 38.0  # within its slack (5 s, or 10 s: a quarter of the gap)
            await cache.load(f"on-time{i}")
        assert policy.hint_trust() == 1.0
        for i in range(12):
            clock.now += 1.0
            await cache.append(f"liar{i}", seg(i), answer_tokens=30,
                               hint=RetentionHint(next_turn_in=5.0))  # fmt: skip
            clock.now += 60.0  # long after it said
            await cache.load(f"liar{i}")
        trust = policy.hint_trust()
        assert 0.39 < trust <= 0.4  # (4 kept + 4 trusted) / (16 judged + 4), slightly decayed
        clock.now += 1.0
        await cache.append("liar", seg(99), answer_tokens=30, hint=RetentionHint(next_turn_in=5))
        before = policy.foresee_at("liar", clock.now - 100.0)  # outside the lead: learned
        assert policy.foresee_at("liar", clock.now + 4.0) == max(before or 0.0, trust)
        # a hinted turn that never comes counts as not kept once its slack has run out
        clock.now += 20.0
        await cache.append("other", seg(98), answer_tokens=30)
        assert policy.hint_trust() < trust
