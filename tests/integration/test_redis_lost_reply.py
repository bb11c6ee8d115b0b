"""A Redis commit whose reply is lost: the server ran it, the writer never heard back.

A relay between the tier and a real redis-server passes the tier's commands on but, while
it drops, not the server's replies (a connection that died after the server ran what it
was sent). The write then either learns from the server that the commit was made (and
succeeds), or, when the server cannot be asked, raises a ``TierIOError`` that says the
commit may have been made: never one that claims nothing was stored while another
replica already reads the turn.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import pytest

from tests.redis_server import RedisServer, new_prefix, own_redis_server, redis_server
from tests.segments import Segment, SegmentFactory, read_back, store
from tieredkv.backends.redis import RedisTier
from tieredkv.backends.shared import plain_header
from tieredkv.errors import CommitDelayedError, TierIOError
from tieredkv.payload import parse_header

__all__ = ["own_redis_server", "redis_server"]  # fixtures used below

CAPACITY = 64 << 20
TIMEOUT = 0.5
SECRET = b"the fleet's secret, 32 bytes ..."


_BROKEN = (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError)


class ReplyDropper:
    """A TCP relay to ``port`` on 127.0.0.1. Once :attr:`armed` and a client sends a Lua
    step (``EVALSHA``: the commit), the server's replies are read and thrown away, on every
    connection, until :meth:`heal` (the connections stay open: a client waits for its
    replies until its timeout); :meth:`heal` then closes the connections that lost a
    reply (their replies would no longer match their commands)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.armed = False
        self.dropping = False
        self.port = 0
        self._tainted: set[anyio.abc.SocketStream] = set()

    async def heal(self) -> None:
        self.armed = self.dropping = False
        tainted, self._tainted = self._tainted, set()
        for stream in tainted:
            await stream.aclose()

    async def _relay(self, client: anyio.abc.SocketStream) -> None:
        server = await anyio.connect_tcp("127.0.0.1", self.target)
        async with client, server, anyio.create_task_group() as tg:

            async def up() -> None:
                with contextlib.suppress(*_BROKEN):
                    async for chunk in client:
                        if self.armed and b"EVALSHA" in chunk.upper():
                            self.dropping = True
                        await server.send(chunk)
                tg.cancel_scope.cancel()

            async def down() -> None:
                with contextlib.suppress(*_BROKEN):
                    async for chunk in server:
                        if self.dropping:
                            self._tainted.add(client)
                        else:
                            await client.send(chunk)
                tg.cancel_scope.cancel()

            tg.start_soon(up)
            tg.start_soon(down)


@contextlib.asynccontextmanager
async def relaying(port: int) -> AsyncIterator[ReplyDropper]:
    """A :class:`ReplyDropper` to ``port``, serving until the block ends."""
    relay = ReplyDropper(port)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    relay.port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, relay._relay)
        try:
            yield relay
        finally:
            tg.cancel_scope.cancel()


def _body(data: bytes) -> bytes:
    """A segment's tensor bytes (the head differs as each replica authenticated it)."""
    header, _ = parse_header(data, "a segment")
    return bytes(data[header.body_offset : header.body_offset + header.body_len])


def _tier(port: int, prefix: str, name: str) -> RedisTier:
    return RedisTier(
        f"redis://127.0.0.1:{port}/0",
        CAPACITY,
        prefix=prefix,
        timeout=TIMEOUT,
        name=name,
        secret=SECRET,  # (so that no settling period delays the first commit)
    )


async def arm(relay: ReplyDropper, writer: RedisTier, seg: SegmentFactory, s: Segment) -> None:
    """Make ``writer`` ready to write ``s`` (the commit's script loaded, the lease taken,
    ``s`` reserved), then arm the relay, so that the replies lost are the commit's."""
    await store(writer, seg(session="warm", tokens=8, seed=9))  # (the script loaded)
    await writer.ensure_writer(s.key[0])
    assert writer.reserve(s.key, s.length)
    relay.armed = True


async def check_made_and_learned(a: RedisTier, b: RedisTier, s: Segment) -> None:
    """After a write of ``s`` by ``a`` that raised (or was cut short) with its commit
    made: ``a`` does not count it, another replica ``b`` reads it, and ``a`` learns it
    from the manifest, so the same write then succeeds at once."""
    assert not a.contains(s.key)
    a.release(s.key)
    assert [plain_header(h) for h in await b.lookup("s")] == [plain_header(s.header)]
    assert _body(await read_back(b, s)) == _body(s.data)
    with anyio.fail_after(10):
        assert a.reserve(s.key, s.length)
        await a.write(s.key, s.view)
    assert a.contains(s.key)


async def _write_with_replies_lost(
    relay: ReplyDropper, writer: RedisTier, seg: SegmentFactory, s: Segment, heal: float
) -> TierIOError | None:
    """Write ``s`` while the relay drops every reply from its commit on, healing it
    ``heal`` seconds after the write began; the write's error, if it raised one."""
    await arm(relay, writer, seg, s)
    key, data = s.key, s.view
    error: TierIOError | None = None
    async with anyio.create_task_group() as tg:

        async def heal_later() -> None:
            await anyio.sleep(heal)
            await relay.heal()

        tg.start_soon(heal_later)
        try:
            await writer.write(key, data)
        except TierIOError as exc:
            error = exc
    return error


async def test_a_commit_whose_reply_is_lost_is_learned_once_the_server_answers(
    redis_server: RedisServer, seg: SegmentFactory
) -> None:
    """The reply lost, the server answering again before the write gives up asking: the
    write returns (the commit was made), and another replica reads the segment."""
    s = seg(tokens=64, seed=3)
    prefix = new_prefix()
    async with (
        relaying(redis_server.port) as relay,
        _tier(relay.port, prefix, "A") as a,
        _tier(redis_server.port, prefix, "B") as b,
    ):
        error = await _write_with_replies_lost(relay, a, seg, s, heal=TIMEOUT + 1.0)
        assert error is None, str(error)
        assert a.contains(s.key)
        assert [plain_header(h) for h in await b.lookup("s")] == [plain_header(s.header)]
        assert _body(await read_back(b, s)) == _body(s.data)


async def test_a_commit_whose_reply_is_lost_is_never_reported_as_not_made(
    redis_server: RedisServer, seg: SegmentFactory
) -> None:
    """The reply lost and the server not answering until the write gives up: the write
    raises a TierIOError saying the commit may have been made (it was: another replica
    reads it), not one that claims nothing was stored."""
    s = seg(tokens=64, seed=4)
    prefix = new_prefix()
    async with (
        relaying(redis_server.port) as relay,
        _tier(relay.port, prefix, "A") as a,
        _tier(redis_server.port, prefix, "B") as b,
    ):
        error = await _write_with_replies_lost(relay, a, seg, s, heal=TIMEOUT + 4.0)
        assert error is not None
        assert error.maybe_committed
        assert "could not write segment 0" in str(error)
        assert "may have been made" in str(error)
        await check_made_and_learned(a, b, s)  # (it was made)


async def test_a_commit_that_could_not_connect_is_not_reported_as_maybe_made(
    own_redis_server: RedisServer, seg: SegmentFactory
) -> None:
    """The server is dead when the write goes out (connection refused): nothing reached it,
    so the write raises a TierIOError that does not say the commit may have been made, at
    once (it does not ask the server whether its commit was made for 2 s), and stores
    nothing; once the server is back (empty) and has been up a liveness period (a history's
    first commit on a server that restarted waits that long), the same write commits."""
    s = seg(tokens=64, seed=5)
    async with _tier(own_redis_server.port, new_prefix(), "A") as a:
        await a.acquire("s")  # (the lease: the write goes straight to its commit)
        own_redis_server.kill()
        assert a.reserve(s.key, s.length)
        began = time.monotonic()
        with pytest.raises(TierIOError, match="could not write segment 0") as caught:
            await a.write(s.key, s.view)
        assert time.monotonic() - began < 1.5
        assert not caught.value.maybe_committed
        assert "may have been made" not in str(caught.value)
        assert not a.contains(s.key)
        own_redis_server.start()
        with pytest.raises(CommitDelayedError, match="up for less than a liveness period"):
            await a.write(s.key, s.view)
        await anyio.sleep(3.0 + 1.0)  # (the default liveness; the server counts whole seconds)
        with anyio.fail_after(10):
            await a.write(s.key, s.view)
        assert _body(await read_back(a, s)) == _body(s.data)
