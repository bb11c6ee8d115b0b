"""Issue 22's cases 1-11: a fleet of replicas sharing one RedisTier on a real redis-server,
with the server killed, restarted (empty or from its append-only file), stalled (SIGSTOP),
out of memory, or written to by another client.

Every turn names itself (:mod:`tests.fleet`), so each load is checked turn by turn: never a
splice, never an older history served as current, never a turn lost silently. Replicas
whose leases and fencing tokens matter run in processes of their own
(:class:`tests.fleet.ReplicaProcess`). Leases and timeouts are short, so each case runs in
seconds.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from tests import fleet_replica
from tests.cancellation import CANCELS, cancellable
from tests.faults import FaultInjector
from tests.fleet import ReplicaProcess, tags, turn
from tests.redis_server import RedisServer, new_prefix, own_aof_server, own_redis_server
from tests.unit.test_forest_faults import PausingSSD
from tieredkv import HostMemoryTier, RetentionHint, SSDTier, TieredKVCache, cli
from tieredkv.backends.base import SegmentKey
from tieredkv.backends.redis import RedisTier, conversation_tag
from tieredkv.backends.ssd import segment_file_name
from tieredkv.errors import (
    HistoryConflictError,
    InvalidArgumentError,
    SessionNotFoundError,
    StaleWriterError,
    TieredKVError,
    TierIOError,
    TurnRefusedError,
)
from tieredkv.meta import Event, Refused
from tieredkv.metrics import CacheCollector
from tieredkv.payload import (
    PREFIX,
    RETIRED_SEQ,
    _pack_prefix,
    hash_body,
    hashed_from,
    parse_header,
)
from tieredkv.policies import LRU

__all__ = ["own_aof_server", "own_redis_server"]  # fixtures used below

MiB = 1 << 20


@pytest.fixture
def server(own_redis_server: RedisServer) -> RedisServer:
    """A server of the test's own, without persistence."""
    return own_redis_server


@pytest.fixture
def aof_server(own_aof_server: RedisServer) -> RedisServer:
    """A server of the test's own with an append-only file (fsync at every write)."""
    return own_aof_server


def tier(url: str, prefix: str, **options: Any) -> RedisTier:
    options = {"lease_ttl": 2.0, "timeout": 1.0, "value_size": 64 << 10, **options}
    return RedisTier(url, 512 * MiB, prefix=prefix, **options)


A_RUNS = ["in-process", "own process"]
"""Where replica A of cases 4c and 4d (R1 of case 4e) runs: in the test's process, or in a
process of its own (:class:`tests.fleet.ReplicaProcess`)."""

A_OWNER = "replica-a"
"""Replica A's id in leases (:func:`written_by_a`): its liveness key is
``<prefix>:live:replica-a``."""


FRESH = 1.0
"""``liveness`` of a replica opened on a server just (re)started, in tests that do not depend
on it: it opens once the server has been up 3 s (thrice this), not 6 (thrice the lease)."""


def replica(
    url: str,
    prefix: str,
    *,
    host: int = 64 * MiB,
    mode: str = "inclusive",
    shared: RedisTier | None = None,
    **options: Any,
) -> TieredKVCache:
    """A replica: its own host tier over the shared tier (same server and prefix)."""
    shared = shared if shared is not None else tier(url, prefix, **options)
    return TieredKVCache([HostMemoryTier(host), shared], mode=mode)  # type: ignore[arg-type]


async def append(cache: TieredKVCache, session: str, *tags_: int, tokens: int = 16) -> None:
    for tag in tags_:
        await cache.append(session, turn(tag, tokens), answer_tokens=1)


def manifest(prefix: str, session: str) -> str:
    return f"{prefix}:{{{conversation_tag(session)}}}:m"


@asynccontextmanager
async def no_lost_task_exceptions() -> AsyncIterator[list[dict[str, Any]]]:
    """Fail if any task's exception goes unretrieved ("Task exception was never retrieved")."""
    loop = asyncio.get_running_loop()
    seen: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    try:
        yield seen
        gc.collect()
        await anyio.lowlevel.checkpoint()
        assert seen == [], seen
    finally:
        loop.set_exception_handler(old)


# -- wrong histories served ---------------------------------------------------------------


async def test_case01_a_replica_that_never_loaded_a_conversation_cannot_splice_into_it(
    server: RedisServer,
) -> None:
    """Case 1. A appends t0 t1 t2 and idles past lease_ttl; C, another process that never
    loaded the conversation (contains() is False there), appends x: the shared tier refuses
    it (HistoryConflictError: the history is not one C has read) and stores nothing. Every
    replica, A and C included, then loads [t0, t1, t2]."""
    prefix = new_prefix()
    async with (
        ReplicaProcess(server.url, prefix, lease_ttl=0.3) as c,  # open before A writes
        replica(server.url, prefix, lease_ttl=0.3) as a,
    ):
        await append(a, "chat", 10, 11, 12)
        await a.flush()
        await anyio.sleep(0.4)  # A's lease has run out
        assert await c.call("contains", session="chat") == {"ok": True, "value": False}
        refused = await c.append("chat", 99)
        assert refused["error"] == "HistoryConflictError", refused
        assert (await c.flush())["ok"]
        assert (await c.load("chat"))["turns"] == [10, 11, 12]
        assert tags(await a.load("chat")) == [10, 11, 12]
    async with replica(server.url, prefix) as fresh:
        assert tags(await fresh.load("chat")) == [10, 11, 12]


async def test_case02_a_late_write_after_a_stall_neither_splices_nor_serves_a_stale_copy(
    server: RedisServer,
) -> None:
    """Case 2. C holds an older copy [t0, t1]; A, the writer, commits t2, then appends t3
    while the server stalls (SIGSTOP) past A's timeout: A keeps the turn (its lease is
    live) and deletes nothing, and flush() raises TierIOError instead of returning. The
    server resumes and runs what it had received (A's late commit among it: refused, it
    came after A's deadline); A's flush() commits t3 once. C, another process, loads
    [t0..t3] (not its older copy) and appends c4: every replica loads [t0, t1, t2, t3, c4]."""
    prefix = new_prefix()
    options: dict[str, Any] = {"lease_ttl": 4.0, "timeout": 0.5}
    async with (
        replica(server.url, prefix, **options) as a,
        ReplicaProcess(server.url, prefix, **options) as c,
    ):
        await append(a, "chat", 0, 1)
        await a.flush()
        assert (await c.load("chat"))["turns"] == [0, 1]
        assert tags(await a.load("chat")) == [0, 1]  # A takes it back
        await append(a, "chat", 2)
        await a.flush()
        server.pause()
        try:
            await append(a, "chat", 3)  # the lease is live: kept here, committed later
            with pytest.raises(TierIOError, match="tried again in the background"):
                await a.flush()
        finally:
            server.resume()
        await a.flush()
        assert (await c.load("chat"))["turns"] == [0, 1, 2, 3]
        assert (await c.append("chat", 4))["ok"]
        assert (await c.flush())["ok"]  # (waits out A's lease: C took the conversation over)
        assert tags(await a.load("chat")) == [0, 1, 2, 3, 4]
    async with replica(server.url, prefix) as fresh:
        assert tags(await fresh.load("chat")) == [0, 1, 2, 3, 4]


class _OutageAtDelete(RedisTier):
    """A tier whose server is killed just before its first delete() (the cleanup of a
    promoted copy meets an outage)."""

    server: RedisServer | None = None

    async def delete(self, key: tuple[str, int]) -> None:
        if self.server is not None:
            await anyio.to_thread.run_sync(self.server.kill)
            self.server = None
        await super().delete(key)


async def test_case03_a_cleanup_that_met_an_outage_never_deletes_live_data_later(
    aof_server: RedisServer,
) -> None:
    """Case 3. C (exclusive mode) loads the conversation, and its cleanup of the promoted
    shared copy meets an outage (the server is killed just before it, then restarted from
    its append-only file). A takes the conversation back and appends a3; C loads it again
    and appends c4. Nothing C's cleanup left behind deletes the live history: a fresh
    replica and A load [a0, a1, a2, a3] (c4 is in C's own tier: exclusive mode), C loads
    [a0 .. a3, c4]."""
    prefix = new_prefix()
    c_tier = _OutageAtDelete(
        aof_server.url, 512 * MiB, prefix=prefix, value_size=64 << 10, lease_ttl=2.0
    )
    async with (
        replica(aof_server.url, prefix) as a,
        replica(aof_server.url, prefix, mode="exclusive", shared=c_tier) as c,
    ):
        await append(a, "chat", 0, 1, 2)
        await a.flush()
        c_tier.server = aof_server
        assert tags(await c.load("chat")) == [0, 1, 2]
        assert c.where("chat") == "host"
        await anyio.to_thread.run_sync(aof_server.start)  # from its append-only file
        assert tags(await a.load("chat")) == [0, 1, 2]
        await append(a, "chat", 3)
        await a.flush()
        assert tags(await c.load("chat")) == [0, 1, 2, 3]
        await append(c, "chat", 4)
        await c.flush()
        assert tags(await c.load("chat")) == [0, 1, 2, 3, 4]
        assert tags(await a.load("chat")) == [0, 1, 2, 3]
    async with replica(aof_server.url, prefix) as fresh:
        assert tags(await fresh.load("chat")) == [0, 1, 2, 3]


@pytest.mark.parametrize("loss", ["empty restart", "manifest evicted"])
async def test_case04_no_replica_serves_its_older_copy_once_the_server_lost_the_history(
    server: RedisServer, loss: str
) -> None:
    """Case 4. B loads [t0]; A takes the conversation back and appends t1 t2 (flushed:
    acknowledged). Then the server restarts empty, or loses the manifest (deleted, as
    maxmemory evicts it). B's load is a counted miss (stats().unproven), never its own
    [t0]; A's too (it cannot prove its copy current either: the history is gone); a fresh
    replica finds nothing."""
    prefix = new_prefix()
    async with replica(server.url, prefix) as a, replica(server.url, prefix) as b:
        await append(a, "chat", 0)
        await a.flush()
        assert tags(await b.load("chat")) == [0]
        assert tags(await a.load("chat")) == [0]
        await append(a, "chat", 1, 2)
        await a.flush()
        if loss == "empty restart":
            await anyio.to_thread.run_sync(server.restart)
        else:
            with server.client() as client:
                assert client.delete(manifest(prefix, "chat")) == 1
        with pytest.raises(SessionNotFoundError):
            await b.load("chat")
        assert (b.stats().unproven, b.stats().misses) == (1, 2)  # (its first load: a miss)
        with pytest.raises(SessionNotFoundError):
            await a.load("chat")
        assert a.stats().unproven == 1
        assert not b.contains("chat")
    async with replica(server.url, prefix, liveness=FRESH) as fresh:
        with pytest.raises(SessionNotFoundError):
            await fresh.load("chat")


@pytest.mark.parametrize("a_runs", A_RUNS)
async def test_case04c_after_an_empty_restart_an_old_writer_serves_no_older_copy(
    server: RedisServer, a_runs: str
) -> None:
    """Case 4c. A appends [t0 t1] (flushed: A writes it, its lease live); the server restarts
    empty; B's load is a counted miss, B starts the conversation afresh with t7 (flushed:
    the acknowledged history is [t7]); then the server stalls. A's load used to serve its
    own [t0 t1]: its lease lived only in the manifest the restart lost. Now A's heartbeat
    finds its liveness key gone and drops its leases, and a conversation's first commit
    waits until the server has been up a liveness period (so that a replica which could not
    beat meanwhile has stopped serving): A's load is a counted miss, whether A runs in this
    process or in its own (its heartbeat and clock another process's)."""
    async with written_by_a(server, a_runs, lease_ttl=10.0, liveness=2.0) as (a, b):
        await anyio.to_thread.run_sync(lambda: server.restart(empty=True))
        with pytest.raises(SessionNotFoundError):
            await b.load("chat")
        await append(b, "chat", 7)
        await b.flush()
        assert tags(await b.load("chat")) == [7]
        await stalled_load_is_a_miss(server, a)


@pytest.mark.parametrize("evicted", ["manifest", "liveness"])
@pytest.mark.parametrize("a_runs", A_RUNS)
async def test_case04d_on_a_server_that_evicts_no_lease_serves_a_copy_through_an_outage(
    own_redis_server: RedisServer, a_runs: str, evicted: str
) -> None:
    """Case 4d. On a server with maxmemory and an eviction policy (the how-to's
    ``allkeys-lru``), the server may forget a conversation's manifest (and the lease in it)
    or a live replica's liveness key. A appends [t0 t1] (flushed, its lease live); the
    server evicts one of them (deleted here, as eviction does); B commits t2 (after taking
    the conversation over, or afresh). Before, B's commit went through at once (a missing
    liveness key counted as a dead writer) and A, still holding its lease by its own
    clock, served [t0 t1] while the server stalled. Now a replica serves no copy of its
    own while an evicting server is away, and a takeover waits out the lease it meets;
    whether A runs in this process or in its own."""
    server = own_redis_server
    with server.client() as client:
        client.config_set("maxmemory", str(1 << 30))
        client.config_set("maxmemory-policy", "allkeys-lru")
    async with written_by_a(server, a_runs, lease_ttl=3.0, liveness=1.5) as (a, b):
        await anyio.sleep(0.6)  # a heartbeat has seen the server's policy
        prefix = a_tier(b).prefix  # (A's too)
        key = manifest(prefix, "chat") if evicted == "manifest" else f"{prefix}:live:{A_OWNER}"
        with server.client() as client:
            assert client.delete(key) == 1
        if evicted == "manifest":
            with pytest.raises(SessionNotFoundError):
                await b.load("chat")
            await append(b, "chat", 2)
            acknowledged = [2]
        else:
            assert tags(await b.load("chat")) == [0, 1]
            await append(b, "chat", 2)
            acknowledged = [0, 1, 2]
        await b.flush()
        assert tags(await b.load("chat")) == acknowledged
        await stalled_load_is_a_miss(server, a)


@pytest.mark.parametrize("r1_runs", A_RUNS)
async def test_case04e_a_look_up_the_cache_did_not_take_in_lets_no_turn_extend_another_history(
    server: RedisServer, r1_runs: str
) -> None:
    """Case 4e (CI's fleet campaign, seed 22: f0 served as [7 20 21 16], which no caller
    appended). R1 forks f0 from c0 and appends 6 (flushed: [7 5 6]); R0 takes f0 over,
    drops it and forks it again ([7 20 21], flushed). R1, which never read f0 again, takes
    c0, drops it and starts it again: refused, as a fork still lists c0's turn, but before
    that its tier looked up the forks listing c0 and so learned f0's new manifest. Once
    R0's lease has run out, R1's append to f0 (to its own [7 5 6]) used to take the lease
    with that manifest's version, and its turn 16 was committed after R0's 21. A look-up
    the cache did not take in is no proof of the history it extends: the append is a
    conflict (load first), and every replica serves [7 20 21]. R1 runs in this process,
    or in a process of its own (as the campaign's replicas do)."""
    secret = b"s" * 32
    options: dict[str, Any] = {"lease_ttl": 1.0, "secret": secret}
    prefix = new_prefix()
    r1: TieredKVCache | ReplicaProcess = (
        replica(server.url, prefix, **options)
        if r1_runs == "in-process"
        else ReplicaProcess(server.url, prefix, lease_ttl=1.0, timeout=1.0, secret=secret.hex())
    )
    async with (
        replica(server.url, prefix, **options) as r0,
        r1,
        replica(server.url, prefix, **options) as r2,
    ):
        await append(r2, "c0", 7)
        await r2.flush()
        assert await ask(r1, "load", session="c0") == {"ok": True, "turns": [7]}
        assert (await ask(r1, "append", session="f0", tag=5, parent="c0"))["ok"]
        assert (await ask(r1, "append", session="f0", tag=6))["ok"]
        assert (await ask(r1, "flush"))["ok"]
        assert tags(await r0.load("f0")) == [7, 5, 6]
        await r0.drop("f0")
        await r0.append("f0", turn(20), answer_tokens=1, parent="c0")
        await append(r0, "f0", 21)
        await r0.flush()
        assert await ask(r1, "load", session="c0") == {"ok": True, "turns": [7]}
        assert (await ask(r1, "drop", session="c0"))["ok"]
        refused = await ask(r1, "append", session="c0", tag=15)
        assert refused.get("error") == "InvalidArgumentError", refused
        assert "forks still list its history" in refused["message"]
        await anyio.sleep(1.2)  # R0's lease on f0 runs out
        conflict = await ask(r1, "append", session="f0", tag=16)
        assert conflict.get("error") == "HistoryConflictError", conflict
        assert "which this replica has not read" in conflict["message"]
        assert (await ask(r1, "flush"))["ok"]
        assert await ask(r1, "load", session="f0") == {"ok": True, "turns": [7, 20, 21]}
        for r in (r0, r2):
            assert tags(await r.load("f0")) == [7, 20, 21]


@asynccontextmanager
async def written_by_a(
    server: RedisServer, a_runs: str, *, lease_ttl: float, liveness: float
) -> AsyncIterator[tuple[TieredKVCache | ReplicaProcess, TieredKVCache]]:
    """Replicas A (owner :data:`A_OWNER`; in this process, or with ``a_runs`` "own process"
    in a :class:`tests.fleet.ReplicaProcess`, with :func:`tier`'s timeout) and B (in this
    process) on a new prefix (with a secret: no settling wait), A having appended [t0 t1]
    to "chat" and flushed it (A writes it, its lease live)."""
    prefix = new_prefix()
    secret = b"s" * 32
    options: dict[str, Any] = {"lease_ttl": lease_ttl, "liveness": liveness, "secret": secret}
    a: TieredKVCache | ReplicaProcess
    if a_runs == "in-process":
        a = replica(server.url, prefix, owner=A_OWNER, **options)
    else:
        redis = {"liveness": liveness, "owner": A_OWNER}
        a = ReplicaProcess(
            server.url, prefix, lease_ttl=lease_ttl, timeout=1.0, secret=secret.hex(), redis=redis
        )
    async with a, replica(server.url, prefix, **options) as b:
        for tag in (0, 1):
            assert (await ask(a, "append", session="chat", tag=tag))["ok"]
        assert (await ask(a, "flush"))["ok"]
        yield a, b


async def ask(r: TieredKVCache | ReplicaProcess, op: str, **args: Any) -> dict[str, Any]:
    """One of :mod:`tests.fleet_replica`'s commands to replica ``r``, in this process or
    in its own: its answer either way (what it raised as ``{"ok": False, "error": ...}``)."""
    if isinstance(r, ReplicaProcess):
        return await r.call(op, **args)
    return await fleet_replica.answer(r, {"op": op, **args})


async def stalled_load_is_a_miss(server: RedisServer, a: TieredKVCache | ReplicaProcess) -> None:
    """With the server stalled (SIGSTOP), A's load of "chat" is a counted miss (A in this
    process, or in its own)."""
    server.pause()
    try:
        answer = await ask(a, "load", session="chat")
        assert answer.get("error") == "SessionNotFoundError", answer
    finally:
        server.resume()
    assert (await ask(a, "stats"))["unproven"] == 1


def a_tier(cache: TieredKVCache) -> RedisTier:
    """``cache``'s Redis tier."""
    [shared] = [t for t in cache.tiers if isinstance(t, RedisTier)]
    return shared


def _forged(value: bytes, tag: int) -> bytes:
    """The first value of a one-value segment of :func:`tests.fleet.turn`, with its first
    turn element changed to ``tag`` and its unkeyed checks (xxh3, CRC) made right again, as
    any client of the server can."""
    data = bytearray(value)
    header, _ = parse_header(bytes(data), "stored")
    k = next(spec for spec in header.tensors if spec.name == "k")
    at = header.body_offset + k.offset
    data[at : at + 4] = tag.to_bytes(4, "little", signed=True)
    start = hashed_from(bytes(data))
    _pack_prefix(data, bytes(data[PREFIX.size : start]), hash_body(bytes(data[start:])))
    return bytes(data)


def _forge_and_shorten(server: RedisServer, prefix: str) -> None:
    """As another client of the server: forge turn 1 of "forged" (see :func:`_forged`), and
    remove the last entry of the manifest of "short"."""
    with server.client() as client:
        tag = conversation_tag("forged")
        [part] = list(client.scan_iter(match=f"{prefix}:{{{tag}}}:1:*"))
        value = client.get(part)
        assert value is not None
        client.set(part, _forged(value, 77))
        m = manifest(prefix, "short")
        client.hdel(m, "e:2", "k:2")
        client.hset(m, "n", "2")


async def test_case05_with_a_secret_a_forged_value_or_a_shortened_manifest_is_refused(
    server: RedisServer,
) -> None:
    """Case 5. With RedisTier(secret=...): a value rewritten with its xxh3 and CRC
    recomputed (no secret) is never served, nor is a manifest with its last entry removed
    (2 of 3 turns as if whole): each load is a miss, and fsck names the damage."""
    prefix, secret = new_prefix(), os.urandom(32)
    async with replica(server.url, prefix, secret=secret) as a:
        await append(a, "forged", 0, 1, 2)
        await append(a, "short", 0, 1, 2)
        await a.flush()
    _forge_and_shorten(server, prefix)
    async with replica(server.url, prefix, secret=secret) as b:
        for session in ("forged", "short"):
            with pytest.raises(SessionNotFoundError):
                await b.load(session)
        # the damaged manifest found at open and at the load, and the forged value
        assert b.tiers[1].stats().corrupt == 3
    with server.client() as client:  # (a replica without the secret is refused otherwise)
        client.delete(f"{prefix}:auth")
    async with replica(server.url, prefix) as unkeyed:  # what the MAC is for
        assert tags(await unkeyed.load("short")) == [0, 1]


async def test_fsck_checks_a_redis_prefix(
    server: RedisServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tieredkv fsck URL --prefix P [--secret-file F]``: exit status 0 and "clean" for a
    prefix whose histories verify; 1 and each damaged manifest or segment named, with why,
    once a value is forged and a manifest shortened; 2 without --prefix or with --repair."""
    prefix, secret = new_prefix(), os.urandom(32)
    (tmp_path / "secret").write_bytes(secret)
    async with replica(server.url, prefix, secret=secret) as a:
        await append(a, "forged", 0, 1, 2)
        await append(a, "short", 0, 1, 2, tokens=8192)  # 2 MiB turns: 33 values each
        await a.flush()
    argv = ["fsck", server.url, "--prefix", prefix, "--secret-file", str(tmp_path / "secret")]
    assert await anyio.to_thread.run_sync(cli.main, argv) == 0
    out = capsys.readouterr().out
    assert "6 good segment(s) in 2 conversation(s)" in out
    assert out.rstrip().endswith("clean")
    _forge_and_shorten(server, prefix)
    assert await anyio.to_thread.run_sync(cli.main, argv) == 1
    out = capsys.readouterr().out
    assert f"damaged: {manifest(prefix, 'forged')} segment 1: " in out
    assert f"damaged: {manifest(prefix, 'short')}: manifest MAC mismatch" in out
    assert "33 leaked value(s)" in out  # the removed entry's values: nothing names them
    assert out.rstrip().endswith("NOT clean")
    assert await anyio.to_thread.run_sync(cli.main, ["fsck", server.url]) == 2
    assert await anyio.to_thread.run_sync(cli.main, [*argv, "--repair"]) == 2


# -- acknowledged turns lost, silently ------------------------------------------------------


async def test_case06_a_turn_refused_in_the_background_is_reported_never_lost_silently(
    server: RedisServer,
) -> None:
    """Case 6. A appends t0 and flushes, then appends a 64 MiB t1; while its write-through
    is still running, B (another process) loads the conversation, taking it over. The
    server refuses A's commit: A.flush() raises TurnRefusedError naming turn 1, once;
    stats().refused is 1, a Refused event says which turn, and no task exception is left
    unretrieved. A's next load serves B's history [t0]."""
    prefix = new_prefix()
    events: list[Event] = []
    async with (
        no_lost_task_exceptions(),
        ReplicaProcess(server.url, prefix, lease_ttl=0.5) as b,
        replica(server.url, prefix, host=256 * MiB, lease_ttl=0.5, timeout=10.0) as a,
    ):
        a.channel.subscribe(events.append)
        await append(a, "chat", 0)
        await a.flush()
        await append(a, "chat", 1, tokens=256 * 1024)  # 64 MiB: its write-through takes a while
        assert (await b.load("chat"))["turns"] == [0]
        with pytest.raises(TurnRefusedError, match=r"session 'chat' turn\(s\) 1 ") as info:
            await a.flush()
        assert info.value.refusals == [("chat", [1])]
        await a.flush()  # reported once
        assert a.stats().refused == 1
        assert [(e.session, e.turns) for e in events if isinstance(e, Refused)] == [("chat", (1,))]
        scraped = {
            sample.name: sample.value
            for metric in CacheCollector(a).collect()
            for sample in metric.samples
        }
        assert scraped["tieredkv_refused_total"] == 1
        assert tags(await a.load("chat")) == [0]


async def test_case06b_a_drop_that_fails_keeps_a_reported_refusal_reported_once(
    server: RedisServer, tmp_path: Path
) -> None:
    """Case 6b. As in case 6, A's turn 1 is refused once B takes the conversation over,
    and A's flush() reports it. A fork here lists the conversation's turn 0, so dropping it
    writes a retirement marker first; that write fails (EIO on the SSD tier), and the drop
    does nothing. The refusal must stay reported: no second TurnRefusedError, count, log or
    event for the same turn. Before, the drop forgot the refusal when it stopped the
    conversation's background copy; the copy restarted, was refused again, and the turn
    was reported (and counted) twice."""
    prefix = new_prefix()
    marker = segment_file_name(("chat", RETIRED_SEQ)).split("/")[-1]
    shared = tier(server.url, prefix, lease_ttl=0.5, timeout=10.0)
    tiers = [HostMemoryTier(256 * MiB), SSDTier(tmp_path / "ssd", 512 * MiB), shared]
    async with (
        no_lost_task_exceptions(),
        ReplicaProcess(server.url, prefix, lease_ttl=0.5) as b,
        TieredKVCache(tiers, mode="inclusive") as a,
    ):
        await append(a, "chat", 0)
        await a.append("f", turn(5), answer_tokens=1, parent="chat")  # f lists turn 0
        await a.flush()
        await append(a, "chat", 1, tokens=256 * 1024)  # 64 MiB: its write-through takes a while
        assert (await b.load("chat"))["turns"] == [0]
        with pytest.raises(TurnRefusedError, match=r"session 'chat' turn\(s\) 1 "):
            await a.flush()
        with FaultInjector() as faults:
            faults.fail_matching("open", marker)
            with pytest.raises(TierIOError, match="injected"):
                await a.drop("chat")
            assert faults.total_injected == 1
        assert a.contains("chat")
        await a.flush()  # reported once
        assert a.stats().refused == 1
        assert tags(await a.load("chat")) == [0]
        assert tags(await a.load("f")) == [0, 5]


async def test_a_pin_on_a_conversation_another_replica_grew_past_the_bound_is_released(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A pins a one-turn conversation under a group's bound of two and a half turns; B
    takes it over and appends three turns. A's next load adopts B's history, past the
    bound: A releases the pin (logged) in the metadata it publishes with the new size, as
    if A's own append had grown it. Before, the pin carried over to the grown history."""
    prefix = new_prefix()
    a_tiers = [HostMemoryTier(64 * MiB), tier(server.url, prefix, lease_ttl=0.3)]
    async with (
        replica(server.url, prefix, lease_ttl=0.3) as b,
        TieredKVCache(a_tiers, mode="inclusive") as a,
    ):
        one = (await a.append("chat", turn(0), answer_tokens=1)).nbytes
        a.max_pinned_bytes_per_group = 5 * one // 2
        await a.flush()
        assert a.hint("chat", RetentionHint(pin=True, group="tenant-a")).pin_group == "tenant-a"
        assert tags(await b.load("chat")) == [0]
        await append(b, "chat", 1, 2, 3)
        await b.flush()
        with caplog.at_level(logging.WARNING, logger="tieredkv.cache"):
            assert tags(await a.load("chat")) == [0, 1, 2, 3]
        meta = a.channel["chat"]
        assert meta.nbytes == 4 * one
        assert (meta.pinned_until, meta.pin_group) == (None, None)
        assert dict(a.channel.pins) == {}
        assert any(
            f"conversation 'chat' grew to {4 * one} bytes: the pinned bytes of group "
            f"'tenant-a' ({4 * one}) passed max_pinned_bytes_per_group" in r.getMessage()
            for r in caplog.records
        )


class _ExpectsChat(LRU):
    """LRU that expects conversation ``chat`` back (a Foresight: predictive prefetch asks
    it which lower-tier conversation to bring up)."""

    def foresee(self, session: str) -> float | None:
        return 1.0 if session == "chat" else 0.01


async def test_a_predicted_prefetch_takes_in_what_another_replica_committed_first(
    server: RedisServer,
) -> None:
    """B holds chat's two turns in the shared tier only (host memory went to other
    conversations); A appends a third and commits it. B's prefetch_predicted brings chat
    up, and what it brings up is the committed history, three turns, as the channel then
    says. Before, it promoted the two turns B knew of (reading them for nothing) and the
    channel said chat was in host memory with two turns: a scheduler reading it took the
    next load for a host hit, and that load then read the shared tier on the turn's path."""
    prefix = new_prefix()
    b_tiers = [HostMemoryTier(256 << 10), tier(server.url, prefix, lease_ttl=0.3)]
    async with (
        replica(server.url, prefix, lease_ttl=0.3) as a,
        TieredKVCache(b_tiers, mode="inclusive", eviction=[_ExpectsChat(), LRU()]) as b,
    ):
        await append(a, "chat", 0)
        await a.flush()
        assert tags(await b.load("chat")) == [0]
        await append(b, "chat", 1)
        await b.flush()
        for i in range(6):  # 64 KiB each: chat leaves host memory
            await append(b, f"other{i}", 10 + i, tokens=256)
        await b.flush()
        assert b.where("chat") == "redis"
        await anyio.sleep(0.4)  # B's lease has run out
        assert tags(await a.load("chat")) == [0, 1]
        await append(a, "chat", 2)
        await a.flush()
        assert await b.prefetch_predicted() == ["chat"]
        meta = b.channel["chat"]
        assert (meta.tier, meta.turns) == ("host", 3)
        assert tags(await b.load("chat")) == [0, 1, 2]


async def _second_turn_lost(
    server: RedisServer, prefix: str, b: TieredKVCache, *, host_to_others: bool = False
) -> None:
    """B commits chat's two turns (then, with ``host_to_others``, appends other
    conversations that take its host memory); the server then loses the second turn's
    commit, as an AOF restart loses its last second of writes: chat's manifest is the
    one-turn history again."""
    await append(b, "chat", 0)
    await b.flush()
    with server.client() as c:
        one_turn = c.dump(manifest(prefix, "chat"))
    await append(b, "chat", 1)
    for i in range(6 if host_to_others else 0):  # 64 KiB each
        await append(b, f"other{i}", 10 + i, tokens=256)
    await b.flush()
    with server.client() as c:
        c.restore(manifest(prefix, "chat"), 0, one_turn, replace=True)


async def test_a_turn_the_server_lost_after_a_conflict_is_a_miss_never_read_from_there(
    server: RedisServer,
) -> None:
    """B commits chat's two turns, then keeps them in the shared tier only (host memory
    went to other conversations). The server loses the second turn's commit (as an AOF
    restart loses its last second of writes): its manifest is the one-turn history again.
    B's next turn is refused as a conflict, and B's tier forgets the version it knew, so
    the next load cannot tell the older history for a loss. That load is a counted miss,
    as any loss of committed turns is (it used to keep serving from the shared tier, which
    lacks the second turn: a ``KeyError`` out of ``load``); the next one serves the
    committed turn."""
    prefix = new_prefix()
    b_tiers = [HostMemoryTier(256 << 10), tier(server.url, prefix)]
    async with TieredKVCache(b_tiers, mode="inclusive") as b:
        await _second_turn_lost(server, prefix, b, host_to_others=True)
        assert b.where("chat") == "redis"
        with pytest.raises(HistoryConflictError):
            await append(b, "chat", 2)
        lost = b.stats().lost
        with pytest.raises(SessionNotFoundError, match="lost its history"):
            await b.load("chat")
        assert b.stats().lost == lost + 1
        assert tags(await b.load("chat")) == [0]


async def test_a_committed_turn_the_server_lost_is_reported_with_the_refused_one(
    server: RedisServer,
) -> None:
    """B commits chat's two turns and keeps them in host memory; the server loses the
    second turn's commit (its manifest is the one-turn history again). B's third turn is
    refused as a conflict, and the refusal names the lost second turn too (it used to name
    the third only, and the next load served the one turn left: an acknowledged turn gone
    with nothing said)."""
    prefix = new_prefix()
    b_tiers = [HostMemoryTier(8 * MiB), tier(server.url, prefix)]
    async with TieredKVCache(b_tiers, mode="inclusive") as b:
        await _second_turn_lost(server, prefix, b)
        await append(b, "chat", 2)
        with pytest.raises(TurnRefusedError, match=r"session 'chat' turn\(s\) 1, 2 "):
            await b.flush()
        assert b.stats().refused == 2
        assert tags(await b.load("chat")) == [0]


async def test_a_turn_that_moves_its_history_past_ssd_goes_where_the_history_went(
    server: RedisServer, tmp_path: Path
) -> None:
    """B's chat fills its host memory, and its SSD (the tier below) is too small to hold a
    copy of it; its turns are committed. Its next turn does not fit in host memory: chat
    moves down whole, past SSD, into the shared tier that holds all of it, and the turn
    is stored there too (it used to go into SSD, above the history: a history split
    across two tiers, which no load could serve: a ``KeyError`` in fleet campaign seed
    328, later a counted loss of an acknowledged turn; seen again at seed 2438)."""
    prefix = new_prefix()
    ssd = SSDTier(tmp_path / "ssd", 128 << 10)
    b_tiers = [HostMemoryTier(256 << 10), ssd, tier(server.url, prefix)]
    async with TieredKVCache(b_tiers, mode="inclusive") as b:
        for i in range(3):  # 64 KiB each
            await append(b, "chat", i, tokens=256)
        await b.flush()
        await append(b, "chat", 3, tokens=256)
        await b.flush()
        assert b.where("chat") == "redis"
        assert tags(await b.load("chat"), tokens=256) == [0, 1, 2, 3]
        async with replica(server.url, prefix) as a:
            assert tags(await a.load("chat"), tokens=256) == [0, 1, 2, 3]


class _FailsOnce(SSDTier):
    """An SSD tier whose first write fails with an error no tier raises (a bug)."""

    failed = False

    async def write(self, key: SegmentKey, data: memoryview) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("a bug in a local copy")
        await super().write(key, data)


async def test_a_local_copy_that_fails_unexpectedly_leaves_the_commit_to_be_done(
    server: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """B's background copy of chat's turn into SSD (the tier below host memory) fails with
    an unexpected error, logged. The turn's commit into the shared tier, which the same
    copy was to make next, is not taken for done: ``flush()`` reports it not committed,
    the commit is tried again, and the next ``flush()`` returns once it is made (the
    first used to return at once, the turn never committed, and another replica was not
    served it)."""
    prefix = new_prefix()
    ssd = _FailsOnce(tmp_path / "ssd", 8 * MiB)
    b_tiers = [HostMemoryTier(8 * MiB), ssd, tier(server.url, prefix)]
    async with TieredKVCache(b_tiers, mode="inclusive") as b:
        await append(b, "chat", 0)
        with (
            caplog.at_level(logging.ERROR, "tieredkv.cache"),
            pytest.raises(TierIOError, match="a bug in a local copy"),
        ):
            await b.flush()
        assert ssd.failed
        assert "write-through of 'chat' failed" in caplog.text
        await b.flush()
        async with replica(server.url, prefix) as a:
            assert tags(await a.load("chat")) == [0]


class _GatedHost(HostMemoryTier):
    """Host memory whose next delete, once :attr:`armed`, waits for :attr:`go`
    (:attr:`reached` says it does)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.armed = False
        self.reached = anyio.Event()
        self.go = anyio.Event()

    async def delete(self, key: SegmentKey) -> None:
        if self.armed:
            self.armed = False
            self.reached.set()
            await self.go.wait()
        await super().delete(key)


async def test_no_commit_starts_while_a_load_reconciles_the_conversation(
    server: RedisServer,
) -> None:
    """B's commit of chat's second turn waits to be tried again (the server was stopped);
    the server then loses chat's manifest. B's load finds the history lost and lets go of
    B's copies; while it does, a ``flush()`` asks for the waiting commit. The commit waits
    for the load (it used to start at once, reading the copies the load was removing and
    writing into the shared tier the load had just read: refused, or a ``ValueError`` when
    the copy it read was gone first), and then finds nothing left to commit: the load is
    the counted miss, the flush returns, and nothing was refused."""
    prefix = new_prefix()
    host = _GatedHost(8 * MiB)
    async with TieredKVCache([host, tier(server.url, prefix, timeout=0.3)], mode="inclusive") as b:
        await append(b, "chat", 0)
        await b.flush()
        errors = b.stats().errors
        server.pause()
        try:
            await append(b, "chat", 1)
            for _ in range(1000):  # polled: the commit runs in the background
                if b.stats().errors > errors:
                    break
                await anyio.sleep(0.01)
        finally:
            server.resume()
        with server.client() as c:
            c.delete(manifest(prefix, "chat"))
        host.armed = True
        with anyio.fail_after(30):  # (it used to hang here, too)
            async with anyio.create_task_group() as tg:

                async def load() -> None:
                    with pytest.raises(SessionNotFoundError, match="lost its history"):
                        await b.load("chat")

                tg.start_soon(load)
                with anyio.fail_after(10):
                    await host.reached.wait()
                tg.start_soon(b.flush)
                await anyio.sleep(0.3)  # (the flush asked for the commit meanwhile)
                host.go.set()
        assert b.stats().refused == 0
        assert not b.contains("chat")


@pytest.mark.parametrize("how", ["waits", *CANCELS])
async def test_a_load_while_the_conversation_is_dropped_here_is_a_miss_once_dropped(
    server: RedisServer, tmp_path: Path, how: str
) -> None:
    """B (host, SSD, Redis) drops chat; while B still deletes its file in SSD (the shared
    copy is discarded after it), B loads chat. The load waits for the drop and misses
    (``waits``), or is cancelled while it waits (each way users cancel); either way chat
    stays dropped on B and on the server, and can be stored again. The load used to take
    the shared copy in as a new conversation and serve it, and the background copy into
    SSD found the dropped turn's file still there (a ``ValueError``, logged; fleet campaign
    seed 2436); the drop then discarded the shared copy, and B went on listing the
    dropped conversation."""
    prefix = new_prefix()
    ssd = PausingSSD(tmp_path / "ssd", ("chat", 0), op="delete")  # (its delete waits)
    b_tiers = [HostMemoryTier(8 * MiB), ssd, tier(server.url, prefix)]
    async with TieredKVCache(b_tiers, mode="inclusive") as b:
        await append(b, "chat", 0)
        await b.flush()
        loaded: list[object] = []

        async def load() -> None:
            try:
                loaded.append(tags(await b.load("chat")))
            except SessionNotFoundError:
                loaded.append("miss")

        async with anyio.create_task_group() as tg:
            tg.start_soon(b.drop, "chat")
            try:
                with anyio.fail_after(10):
                    await ssd.reached.wait()
                if how == "waits":
                    tg.start_soon(load)
                    await anyio.sleep(0.1)
                else:
                    done, _ = await cancellable(how, 0.1, load)
                    assert not done  # (cancelled while it waited)
                assert loaded == []  # (it waits for the drop)
            finally:
                ssd.go.set()
        assert loaded == (["miss"] if how == "waits" else [])
        await b.flush()
        assert b.stats().errors == 0
        assert not b.contains("chat")
        assert [t.segments for t in b.stats().tiers] == [0, 0, 0]
        async with replica(server.url, prefix) as a:
            with pytest.raises(SessionNotFoundError):
                await a.load("chat")
        await append(b, "chat", 5)
        await b.flush()
    async with replica(server.url, prefix) as a:
        assert tags(await a.load("chat")) == [5]


async def test_case07_a_turn_that_did_not_reach_the_shared_tier_is_never_reported_flushed(
    server: RedisServer,
) -> None:
    """Case 7. A appends t0 and flushes. While the server refuses writes (out of memory:
    maxmemory 1 byte, noeviction), A appends t1: the append returns (A's lease is live), but
    flush() raises TierIOError instead of returning as if t1 were committed, and B still
    loads [t0]. Once the server takes writes again, A's flush() commits t1 and B loads
    [t0, t1]."""
    prefix = new_prefix()
    async with replica(server.url, prefix, lease_ttl=10.0) as a:
        await append(a, "chat", 0)
        await a.flush()
        with server.client() as client:
            client.config_set("maxmemory", "1")
        try:
            await append(a, "chat", 1)
            with pytest.raises(TierIOError, match="tried again in the background"):
                await a.flush()
        finally:
            with server.client() as client:
                client.config_set("maxmemory", "0")
        await a.flush()
    async with replica(server.url, prefix) as b:
        assert tags(await b.load("chat")) == [0, 1]


# -- errors outside the contract ------------------------------------------------------------


@pytest.mark.parametrize("fault", ["kill", "stall"])
async def test_case08_a_server_lost_during_a_multi_batch_read_is_a_tier_error(
    server: RedisServer, fault: str
) -> None:
    """Case 8. The server killed (or stalled past the timeout) while a 32 MiB history is
    read in many pipelined batches: the read raises TierIOError, never a raw
    ExceptionGroup, whatever batch it hit (several moments tried)."""
    prefix = new_prefix()
    async with replica(server.url, prefix) as a:
        await append(a, "chat", 0, 1, 2, 3, tokens=32 * 1024)  # 4 x 8 MiB
        await a.flush()
    failures = 0
    for delay in (0.002, 0.01, 0.03):
        if server.proc is None:
            server.start()
            async with replica(server.url, prefix, liveness=FRESH) as a:
                await append(a, "chat", 0, 1, 2, 3, tokens=32 * 1024)
                await a.flush()
        async with tier(server.url, prefix, timeout=0.5, read_batch=2, liveness=FRESH) as t:
            keys = [("chat", seq) for seq in range(4)]
            bufs = [bytearray(t.length(key)) for key in keys]
            cut = threading.Timer(delay, server.kill if fault == "kill" else server.pause)
            cut.start()
            try:
                await t.read(keys, [memoryview(buf) for buf in bufs])
            except TierIOError:
                failures += 1
            finally:
                cut.join()
                if fault == "stall":
                    server.resume()
    assert failures >= 1


async def test_case09_making_room_never_fails_because_of_another_conversations_lease(
    server: RedisServer,
) -> None:
    """Case 9. A's host tier holds one conversation. A holds X with turn 1 not committed
    yet (A took X over from C, whose lease is live, so A's commit waits) when B, another
    process, takes X over. A's load of Y must evict X, whose write to the shared tier is
    refused (B is X's writer): load(Y) still succeeds; X's turn 1 is reported as refused,
    and A's next load of X serves B's history [x0]."""
    prefix = new_prefix()
    big = 16 * 1024  # 4 MiB turns
    async with (
        replica(server.url, prefix, lease_ttl=3.0) as c,
        ReplicaProcess(server.url, prefix, lease_ttl=3.0) as b,
        replica(server.url, prefix, host=9 * MiB, lease_ttl=3.0) as a,
    ):
        await append(c, "Y", 50, tokens=big)
        await append(c, "X", 0, tokens=big)
        await c.flush()
        assert tags(await a.load("X"), big) == [0]  # A takes X over: commits wait for C's lease
        await append(a, "X", 1, tokens=big)
        assert (await b.load("X", tokens=big))["turns"] == [0]  # B takes X over from A
        assert tags(await a.load("Y"), big) == [50]
        assert a.where("Y") == "host"
        with pytest.raises(TurnRefusedError, match=r"session 'X' turn\(s\) 1 "):
            await a.flush()
        assert tags(await a.load("X"), big) == [0]


async def test_case09b_a_turn_whose_key_a_fork_keeps_is_refused_with_a_clear_error(
    server: RedisServer,
) -> None:
    """Case 9b. A takes X over from C (C's lease is live, so A's commits wait), appends x1
    and forks F from X's whole history [x0, x1]; B, another process, takes X over with a
    longer lease, so the server refuses x1 and F, which lists it. A loads X again: B's [x0],
    shorter than what F lists. A's next turn of X would be turn 1, whose key F still holds
    here: the append is refused with InvalidArgumentError (not a bare ValueError from the
    host tier), storing nothing. Once F is dropped, the turn is stored and every replica
    loads [x0, x2]."""
    prefix = new_prefix()
    async with (
        replica(server.url, prefix, lease_ttl=1.0) as c,
        ReplicaProcess(server.url, prefix, lease_ttl=6.0) as b,
        replica(server.url, prefix, lease_ttl=1.0) as a,
    ):
        await append(c, "X", 0)
        await c.flush()
        assert tags(await a.load("X")) == [0]  # A takes X over: commits wait for C's lease
        await append(a, "X", 1)
        await a.append("F", turn(5), answer_tokens=1, parent="X")
        assert (await b.load("X"))["turns"] == [0]  # B takes X over from A
        refused: dict[str, list[int]] = {}
        with anyio.fail_after(30):  # (flush waits for C's lease, then hears B holds X)
            while "X" not in refused or "F" not in refused:
                try:
                    await a.flush()
                except TurnRefusedError as exc:
                    refused.update(exc.refusals)
                else:
                    await anyio.sleep(0.1)
        assert refused == {"X": [1], "F": [1, 2]}
        assert tags(await a.load("X")) == [0]
        with pytest.raises(InvalidArgumentError, match="forks still list its history"):
            await append(a, "X", 2)
        assert tags(await a.load("X")) == [0]
        await a.drop("F")
        await append(a, "X", 2)
        await a.flush()
        assert tags(await a.load("X")) == [0, 2]
    async with replica(server.url, prefix) as fresh:
        assert tags(await fresh.load("X")) == [0, 2]


async def test_case10_garbage_in_the_manifest_is_a_typed_error_or_a_counted_miss(
    server: RedisServer,
) -> None:
    """Case 10. Another client writes garbage into a manifest. A garbage fence: the writer's
    next append raises StaleWriterError (not a bare ValueError) and the history is still
    served (a load takes the conversation over with a new token). A garbage version: the
    history cannot be trusted, so a load is a counted miss."""
    prefix = new_prefix()
    async with replica(server.url, prefix) as a, replica(server.url, prefix) as b:
        await append(a, "chat", 0)
        await append(a, "other", 0)
        await a.flush()
        with server.client() as client:
            client.hset(manifest(prefix, "chat"), "fence", "garbage")
            client.hset(manifest(prefix, "other"), "v", "not a number")
        with pytest.raises(StaleWriterError):
            await append(a, "chat", 1)
        assert tags(await b.load("chat")) == [0]
        await append(b, "chat", 1)
        await b.flush()
        assert tags(await a.load("chat")) == [0, 1]
        with pytest.raises(SessionNotFoundError):
            await b.load("other")
        assert b.stats().unproven == 1


async def test_case11_a_restart_is_transparent_and_an_owner_serves_through_an_outage(
    aof_server: RedisServer,
) -> None:
    """Case 11. After the server restarts (from its append-only file), the first calls on
    every pooled connection succeed (each command is retried once the connection drops).
    While the server is down, B, the writer of eight conversations (it loaded them last;
    its lease is live) with them in its host tier, serves every load of them, and so does
    A, whose lease B took over (B may not commit before that lease has ended, so A's copies
    are current too). Once the leases have run out by each replica's own clock, both count
    misses; when the server is back, both load again."""
    prefix = new_prefix()
    sessions = [f"user-{i}" for i in range(8)]
    lease = 6.0
    async with (
        replica(aof_server.url, prefix, lease_ttl=lease, liveness=lease, timeout=0.3) as a,
        replica(aof_server.url, prefix, lease_ttl=lease, liveness=lease, timeout=0.3) as b,
    ):
        for i, session in enumerate(sessions):
            await append(a, session, i)
        await a.flush()

        async def load_all(cache: TieredKVCache) -> list[list[int]]:
            out: list[list[int]] = [[] for _ in sessions]

            async def one(i: int) -> None:
                out[i] = tags(await cache.load(sessions[i]))

            async with anyio.create_task_group() as tg:  # concurrent: every pooled connection
                for i in range(len(sessions)):
                    tg.start_soon(one, i)
            return out

        everything = [[i] for i in range(8)]
        assert await load_all(a) == everything
        await anyio.to_thread.run_sync(aof_server.restart)
        assert await load_all(a) == everything
        assert await load_all(b) == everything  # B takes them all over
        taken = anyio.current_time()
        await anyio.to_thread.run_sync(aof_server.kill)
        for _ in range(3):
            assert await load_all(b) == everything
        # A's lease from its loads is live too, and B's takeover delays B's first commit to
        # its end: no replica can have committed since, so A's copies are current as well
        assert await load_all(a) == everything
        await anyio.sleep(max(0.0, taken + lease - anyio.current_time()))  # both leases over
        for cache in (a, b):
            for session in sessions[:2]:
                with pytest.raises(SessionNotFoundError):
                    await cache.load(session)
            assert cache.stats().unproven == 2
        await anyio.to_thread.run_sync(aof_server.start)
        assert await load_all(a) == everything
        assert await load_all(b) == everything


async def test_every_failure_a_caller_sees_is_a_tieredkv_error(server: RedisServer) -> None:
    """I4: against a killed server, every call a replica makes fails with a TieredKVError
    subclass (or misses) saying what to do; none raises a client library's exception."""
    prefix = new_prefix()
    async with replica(server.url, prefix, lease_ttl=0.2, timeout=0.3) as a:
        await append(a, "chat", 0)
        await a.flush()
        await anyio.to_thread.run_sync(server.kill)
        await anyio.sleep(0.3)  # the lease has run out too
        for call in (
            lambda: a.load("chat"),
            lambda: append(a, "chat", 1),
            lambda: append(a, "new", 0),
            lambda: a.prefetch("chat"),
            lambda: a.discover("chat"),
            lambda: a.flush(),
        ):
            error: BaseException | None = None
            try:
                await call()
            except Exception as exc:
                error = exc
            assert error is None or (isinstance(error, TieredKVError) and str(error)), repr(error)
