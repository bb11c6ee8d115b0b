"""Retention hints in the live cache: pins hold a conversation in its tier under every
policy, within the bound on pinned bytes; advice reaches the metadata and the policy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.hinting import KIB, Clock, seg
from tieredkv import (
    HostMemoryTier,
    PinLimitError,
    RetentionHint,
    SessionNotFoundError,
    SSDTier,
    TieredKVCache,
)
from tieredkv.policies import AdaptiveBidaw, eviction_names, make_eviction


@pytest.mark.parametrize("name", eviction_names())
async def test_a_pinned_conversation_stays_in_host_memory_until_its_ttl(
    name: str, ssd_dir: Path
) -> None:
    clock = Clock()
    tiers = [HostMemoryTier(32 * KIB), SSDTier(ssd_dir, 8 << 20, fsync=False)]
    policy = make_eviction(name)
    async with TieredKVCache(tiers, eviction=policy, clock=clock) as cache:
        pinned = seg(4, 0)
        await cache.append("keep", pinned, answer_tokens=400, hint=RetentionHint(pin=True, ttl=50))
        assert cache.channel["keep"].pinned_until == 50.0
        # Traffic that would evict it under any policy: newer, smaller, hotter users.
        for step in range(40):
            clock.now = 1.0 + step
            user = f"user{step % 5}"
            if user in cache:
                await cache.load(user)
            await cache.append(user, seg(2, step + 1), answer_tokens=5)
            assert cache.where("keep") == "host", f"evicted at step {step} under {name}"
        got = await cache.load("keep")
        assert torch.equal(got["kv"], pinned["kv"])
        # Past the TTL the pin no longer holds: the policy may choose it again.
        assert cache.where("keep") == "host"
        everything = policy.resident_bytes()
        assert "keep" not in (policy.victims(everything, 49.0, cache.channel) or [])
        assert "keep" in (policy.victims(everything, 50.0, cache.channel) or [])


async def test_release_and_the_bound_on_pinned_bytes(ssd_dir: Path) -> None:
    tiers = [HostMemoryTier(64 * KIB), SSDTier(ssd_dir, 8 << 20, fsync=False)]
    async with TieredKVCache(tiers, max_pinned_bytes=10 * KIB) as cache:
        await cache.append("a", seg(6, 0), answer_tokens=5)
        await cache.append("b", seg(6, 1), answer_tokens=5)
        meta = cache.hint("a", RetentionHint(pin=True))
        assert meta.pinned_until == math.inf
        assert dict(cache.channel.pins) == {"a": math.inf}
        with pytest.raises(PinLimitError, match="past the bound of 10,240"):
            cache.hint("b", RetentionHint(pin=True))
        assert cache.channel["b"].pinned_until is None  # nothing changed
        cache.hint("a", RetentionHint(pin=False))
        assert dict(cache.channel.pins) == {}
        cache.hint("b", RetentionHint(pin=True))  # room now
        # b grows past the bound while pinned: it loses its pin
        await cache.append("b", seg(6, 2), answer_tokens=5)
        assert cache.channel["b"].pinned_until is None
        with pytest.raises(SessionNotFoundError):
            cache.hint("nobody", RetentionHint(priority=1))
        with pytest.raises(ValueError, match="ttl is the lifetime of a pin"):
            RetentionHint(ttl=5)


async def test_advice_reaches_the_metadata_and_the_policy(ssd_dir: Path) -> None:
    clock = Clock()
    policy = AdaptiveBidaw()
    tiers = [HostMemoryTier(64 * KIB), SSDTier(ssd_dir, 8 << 20, fsync=False)]
    async with TieredKVCache(tiers, eviction=policy, clock=clock) as cache:
        clock.now = 10.0
        meta = await cache.append(
            "agent", seg(2, 0), answer_tokens=40, hint=RetentionHint(tool_call=True)
        )
        assert meta.tool_call
        assert meta.next_turn is None
        assert policy.kind_of(policy._seen["agent"].bucket) == "tool"
        meta = cache.hint("agent", RetentionHint(next_turn_in=300.0, priority=2))
        assert meta.next_turn == 310.0
        assert meta.priority == 2
        assert policy.kind_of(policy._seen["agent"].bucket) == "hint"
        clock.now = 20.0
        await cache.load("agent")  # the access consumes the hint
        assert cache.channel["agent"].next_turn is None
        assert cache.channel["agent"].tool_call  # a load keeps what the answer was
        assert cache.channel["agent"].priority == 2


@pytest.mark.parametrize("name", ["lru", "bidaw", "belady"])
async def test_when_every_resident_is_pinned_new_turns_go_below(name: str, ssd_dir: Path) -> None:
    tiers = [HostMemoryTier(16 * KIB), SSDTier(ssd_dir, 8 << 20, fsync=False)]
    async with TieredKVCache(tiers, eviction=name, max_pinned_bytes=1 << 20) as cache:
        a, b, c = seg(6, 0), seg(6, 1), seg(6, 2)
        await cache.append("a", a, answer_tokens=5, hint=RetentionHint(pin=True))
        await cache.append("b", b, answer_tokens=5, hint=RetentionHint(pin=True))
        await cache.append("c", c, answer_tokens=5)  # no room, nothing may leave
        assert (cache.where("a"), cache.where("b"), cache.where("c")) == ("host", "host", "ssd")
        # a pinned conversation that outgrows what its tier can give it moves down whole
        more = seg(6, 3)
        await cache.append("a", more, answer_tokens=5)
        assert (cache.where("a"), cache.where("b")) == ("ssd", "host")
        got = await cache.load("a")
        assert torch.equal(got["kv"], torch.cat([a["kv"], more["kv"]]))
        assert torch.equal((await cache.load("b"))["kv"], b["kv"])
        assert cache.where("b") == "host"
