"""A replica whose tiers put a local tier below the shared one (host memory, Redis, SSD),
against a real redis-server: when the shared history lost turns this replica committed
there, its reconciliation with the shared tier (``_adopt`` in
:mod:`tieredkv._cache.sharing`) elects as the history's primary the local tier below that
still holds all of it, serves the history from there, and commits the lost turns again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fleet import runs, tags, turn
from tests.integration.test_redis_fleet import FRESH, append, manifest, replica, tier
from tests.invariants import unowned
from tests.redis_server import RedisServer, new_prefix, own_redis_server, redis_server
from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.errors import HistoryConflictError, SessionNotFoundError, TurnRefusedError

__all__ = ["own_redis_server", "redis_server"]  # fixtures used below

MiB = 1 << 20


def _host_redis_ssd(url: str, prefix: str, tmp_path: Path) -> tuple[TieredKVCache, SSDTier]:
    """Replica B: 256 KiB of host memory, the shared tier, then an SSD tier (returned too)."""
    ssd = SSDTier(tmp_path / "ssd", 8 * MiB)
    tiers = [HostMemoryTier(256 << 10), tier(url, prefix, liveness=FRESH), ssd]
    return TieredKVCache(tiers, mode="inclusive"), ssd


async def _chat_served_from_redis(b: TieredKVCache) -> None:
    """``chat``'s first two turns, then other conversations that push it out of host
    memory: Redis serves it."""
    await append(b, "chat", 0, 1)
    for i in range(6):  # 64 KiB each: chat leaves host memory
        await append(b, f"other{i}", 10 + i, tokens=256)
    await b.flush()
    assert b.where("chat") == "redis"


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
    b, ssd = _host_redis_ssd(redis_server.url, prefix, tmp_path)
    async with b:
        await _chat_served_from_redis(b)
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


async def test_a_fork_committed_again_from_ssd_names_the_turns_it_inherits(
    own_redis_server: RedisServer, tmp_path: Path
) -> None:
    """Fleet campaign seed 6005. B (host memory, Redis, SSD) writes ``p`` (turn 0, 48
    tokens) and ``c``, a fork of its first 30 tokens; once Redis serves both, c's next turn
    is copied into SSD with what it inherits. The server restarts empty, and replica A
    starts another ``p``: its turn 0 is committed under p's key. B's load of p is a miss,
    and B's tier indexes A's turn 0 under that key. B's next turn of c is refused (the
    server lost c); B's next load of c elects SSD, which holds all of c, and commits c
    again from there. That commit names p's old turn 0 (its first turn's ``base_ids``),
    not the turn the tier indexes under the key now: refused, and B's flush reports it.
    No replica is served a splice: A and a fresh replica miss c, and p is A's. (The commit
    used to reference A's turn 0: every replica then loaded A's first 30 tokens followed by
    c's own turns, or failed with a ``RuntimeError`` where A's turn was the shorter.)"""
    server = own_redis_server
    prefix = new_prefix()
    ssd = SSDTier(tmp_path / "ssd", 8 * MiB)
    b_tiers = [HostMemoryTier(64 << 10), tier(server.url, prefix, liveness=FRESH), ssd]
    async with TieredKVCache(b_tiers, mode="inclusive") as b:
        await b.append("p", turn(1, 48), answer_tokens=1)
        await b.append("c", turn(2, 24), answer_tokens=1, parent="p", parent_tokens=30)
        for i in range(4):  # (64 tokens each: p and c leave host memory)
            await append(b, f"other{i}", 10 + i, tokens=64)
        await b.flush()
        assert (b.where("p"), b.where("c")) == ("redis", "redis")
        await append(b, "c", 3, tokens=8)
        await b.flush()
        assert sorted(ssd.keys()) == [("c", 1), ("c", 2), ("p", 0)]
        forked = [(1, 30), (2, 24), (3, 8)]
        server.restart(empty=True)
        async with replica(server.url, prefix, liveness=FRESH) as a:
            await a.append("p", turn(5, 48), answer_tokens=1)
            await a.flush()
            with pytest.raises(SessionNotFoundError):
                await b.load("p")  # (another history: a miss)
            with pytest.raises(HistoryConflictError):
                await append(b, "c", 4, tokens=8)  # (the server lost c)
            assert runs(await b.load("c")) == forked  # (from SSD, its commit restarted)
            with pytest.raises(TurnRefusedError, match="another history's there now"):
                await b.flush()
            assert unowned(b) == []
            with pytest.raises(SessionNotFoundError):
                await a.load("c")
            assert runs(await a.load("p")) == [(5, 48)]
        async with replica(server.url, prefix, liveness=FRESH) as fresh:
            with pytest.raises(SessionNotFoundError):
                await fresh.load("c")
            assert runs(await fresh.load("p")) == [(5, 48)]


async def test_a_history_found_damaged_in_redis_is_served_from_ssd_and_committed_again(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Fleet campaign seed 6005, again. B (host memory, Redis, SSD) serves ``chat`` from
    Redis, SSD holding all of it too. The server loses chat's values (a restart while B's
    load was under way: its look-up found the manifest current, its read found the values
    gone): Redis takes chat out for every replica, the damage costs B that copy only, and
    B's load serves the three turns from SSD. B's next turn extends them, and the history is
    committed again from turn 0: every replica is then served all four. (The load used to
    be a miss that left SSD serving chat all the same: the caller, told to recompute,
    appended a first turn, which B stored as the fourth, a history no caller had been
    acknowledged.)"""
    prefix = new_prefix()
    b, ssd = _host_redis_ssd(redis_server.url, prefix, tmp_path)
    async with b:
        await _chat_served_from_redis(b)
        await append(b, "chat", 2)
        await b.flush()
        assert b.where("chat") == "redis"
        assert sorted(ssd.keys()) == [("chat", 0), ("chat", 1), ("chat", 2)]
        tag = manifest(prefix, "chat").removesuffix(":m")
        with redis_server.client() as c:
            values = [k for k in c.scan_iter(match=f"{tag}:*") if not k.endswith(b":m")]
            assert len(values) == 3
            c.delete(*values)
        before = b.stats()
        assert tags(await b.load("chat")) == [0, 1, 2]
        after = b.stats()
        assert (after.corrupt, after.lost, after.unproven) == (before.corrupt + 1, before.lost, 0)
        assert unowned(b) == []
        await append(b, "chat", 7)
        await b.flush()
        async with replica(redis_server.url, prefix, liveness=FRESH) as a:
            assert tags(await a.load("chat")) == [0, 1, 2, 7]
