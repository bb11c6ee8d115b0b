"""The Redis tier's pipelined sends (``_redis_client.pipelined``: the values and the commit
of every append): replies in order, error replies as exceptions, and a send that a
cancellation or a failure cut short never leaves its connection half-written in the pool,
against a real redis-server (one connection in the pool, so a desynchronized connection
would serve the next command)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import anyio
import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from tests.redis_server import RedisServer, own_redis_server
from tieredkv.backends._redis_client import pipelined
from tieredkv.backends.redis import driver_options

__all__ = ["own_redis_server"]  # fixtures used below

MiB = 1 << 20


@pytest.fixture
async def client(own_redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    options = await anyio.to_thread.run_sync(driver_options)  # (no metadata look-up on the loop)
    pool = aioredis.BlockingConnectionPool.from_url(
        own_redis_server.url,
        max_connections=1,
        timeout=20,
        socket_timeout=20,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 3, (RedisConnectionError,)),
        **options,
    )
    c = aioredis.Redis.from_pool(pool)
    try:
        yield c
    finally:
        await c.aclose()


async def test_replies_in_order_with_error_replies_as_exceptions(
    client: aioredis.Redis,
) -> None:
    value = os.urandom(12 * MiB)
    replies = await pipelined(
        client,
        [
            ("SET", "a", memoryview(value)[: 6 * MiB], "PX", 60_000, "NX"),
            ("SET", "a", memoryview(value), "PX", 60_000, "NX"),  # exists: nil
            ("SET", "b", memoryview(value)[6 * MiB :]),
            ("LPUSH", "a", "x"),  # a string: a WRONGTYPE error reply
            ("GET", "b"),
            ("STRLEN", "a"),
        ],
    )
    assert replies[:3] == [b"OK", None, b"OK"]
    assert isinstance(replies[3], ResponseError)
    assert "WRONGTYPE" in str(replies[3])
    assert replies[4:] == [value[6 * MiB :], 6 * MiB]
    assert await client.get("a") == value[: 6 * MiB]


async def _cut_short(kind: str, send: Callable[[], Coroutine[Any, Any, object]]) -> None:
    """Run ``send`` and cut it short after 1 s the ``kind`` way: an anyio scope, or
    asyncio's own ``timeout``, ``wait_for`` or ``task.cancel()``; fails if it finished."""
    if kind == "anyio":
        with anyio.move_on_after(1.0) as scope:
            await send()
        assert scope.cancelled_caught
    elif kind == "asyncio.timeout":
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                await send()
    elif kind == "wait_for":
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(send(), 1.0)
    else:
        task: asyncio.Task[object] = asyncio.get_running_loop().create_task(send())
        await asyncio.sleep(1.0)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("kind", ["anyio", "asyncio.timeout", "wait_for", "task.cancel"])
async def test_a_cancelled_send_leaves_no_half_written_connection(
    client: aioredis.Redis, own_redis_server: RedisServer, kind: str
) -> None:
    """The server is paused, so the send of 96 MiB stalls once the socket's buffers are
    full and is cancelled there (by an anyio scope or by asyncio's own cancellations); the
    connection goes back to the pool closed, and the next commands on the pool (the same
    connection, reconnected) get their own replies."""
    big = memoryview(os.urandom(96 * MiB))
    await client.set("before", b"1")
    own_redis_server.pause()
    try:
        await _cut_short(
            kind, lambda: pipelined(client, [("SET", "big", big), ("SET", "after", b"2")])
        )
    finally:
        own_redis_server.resume()
    with anyio.fail_after(20):
        assert await pipelined(client, [("GET", "before"), ("EXISTS", "big", "after")]) == [
            b"1",
            0,
        ]
        assert await client.get("before") == b"1"


async def test_a_connection_lost_mid_send_is_retried_on_a_new_one(
    client: aioredis.Redis, own_redis_server: RedisServer
) -> None:
    """The pool's connection dies (the server restarts empty) between two sends: the next
    send fails on it, reconnects (the client's retry, as the tier configures it) and is
    stored whole."""
    value = os.urandom(8 * MiB)
    await client.set("x", b"1")
    own_redis_server.restart(empty=True)
    with anyio.fail_after(30):
        replies = await pipelined(client, [("SET", "v", memoryview(value)), ("GET", "v")])
    assert replies == [b"OK", value]
    assert await client.exists("x") == 0
