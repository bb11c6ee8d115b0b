"""Every tier layout the Redis how-to describes (host + Redis, SSD + Redis, host + SSD +
Redis; with and without ``secret=``) on a real redis-server: each replica's turns reach the
shared tier, a fresh replica loads them exactly, and no public call hangs.

Replicas whose calls might hang run in processes of their own
(:class:`tests.fleet.ReplicaProcess`), every command under ``anyio.fail_after`` there and a
bound here, so a call that cannot be cancelled fails the test instead of hanging it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fleet import ReplicaProcess, tags, turn
from tests.redis_server import RedisServer, new_prefix, own_redis_server
from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.backends.base import Tier
from tieredkv.backends.redis import RedisTier

__all__ = ["own_redis_server"]  # fixtures used below

MiB = 1 << 20
SECRET = bytes(range(32))

LAYOUTS = {
    "host+redis": {"host": 16 * MiB},
    "ssd+redis": {"host": 0, "ssd": True},
    "host+ssd+redis": {"host": 16 * MiB, "ssd": True},
}
"""The how-to's layouts: a replica's own tiers above the shared one."""


@pytest.fixture
def server(own_redis_server: RedisServer) -> RedisServer:
    return own_redis_server


def layout_tiers(
    url: str, prefix: str, directory: Path, layout: str, *, secret: bool, **options: Any
) -> list[Tier]:
    spec = LAYOUTS[layout]
    extra: dict[str, Any] = {"secret": SECRET} if secret else {}
    shared = RedisTier(
        url,
        512 * MiB,
        prefix=prefix,
        value_size=64 << 10,
        lease_ttl=2.0,
        timeout=2.0,
        **extra,
        **options,
    )
    tiers: list[Tier] = []
    if spec["host"]:
        tiers.append(HostMemoryTier(spec["host"]))
    if spec.get("ssd"):
        directory.mkdir(parents=True, exist_ok=True)
        tiers.append(SSDTier(directory, 64 * MiB, fsync=False, **extra))
    return [*tiers, shared]


def options(layout: str, directory: Path, *, secret: bool) -> dict[str, Any]:
    """A :class:`ReplicaProcess`'s options for ``layout``."""
    spec = LAYOUTS[layout]
    out: dict[str, Any] = {"host": spec["host"], "lease_ttl": 2.0, "timeout": 2.0}
    if spec.get("ssd"):
        directory.mkdir(parents=True, exist_ok=True)
        out["ssd"] = str(directory)
    if secret:
        out["secret"] = SECRET.hex()
    return out


@pytest.mark.parametrize("secret", [False, True], ids=["plain", "secret"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
async def test_every_layout_shares_its_turns(
    server: RedisServer, tmp_path: Path, layout: str, secret: bool
) -> None:
    """A replica of each layout appends three turns of one conversation and one turn of
    another, and flushes: a fresh replica of each layout loads both exactly, and every turn
    is in Redis (the replica's tiers need not hold it)."""
    prefix = new_prefix()
    writer = TieredKVCache(
        layout_tiers(server.url, prefix, tmp_path / "a", layout, secret=secret), mode="inclusive"
    )
    async with writer:
        for tag in (1, 2, 3):
            await writer.append("multi", turn(tag), answer_tokens=1)
        await writer.append("single", turn(9, 1024), answer_tokens=1)
        await writer.flush()
    for other in LAYOUTS:
        reader = TieredKVCache(
            layout_tiers(server.url, prefix, tmp_path / f"b-{other}", other, secret=secret),
            mode="inclusive",
        )
        async with reader:
            assert tags(await reader.load("multi")) == [1, 2, 3], other
            assert tags(await reader.load("single"), 1024) == [9], other


async def test_a_history_loaded_straight_from_redis_returns(
    server: RedisServer, tmp_path: Path
) -> None:
    """A reader whose host tier cannot take a history loads it straight from Redis:
    histories of 1, 2, 3 and 5 turns (fewer turns than reads kept in flight, as many, more)
    each load exactly, within the replica's deadline."""
    prefix = new_prefix()
    sizes = (1, 2, 3, 5)
    async with ReplicaProcess(server.url, prefix, host=16 * MiB) as a:
        for n in sizes:
            for tag in range(1, n + 1):
                assert (await a.append(f"chat{n}", tag, 1024))["ok"]
        assert (await a.flush())["ok"]
    async with ReplicaProcess(server.url, prefix, host=64 << 10, deadline=20.0) as b:
        for n in sizes:
            answer = await b.call("load", session=f"chat{n}", tokens=1024, within=40.0)
            assert answer == {"ok": True, "turns": list(range(1, n + 1))}, n
