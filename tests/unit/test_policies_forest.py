"""Eviction over a forest: what moving a conversation out of a tier frees there, in the
simulator's replay and in the live cache, and the sizes Bidaw's learning weighs."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from tieredkv import HostMemoryTier, RetentionHint, SSDTier, TieredKVCache
from tieredkv.meta import KVMeta, MetadataChannel, TierInfo
from tieredkv.policies import LRU, AdaptiveBidaw, BidawEviction
from tieredkv.policies.base import freed_bytes, stored_share
from tieredkv.sim.forest import Forest, replay_forest
from tieredkv.sim.trace import Turns


class FreedLRU(LRU):
    """LRU sized by what evicting a conversation frees (a third-party policy would)."""

    name = "freed-lru"

    def __init__(self) -> None:
        super().__init__()
        self.told: dict[str, int] = {}

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        self.told[session] = freed = freed_bytes(meta)
        super().on_admit(session, msgspec.structs.replace(meta, nbytes=freed), now)


def test_freed_bytes_counts_sharers_resident_in_the_tier() -> None:
    meta = KVMeta(session="f", tier="host", nbytes=100, shared_bytes=60)
    assert freed_bytes(meta) == 40  # no per-tier count: every sharer counts
    meta = msgspec.structs.replace(meta, tier_shared=(0, 60))
    assert (freed_bytes(meta), freed_bytes(meta, 1), freed_bytes(meta, 2)) == (100, 40, 40)
    assert stored_share(meta) == 100
    assert stored_share(msgspec.structs.replace(meta, share_bytes=55)) == 55


def test_replay_tells_the_policy_when_a_sharer_leaves_the_tier() -> None:
    # 1 byte a token, 10 bytes of host memory. 0 and 1 share a 4-byte prompt (2 each of
    # their own); 2 (4 bytes) evicts 0, the oldest: 1 alone holds the prompt and evicting
    # it now frees 6. 3 (6 bytes) then needs 6: 1 alone is enough, and 2 comes back a hit
    # (growing by 2 bytes: 3 makes room).
    turns = Turns(
        [0, 1, 2, 3, 2], [0.0, 1.0, 2.0, 3.0, 4.0], [5, 5, 3, 5, 1], [1, 1, 1, 1, 1],
        [0, 0, 0, 0, 1],
    )  # fmt: skip
    p = ("p", 4)
    ranges = [(p, ("a", 2)), (p, ("b", 2)), (("c", 4),), (("d", 6),), (("c", 4), ("c1", 2))]
    policy = FreedLRU()
    r = replay_forest(Forest(turns, ranges), policy, host_bytes=10, bytes_per_token=1)
    # before the prompt's holders were counted per tier, 1 looked as if it freed 2 bytes:
    # 3 took 1 and 2 out, and 2's return missed
    assert policy.told["u1"] == 6
    assert (r.replay.hits, r.replay.misses, r.replay.evictions) == (1, 0, 3)


def kv(tokens: int, seed: int) -> dict[str, torch.Tensor]:  # 1 KiB a token
    g = torch.Generator().manual_seed(seed)
    return {
        "k": torch.randn(tokens, 4, 64, generator=g).to(torch.float16),
        "v": torch.randn(tokens, 4, 64, generator=g).to(torch.float16),
    }


async def test_live_cache_tells_the_policy_when_a_sharer_leaves_the_tier(ssd_dir: Path) -> None:
    policy = BidawEviction()
    tiers = [HostMemoryTier(48 * 1024), SSDTier(ssd_dir, 8 << 20)]
    async with TieredKVCache(tiers, eviction=policy, max_pinned_bytes=48 * 1024) as c:
        prompt = (await c.append("a", kv(16, 1), answer_tokens=3)).nbytes
        await c.append("a", kv(16, 2), answer_tokens=3)
        f = await c.append(
            "f", kv(4, 3), answer_tokens=1, parent="a", parent_tokens=16,
            hint=RetentionHint(pin=True),
        )  # fmt: skip
        assert freed_bytes(f) == f.nbytes - prompt  # a keeps the prompt in host memory
        await c.append("x", kv(16, 4), answer_tokens=1)  # room: a leaves host memory
        a, f, x = c.channel["a"], c.channel["f"], c.channel["x"]
        assert (a.tier, f.tier, x.tier) == ("ssd", "host", "host")
        assert f.shared_bytes == prompt  # a still lists it (on SSD)
        assert freed_bytes(f) == f.nbytes  # but f alone keeps it in host memory
        assert policy.resident_bytes() == freed_bytes(f) + x.nbytes == c.tiers[0].used


def test_adaptive_bidaw_shadow_lru_sizes_by_share() -> None:
    # 10 conversations of 30 bytes each sharing a 25-byte prompt (share 5/2 + 5 each): in
    # 100 bytes an LRU over the forest holds them all, not 3 of them
    policy = AdaptiveBidaw(100)
    for i in range(10):
        meta = KVMeta(
            session=f"s{i}", tier="host", nbytes=30, shared_bytes=25, share_bytes=5 + 25 // 10,
            turns=1, accesses=1, last_access=float(i),
        )  # fmt: skip
        policy.on_access(meta.session, meta, float(i))
    assert policy.shadow_sessions() == [f"s{i}" for i in range(10)]


def test_lru_resize_is_not_a_use() -> None:
    # a fork of "a" came: the cache tells LRU that evicting "a" frees less; "a" was not used
    view = MetadataChannel([TierInfo(name="host", level=0, capacity=100)])
    lru = LRU()
    a = KVMeta(session="a", tier="host", nbytes=10)
    lru.on_admit("a", a, 0.0)
    lru.on_admit("b", KVMeta(session="b", tier="host", nbytes=10), 1.0)
    lru.on_admit("a", msgspec.structs.replace(a, shared_bytes=6), 2.0)
    assert lru.victims(4, 3.0, view) == ["a"]
    lru.on_access("a", a, 4.0)  # a use
    assert lru.victims(4, 5.0, view) == ["b"]
