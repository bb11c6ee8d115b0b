"""A history committed again into Redis from the SSD tier below it (the write-through's
upward copy, :meth:`~tieredkv._cache.writethrough.WriteThrough.restart`), cut short by an
I/O error at each os call its SSD side makes, and the look-up that starts it cut short by
every kind of cancellation (``task.cancel``, ``asyncio.timeout``, ``wait_for``, an anyio
scope): the replica keeps serving the acknowledged history from SSD, a failure is reported
by ``flush()`` (never silent), and once the fault is gone the commit goes through, for
every replica to load: the whole history, never the older one the server kept."""

from __future__ import annotations

import errno
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from tests.cancellation import CANCELS, cancellable
from tests.faults import FaultInjector
from tests.fleet import tags
from tests.integration.test_redis_adopt import _chat_served_from_redis, _host_redis_ssd
from tests.integration.test_redis_fleet import FRESH, append, manifest, replica
from tests.invariants import unowned
from tests.redis_server import RedisServer, new_prefix, own_redis_server, redis_server
from tieredkv import TieredKVCache
from tieredkv.errors import HistoryConflictError, TierIOError

__all__ = ["own_redis_server", "redis_server"]  # fixtures used below


async def _lost_in_redis(
    b: TieredKVCache,
    server: RedisServer,
    prefix: str,
    *,
    discover: Callable[[TieredKVCache], Awaitable[None]] | None = None,
) -> None:
    """chat's five turns committed (Redis serves them, SSD holds them too); the server then
    loses the last three (its manifest is the two-turn one again, as an AOF restart loses
    its last second). B's next turn is refused, and B's look-up (or ``discover(b)``: one
    cut short) elects SSD, which holds all five, to serve chat and commit the three
    into Redis again."""
    await _chat_served_from_redis(b)
    with server.client() as c:
        two_turns = c.dump(manifest(prefix, "chat"))
    await append(b, "chat", 2, 3, 4)
    await b.flush()
    with server.client() as c:
        c.restore(manifest(prefix, "chat"), 0, two_turns, replace=True)
    try:
        await append(b, "chat", 5)
    except HistoryConflictError:
        pass
    else:  # pragma: no cover - the scenario's premise
        raise AssertionError("the turn on a lost commit was not refused")
    if discover is None:
        assert await b.discover("chat")
        assert b.where("chat") == "ssd"
    else:
        await discover(b)


TURNS = [0, 1, 2, 3, 4]


async def _settled(b: TieredKVCache, server: RedisServer, prefix: str) -> None:
    """B serves the whole history; its next flush commits it; a new replica loads it."""
    assert unowned(b) == []
    assert tags(await b.load("chat")) == TURNS
    await b.flush()
    async with replica(server.url, prefix, liveness=FRESH) as a:
        assert tags(await a.load("chat")) == TURNS


async def test_an_io_error_at_each_os_call_of_a_commit_from_ssd_is_reported_and_retried(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """EIO at the 1st, 2nd, ... call of every os call site the upward commit makes (it
    reads the three turns the server lost from SSD): ``flush()`` raises ``TierIOError``
    naming the read that failed (or the fault cost nothing: a ``close``), B serves the
    five turns all along, and the next flush commits them."""
    prefix = new_prefix()
    b, _ = _host_redis_ssd(redis_server.url, prefix, tmp_path / "count")
    with FaultInjector() as faults:
        async with b:
            await _lost_in_redis(b, redis_server, prefix)
            before = Counter(faults.calls)
            await b.flush()
            calls = Counter(faults.calls)
    calls.subtract(before)
    assert +calls == Counter(open=3, preadv=3, close=3)  # (one segment file per lost turn)
    reported = 0
    for site, n in sorted((+calls).items()):
        for k in range(1, n + 1):
            prefix = new_prefix()
            b, _ = _host_redis_ssd(redis_server.url, prefix, tmp_path / f"{site}-{k}")
            with FaultInjector() as faults:
                async with b:
                    with faults.paused():
                        await _lost_in_redis(b, redis_server, prefix)
                    faults.fail_nth(site, faults.calls[site] + k, errno.EIO)
                    if site == "close":  # (Linux closes the descriptor all the same)
                        await b.flush()
                    else:
                        with pytest.raises(TierIOError) as caught:
                            await b.flush()
                        assert caught.value.tier == "ssd"
                        assert str(caught.value).startswith(
                            f"tier 'ssd' could not {site.replace('preadv', 'read')} segment "
                            f"{k + 1} to commit the latest turns of 1 session(s) (the first: "
                            f"'chat'): injected Input/output error"
                        )
                        reported += 1
                    with faults.paused():
                        await _settled(b, redis_server, prefix)
    assert reported == 6


async def test_a_cancelled_look_up_that_restarts_a_commit_from_ssd_loses_nothing(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """The look-up that finds the server lost turns committed here (and elects SSD, which
    holds them, to serve the history and commit them again), cancelled after 0 to 0.95 ms
    by each kind of cancellation: B then serves the five turns, and every replica is served
    them once B has flushed."""
    for kind in CANCELS:
        for step in range(20):
            prefix = new_prefix()
            b, _ = _host_redis_ssd(redis_server.url, prefix, tmp_path / f"{kind}-{step}")

            async def cut(b: TieredKVCache, kind: str = kind, delay: float = step / 20_000) -> None:
                await cancellable(kind, delay, lambda: b.discover("chat"))

            async with b:
                await _lost_in_redis(b, redis_server, prefix, discover=cut)
                await _settled(b, redis_server, prefix)
