"""A replica whose tiers put a local tier below the shared one (host memory, Redis, SSD),
against a real redis-server: when the shared history lost turns this replica committed
there, its reconciliation with the shared tier (``_adopt`` in
:mod:`tieredkv._cache.sharing`) elects as the history's primary the local tier below that
still holds all of it, serves the history from there, and commits the lost turns again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fleet import tags
from tests.integration.test_redis_fleet import FRESH, append, manifest, replica, tier
from tests.redis_server import RedisServer, new_prefix, redis_server
from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.errors import HistoryConflictError

__all__ = ["redis_server"]  # fixtures used below

MiB = 1 << 20


async def test_a_turn_the_server_lost_is_served_from_ssd_below_it_and_committed_again(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """B (host memory, Redis, SSD) commits chat's first two turns, which then leave host
    memory (other conversations take it): Redis serves chat. B's third turn is committed
    there and copied into SSD, the tier below. The server loses that commit (as an AOF
    restart loses its last second of writes): its manifest is the two-turn history again.
    B's next turn is refused as a conflict, and B's tier forgets the version it knew. When
    B next asks the shared tier about chat, Redis lacks a turn B committed: SSD, which
    holds all three, becomes the tier that serves chat (it is no longer Redis, nor lost),
    and B serves the three acknowledged turns byte for byte. The lost turn is committed
    again from there: once B has flushed, replica A is served the same three turns."""
    prefix = new_prefix()
    ssd = SSDTier(tmp_path / "ssd", 8 * MiB)
    b_tiers = [HostMemoryTier(256 << 10), tier(redis_server.url, prefix, liveness=FRESH), ssd]
    async with TieredKVCache(b_tiers, mode="inclusive") as b:
        await append(b, "chat", 0, 1)
        for i in range(6):  # 64 KiB each: chat leaves host memory
            await append(b, f"other{i}", 10 + i, tokens=256)
        await b.flush()
        assert b.where("chat") == "redis"
        with redis_server.client() as c:
            two_turns = c.dump(manifest(prefix, "chat"))
        await append(b, "chat", 2)
        await b.flush()
        assert b.where("chat") == "redis"
        assert sorted(ssd.keys()) == [("chat", 0), ("chat", 1), ("chat", 2)]
        with redis_server.client() as c:
            c.restore(manifest(prefix, "chat"), 0, two_turns, replace=True)
        with pytest.raises(HistoryConflictError):
            await append(b, "chat", 3)
        before = b.stats()
        assert await b.discover("chat")
        assert b.where("chat") == "ssd"  # (elected: the one tier holding all of it)
        assert tags(await b.load("chat")) == [0, 1, 2]
        await b.flush()
        after = b.stats()
        assert (after.lost, after.unproven, after.errors) == (
            before.lost,
            before.unproven,
            before.errors,
        )
        async with replica(redis_server.url, prefix, liveness=FRESH) as a:
            assert tags(await a.load("chat")) == [0, 1, 2]
