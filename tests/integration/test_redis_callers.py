"""What the callers of a replica sharing a RedisTier see, on a real redis-server: every
caller whose turns were refused hears of it, a full host tier keeps the turn here first,
a replica without the fleet's secret is refused before it writes, and each error names
what happened and what to do.

Replicas whose leases matter run in processes of their own
(:class:`tests.fleet.ReplicaProcess`).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tests.fleet import ReplicaProcess, runs, tags, turn
from tests.redis_server import RedisServer, new_prefix, own_redis_server
from tieredkv import HostMemoryTier, TieredKVCache
from tieredkv.backends.redis import RedisTier
from tieredkv.errors import CommitDelayedError, TurnRefusedError

__all__ = ["own_redis_server"]  # fixtures used below

MiB = 1 << 20


@pytest.fixture
def server(own_redis_server: RedisServer) -> RedisServer:
    return own_redis_server


def replica(url: str, prefix: str, *, host: int = 64 * MiB, **options: Any) -> TieredKVCache:
    options = {"lease_ttl": 2.0, "timeout": 2.0, "value_size": 64 << 10, **options}
    shared = RedisTier(url, 512 * MiB, prefix=prefix, **options)
    return TieredKVCache([HostMemoryTier(host), shared], mode="inclusive")


async def test_every_concurrent_flush_hears_of_a_refused_turn(server: RedisServer) -> None:
    """A appends t0 and flushes, then a 64 MiB t1; while its write-through runs, B (another
    process) takes the conversation over. Three flush() calls under way at once on A each
    raise TurnRefusedError naming turn 1 (each waited for it), and a flush begun after
    them returns: the refusal was reported to everyone it concerned."""
    prefix = new_prefix()
    async with (
        ReplicaProcess(server.url, prefix, lease_ttl=0.5) as b,
        replica(server.url, prefix, host=256 * MiB, lease_ttl=0.5, timeout=10.0) as a,
    ):
        await a.append("chat", turn(0), answer_tokens=1)
        await a.flush()
        await a.append("chat", turn(1, 256 * 1024), answer_tokens=1)
        assert (await b.load("chat"))["turns"] == [0]
        outcomes: list[object] = []

        async def flush() -> None:
            try:
                await a.flush()
            except TurnRefusedError as exc:
                outcomes.append(exc.refusals)
            else:
                outcomes.append("returned")

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(flush)
        assert outcomes == [[("chat", [1])]] * 3
        await a.flush()
        assert a.stats().refused == 1
        assert tags(await a.load("chat")) == [0]


async def test_a_turn_no_local_tier_can_hold_is_never_said_to_be_kept(
    server: RedisServer,
) -> None:
    """B (another process, a 5 s lease) writes t0 and flushes; A, whose host tier holds
    64 KiB, takes the conversation over and appends a 256 KiB turn, which only Redis can
    hold: it is written straight there, and B's live lease delays the commit. The append
    raises CommitDelayedError saying nothing of the turn was stored (not that it is kept),
    and it is not: A's history is [t0], and after the delay the same append succeeds and
    a fresh replica loads [t0, t1]."""
    prefix = new_prefix()
    async with (
        ReplicaProcess(server.url, prefix, lease_ttl=5.0) as b,
        replica(server.url, prefix, host=64 << 10, lease_ttl=5.0) as a,
    ):
        assert (await b.append("chat", 0))["ok"]
        assert (await b.flush())["ok"]
        assert tags(await a.load("chat")) == [0]
        with pytest.raises(CommitDelayedError, match="nothing of the turn was stored") as info:
            await a.append("chat", turn(1, 1024), answer_tokens=1)
        assert not info.value.kept
        assert "is kept" not in str(info.value)
        assert a.stats().appends == 0
        assert tags(await a.load("chat")) == [0]
        await anyio.sleep(info.value.retry_in + 0.2)
        await a.append("chat", turn(1, 1024), answer_tokens=1)
        await a.flush()
    async with replica(server.url, prefix) as c:
        assert [tag for tag, _ in runs(await c.load("chat"))] == [0, 1]
