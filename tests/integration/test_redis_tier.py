"""RedisTier against a real redis-server: layout, faults, eviction, leases and fencing.

The tier contract (tests/contract/test_tier_contract.py) covers the protocol; these tests
cover what only a shared, remote tier has: values split into parts under one hash tag,
the server losing or altering data, the server going away, and two replicas on one
conversation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import anyio
import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from tests.redis_server import RedisServer, new_prefix, own_redis_server, redis_server
from tests.segments import SegmentFactory, read_back, store
from tieredkv import HostMemoryTier, TieredKVCache
from tieredkv.backends.redis import RedisTier, conversation_tag, driver_options
from tieredkv.errors import (
    CommitDelayedError,
    CorruptSegmentError,
    HistoryConflictError,
    LeaseHeldError,
    StaleWriterError,
    TierIOError,
)

__all__ = ["own_redis_server", "redis_server"]  # fixtures used below

CAPACITY = 64 << 20
SMALL_VALUES = 64 << 10  # a 2 MiB segment is 32 values
FRESH = 1.0
"""``liveness`` of a tier opened on a server just started or restarted, in tests that do not
depend on it: it opens once the server has been up 3 s (thrice this), not 9."""


@pytest.fixture
def prefix() -> str:
    return new_prefix()


def _replica(server: RedisServer, prefix: str, name: str) -> RedisTier:
    return RedisTier(server.url, CAPACITY, prefix=prefix, value_size=SMALL_VALUES, name=name)


@pytest.fixture
async def tier(redis_server: RedisServer, prefix: str) -> AsyncIterator[RedisTier]:
    async with _replica(redis_server, prefix, "A") as t:
        yield t


@pytest.fixture
async def peer(redis_server: RedisServer, prefix: str) -> AsyncIterator[RedisTier]:
    """A second replica's tier on the same server and prefix."""
    async with _replica(redis_server, prefix, "B") as t:
        yield t


def _keys(server: RedisServer, prefix: str) -> list[str]:
    """The conversations' keys under ``prefix`` (not the replicas' liveness keys)."""
    with server.client() as c:
        return sorted(k.decode() for k in c.scan_iter(match=f"{prefix}:{{*"))


async def test_segment_is_split_into_values_under_one_hash_tag(
    tier: RedisTier, redis_server: RedisServer, prefix: str, seg: SegmentFactory
) -> None:
    """A 2 MiB segment becomes 32 values of 64 KiB (the last shorter), all in the
    conversation's Cluster slot, permanent once published; it reads back byte for byte."""
    s = seg(session="a }{ weird\x00key", tokens=8000, seed=1)
    await store(tier, s)
    assert await read_back(tier, s) == s.data
    tag = conversation_tag(s.key[0])
    keys = _keys(redis_server, prefix)
    parts = [k for k in keys if k.startswith(f"{prefix}:{{{tag}}}:0:")]
    assert len(parts) == -(-s.length // SMALL_VALUES) == 32
    assert set(keys) == {*parts, f"{prefix}:{{{tag}}}:m"}  # the lease is in the manifest
    assert {key_slot(k.encode()) for k in keys} == {key_slot(tag.encode())}
    with redis_server.client() as c:
        stored = b"".join(
            c.get(f"{parts[0].rsplit(':', 1)[0]}:{i}") or b"" for i in range(len(parts))
        )
        assert stored == s.data
        assert all(c.pttl(p) == -1 for p in parts)  # published: no expiry


async def test_unreachable_server_is_a_clear_error_naming_the_url() -> None:
    """open() on a port where nothing listens raises TierIOError naming the URL (without
    the password it carries)."""
    t = RedisTier("redis://:hunter2@127.0.0.1:1/0", CAPACITY, timeout=2)
    with pytest.raises(TierIOError, match=r"connect to redis://:\*\*\*@127\.0\.0\.1:1/0") as info:
        await t.open()
    assert "hunter2" not in str(info.value)


def test_bad_arguments_are_refused() -> None:
    """A URL of another scheme, a value size that is not whole pages, a prefix with glob or
    hash-tag characters: ValueError saying what to pass."""
    with pytest.raises(ValueError, match="redis://"):
        RedisTier("http://localhost:6379", CAPACITY)
    with pytest.raises(ValueError, match="value_size"):
        RedisTier("redis://localhost", CAPACITY, value_size=1000)
    with pytest.raises(ValueError, match="prefix"):
        RedisTier("redis://localhost", CAPACITY, prefix="a{b}")


async def test_a_client_can_be_passed_and_is_not_closed(
    redis_server: RedisServer, prefix: str, seg: SegmentFactory
) -> None:
    """A ready redis.asyncio client is used as is (TLS, auth, Sentinel are its business)
    and stays usable after the tier closes; one that decodes replies is refused."""
    s = seg(tokens=1200)
    options = await anyio.to_thread.run_sync(driver_options)
    client = aioredis.Redis.from_url(redis_server.url, **options)
    try:
        async with RedisTier(client, CAPACITY, prefix=prefix) as t:
            await store(t, s)
            assert await read_back(t, s) == s.data
        assert await client.ping()
    finally:
        await client.aclose()
    decoding = aioredis.Redis.from_url(redis_server.url, decode_responses=True, **options)
    try:
        with pytest.raises(ValueError, match="decode_responses"):
            await RedisTier(decoding, CAPACITY, prefix=prefix).open()
    finally:
        await decoding.aclose()


async def test_password_passes_through(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A server with a password: the right one in the URL works; a wrong one is a
    TierIOError at open that does not show it."""
    server = RedisServer(tmp_path_factory.mktemp("auth"), extra=("--requirepass", "s3cret"))
    server.start()
    try:
        url = f"redis://:s3cret@127.0.0.1:{server.port}/0"
        async with RedisTier(url, CAPACITY, prefix=new_prefix(), liveness=FRESH) as t:
            assert t.stats().notes[0].startswith(f"server redis://:***@127.0.0.1:{server.port}")
        with pytest.raises(TierIOError, match="connect to") as info:
            await RedisTier(url.replace("s3cret", "wrong"), CAPACITY, liveness=FRESH).open()
        assert "wrong" not in str(info.value)
    finally:
        server.stop()


async def test_missing_value_is_never_served_and_is_counted(
    tier: RedisTier, peer: RedisTier, redis_server: RedisServer, prefix: str, seg: SegmentFactory
) -> None:
    """A value deleted behind the tier's back (as eviction does) makes the read fail with
    CorruptSegmentError; the conversation is taken out of the manifest for every replica."""
    a, b = seg(seq=0, tokens=1200, seed=1), seg(seq=1, tokens=8000, seed=2)
    await store(tier, a)
    await store(tier, b)
    tag = conversation_tag(a.key[0])
    with redis_server.client() as c:
        victim = next(
            k for k in _keys(redis_server, prefix) if k.startswith(f"{prefix}:{{{tag}}}:1:")
        )
        c.delete(victim)
    with pytest.raises(CorruptSegmentError, match="gone"):
        await read_back(tier, b)
    st = tier.stats()
    assert (st.corrupt, tier.missing, st.reads) == (1, 1, 0)
    assert not tier.contains(a.key)
    assert not tier.contains(b.key)
    assert tier.used == 0
    assert await peer.lookup(a.key[0]) == []


async def test_altered_value_fails_its_checksum(
    tier: RedisTier, redis_server: RedisServer, prefix: str, seg: SegmentFactory
) -> None:
    """One byte changed in a stored value: the read raises CorruptSegmentError and the
    buffer's bytes are never returned as the segment."""
    s = seg(tokens=8000, seed=3)
    await store(tier, s)
    tag = conversation_tag(s.key[0])
    part = sorted(k for k in _keys(redis_server, prefix) if k.startswith(f"{prefix}:{{{tag}}}:0:"))
    with redis_server.client() as c:
        value = c.get(part[-1])
        assert value is not None
        c.setrange(part[-1], 100, bytes([value[100] ^ 0x01]))
    with pytest.raises(CorruptSegmentError, match="checksum"):
        await read_back(tier, s)
    assert tier.stats().corrupt == 1
    assert tier.missing == 0
    assert not tier.contains(s.key)


async def test_server_restarting_empty_loses_sessions(
    own_redis_server: RedisServer, seg: SegmentFactory
) -> None:
    """After the server restarts without persistence, a read fails (counted, not served),
    and no replica finds a stale manifest: open() and lookup() return nothing."""
    s = seg(tokens=1200, seed=4)
    prefix = new_prefix()
    async with RedisTier(own_redis_server.url, CAPACITY, prefix=prefix) as t:
        await store(t, s)
        own_redis_server.restart()
        with pytest.raises((CorruptSegmentError, TierIOError)):
            await read_back(t, s)
        if t.contains(s.key):  # the first attempt met the dropped connection: retry
            with pytest.raises(CorruptSegmentError, match="gone"):
                await read_back(t, s)
        assert not t.contains(s.key)
        assert t.missing == 1
        assert await t.lookup(s.key[0]) == []
    async with RedisTier(own_redis_server.url, CAPACITY, prefix=prefix, liveness=FRESH) as t:
        assert await t.open() == []
        assert t.used == 0


async def test_server_dying_mid_write_is_a_tier_error_and_shows_nothing(
    own_redis_server: RedisServer, seg: SegmentFactory
) -> None:
    """The server killed while a 64 MiB segment is being written: write() raises TierIOError,
    the reservation is still held (the caller keeps its copy and releases it), and after a
    restart nothing of the segment is visible."""
    s = seg(tokens=256 * 1024, seed=5)  # 64 MiB
    prefix = new_prefix()
    async with RedisTier(own_redis_server.url, 2 * s.length, prefix=prefix, timeout=5) as t:
        assert t.reserve(s.key, s.length)

        async def kill_soon() -> None:
            await anyio.sleep(0.05)  # (the server, stopped, cannot take the write meanwhile)
            await anyio.to_thread.run_sync(own_redis_server.kill)

        await t.ensure_writer(s.key[0])  # the lease first: the kill is to hit the write
        own_redis_server.pause()

        failed: list[TierIOError] = []

        async def write() -> None:
            try:
                await t.write(s.key, s.view)
            except TierIOError as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_soon)
            await write()
        assert len(failed) == 1
        assert "could not write segment 0" in str(failed[0])
        assert not t.contains(s.key)
        assert t.used == s.length
        t.release(s.key)
        assert t.used == 0
    own_redis_server.start()
    async with RedisTier(own_redis_server.url, CAPACITY, prefix=prefix, liveness=FRESH) as t:
        assert await t.lookup(s.key[0]) == []
    assert _keys(own_redis_server, prefix) == []


async def test_server_eviction_never_serves_a_partial_segment(
    tmp_path_factory: pytest.TempPathFactory, seg: SegmentFactory
) -> None:
    """A server with maxmemory and allkeys-random eviction, written far past its memory:
    every segment the tier still lists reads back exact or raises CorruptSegmentError
    (counted); writes whose values (or lease and manifest) were evicted before publishing
    raise TierIOError (or HistoryConflictError) and leave nothing listed."""
    server = RedisServer(
        tmp_path_factory.mktemp("evict"),
        extra=("--maxmemory", "6mb", "--maxmemory-policy", "allkeys-random"),
    )
    server.start()
    try:
        segs = [seg(session=f"user-{i}", seq=0, tokens=2000, seed=i) for i in range(40)]
        async with RedisTier(
            server.url, CAPACITY, prefix=new_prefix(), value_size=SMALL_VALUES, liveness=FRESH
        ) as t:
            written = []
            for s in segs:
                assert t.reserve(s.key, s.length)
                try:
                    await t.write(s.key, s.view)
                    written.append(s)
                except (TierIOError, HistoryConflictError):
                    # HistoryConflictError: the conversation's lease or manifest was evicted
                    # under the commit twice in a row (allkeys-random picks any key)
                    t.release(s.key)
                    assert not t.contains(s.key)
            exact = lost = 0
            for s in written:
                if not t.contains(s.key):  # lost with an earlier conversation? (no: one each)
                    continue
                try:
                    assert await read_back(t, s) == s.data
                    exact += 1
                except CorruptSegmentError:
                    lost += 1
            assert lost >= 1
            assert exact + lost == len(written)
            assert t.missing == lost
    finally:
        server.stop()


# -- leases and fencing -------------------------------------------------------------------


async def test_another_replica_finds_the_conversation(
    tier: RedisTier, peer: RedisTier, seg: SegmentFactory
) -> None:
    """lookup() on a second replica returns the writer's headers in order and lets it read
    every segment byte for byte."""
    segs = [seg(seq=i, tokens=300 * (i + 1), seed=i) for i in range(3)]
    for s in segs:
        await store(tier, s)
    assert not peer.contains(segs[0].key)
    headers = await peer.lookup("s")
    assert headers == [s.header for s in segs]
    assert peer.used == sum(s.length for s in segs)
    for s in segs:
        assert await read_back(peer, s) == s.data
    assert await peer.lookup("nobody") == []


async def test_stale_writer_is_refused_and_corrupts_nothing(
    redis_server: RedisServer, prefix: str, seg: SegmentFactory
) -> None:
    """A replica that lost the conversation to another (force take-over) cannot append: its
    write raises StaleWriterError and leaves nothing (its parts are unlinked at once). The
    new writer reads the history and waits out the old writer's live lease (the server
    answers CommitDelayedError with the time left, and keeps the parts for the retry);
    then its append stands."""
    first, stale, fresh = seg(seq=0, tokens=8, seed=1), seg(seq=1, seed=2), seg(seq=1, seed=3)
    async with (
        RedisTier(redis_server.url, CAPACITY, prefix=prefix, name="A", lease_ttl=0.5) as tier,
        RedisTier(redis_server.url, CAPACITY, prefix=prefix, name="B", lease_ttl=0.5) as peer,
    ):
        await store(tier, first)
        old = tier.token("s")
        assert old is not None
        with pytest.raises(LeaseHeldError, match=r"load\(\) the conversation to take it over"):
            await peer.acquire("s")
        new = await peer.acquire("s", force=True)
        assert new > old
        assert tier.reserve(stale.key, stale.length)
        with pytest.raises(StaleWriterError, match=f"token {old} is stale") as info:
            await tier.write(stale.key, stale.view)
        assert info.value.current == new
        assert not tier.contains(stale.key)
        tier.release(stale.key)
        await peer.lookup("s")
        assert peer.reserve(fresh.key, fresh.length)
        with pytest.raises(CommitDelayedError, match="lease is still live") as delayed:
            await peer.write(fresh.key, fresh.view)
        assert 0 < delayed.value.retry_in <= 0.5
        await anyio.sleep(delayed.value.retry_in)
        await peer.write(fresh.key, fresh.view)
        assert [h.seq for h in await tier.lookup("s")] == [0, 1]
        assert await read_back(tier, fresh) == fresh.data
        with redis_server.client() as c:
            ttls = {k: c.pttl(k) for k in _keys(redis_server, prefix) if k.count(":") == 4}
        assert sorted(ttls.values()) == [-1, -1]  # first and fresh, committed; stale: gone
        assert tier.stats().notes[1].endswith("1 stale write(s) refused")


async def test_lease_expires_and_a_replica_that_read_the_history_takes_over(
    redis_server: RedisServer, prefix: str, seg: SegmentFactory
) -> None:
    """With a short lease, a second replica may acquire without force once the first has
    been idle past the lease, but only after it has read the conversation's history with
    refresh() (a replica that never did is refused: HistoryConflictError; a look-up, which
    the cache does not take in, is no such read); the first's next write is refused."""
    async with (
        RedisTier(redis_server.url, CAPACITY, prefix=prefix, lease_ttl=2.0) as a,
        RedisTier(redis_server.url, CAPACITY, prefix=prefix, lease_ttl=2.0) as b,
    ):
        await store(a, seg(seq=0, seed=1))
        with pytest.raises(LeaseHeldError):  # (within the lease, even on a loaded machine)
            await b.acquire("s")
        await anyio.sleep(2.2)
        with pytest.raises(HistoryConflictError, match="this replica has not read"):
            await b.acquire("s")
        token = a.token("s")
        assert token is not None
        assert [h.seq for h in await b.lookup("s")] == [0]
        with pytest.raises(HistoryConflictError, match="this replica has not read"):
            await b.acquire("s")
        assert [h.seq for h in (await b.refresh("s")).headers] == [0]
        assert await b.acquire("s") > token
        late = seg(seq=1, seed=2)
        assert a.reserve(late.key, late.length)
        with pytest.raises(StaleWriterError):
            await a.write(late.key, late.view)


async def test_delete_only_forgets_and_the_writer_discards(
    tier: RedisTier, peer: RedisTier, redis_server: RedisServer, prefix: str, seg: SegmentFactory
) -> None:
    """delete() only stops a replica counting a segment (another replica may be reading
    it), the writer's too; discard() removes the conversation for everyone, and only by its
    writer (another replica's discard changes nothing)."""
    s = seg(tokens=1200, seed=9)
    await store(tier, s)
    await peer.lookup("s")
    await peer.delete(s.key)
    assert not peer.contains(s.key)
    assert peer.used == 0
    await tier.delete(s.key)
    assert not tier.contains(s.key)
    assert [h.seq for h in await peer.lookup("s")] == [0]
    assert await read_back(peer, s) == s.data
    assert not await peer.discard("s")
    assert [h.seq for h in await peer.lookup("s")] == [0]
    assert await tier.discard("s")
    assert await peer.lookup("s") == []
    assert [k for k in _keys(redis_server, prefix) if not k.endswith(":m")] == []
    # the writer starts the conversation again under the same key: a new history, for
    # every replica (the discarded lease and history are not this tier's any more)
    again = seg(tokens=600, seed=10)
    await store(tier, again)
    assert [h.seq for h in await peer.lookup("s")] == [0]
    assert await read_back(peer, again) == again.data


async def test_open_recovers_published_conversations_only_when_asked(
    tier: RedisTier, redis_server: RedisServer, prefix: str, seg: SegmentFactory
) -> None:
    """A new replica's open() lists every conversation under the prefix (recover=True, the
    default) or none (recover=False, leaving them to lookup())."""
    segs = [seg(session=f"u{i}", seq=j, tokens=64, seed=i + j) for i in range(3) for j in range(2)]
    for s in segs:
        await store(tier, s)
    t = RedisTier(redis_server.url, CAPACITY, prefix=prefix)
    recovered = await t.open()
    try:
        assert sorted((h.session, h.seq) for h in recovered) == sorted(s.key for s in segs)
        assert t.used == sum(s.length for s in segs)
    finally:
        await t.aclose()
    async with RedisTier(redis_server.url, CAPACITY, prefix=prefix, recover=False) as t:
        assert t.used == 0
        assert [h.seq for h in await t.lookup("u1")] == [0, 1]


async def test_ensure_writer_takes_a_free_lease_and_detects_a_take_over(
    tier: RedisTier, peer: RedisTier
) -> None:
    """ensure_writer() takes the lease of a new conversation, confirms it while it is
    current, and raises StaleWriterError (one round trip, nothing written) once another
    replica has taken the conversation over."""
    token = await tier.ensure_writer("s")
    assert token == tier.token("s")
    assert await tier.ensure_writer("s") == token
    with pytest.raises(LeaseHeldError):
        await peer.ensure_writer("s")
    newer = await peer.acquire("s", force=True)
    with pytest.raises(StaleWriterError, match="another replica took it over"):
        await tier.ensure_writer("s")
    assert tier.token("s") is None
    assert await peer.ensure_writer("s") == newer


async def test_write_after_the_server_forgot_its_scripts(
    tier: RedisTier, redis_server: RedisServer, seg: SegmentFactory
) -> None:
    """SCRIPT FLUSH (as after a failover to a fresh server): the publish step is loaded
    again and the write succeeds, byte for byte."""
    a, b = seg(seq=0, tokens=1200, seed=1), seg(seq=1, tokens=1200, seed=2)
    await store(tier, a)
    with redis_server.client() as c:
        c.script_flush()
    await store(tier, b)
    assert await read_back(tier, b) == b.data
    assert [h.seq for h in await tier.lookup("s")] == [0, 1]


async def test_a_heartbeat_that_fails_is_logged_once_and_its_return_too(
    own_redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """No background failure is silent: the heartbeat's first failure is a warning that says
    what it costs (a stalled server: SIGSTOP), the failures after it are not logged again,
    and the heartbeat's return is logged once."""
    caplog.set_level(logging.INFO, logger="tieredkv.redis")
    liveness = 0.6  # a heartbeat every 0.2 s, each bounded by 0.3 s (the timeout)
    async with RedisTier(
        own_redis_server.url, CAPACITY, prefix=new_prefix(), liveness=liveness, timeout=0.3
    ) as t:
        caplog.clear()

        def said(text: str) -> list[logging.LogRecord]:
            return [r for r in caplog.records if text in r.getMessage()]

        own_redis_server.pause()
        try:
            for _ in range(100):  # polled: the heartbeat runs in its own task
                if said("failed"):
                    break
                await anyio.sleep(0.05)
            await anyio.sleep(4 * liveness / 3)  # several more heartbeats fail meanwhile
        finally:
            own_redis_server.resume()
        (failed,) = said("failed")
        assert failed.levelno == logging.WARNING
        assert t.stats().reachable is False or said("answered again")  # (back meanwhile?)
        assert f"{t.name}: heartbeat to {t.url} failed (" in failed.getMessage()
        assert "counts their loads as misses until the server answers again" in (
            failed.getMessage()
        )
        for _ in range(100):
            if said("answered again"):
                break
            await anyio.sleep(0.05)
        (back,) = said("answered again")
        assert back.levelno == logging.INFO
        assert await t.beat()
        assert t.stats().reachable is True
    assert t.stats().reachable is False  # closed


async def test_a_heartbeat_task_that_dies_of_a_bug_is_logged_at_once(
    own_redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A heartbeat task ended by an exception (a bug, not a failed heartbeat) is an error in
    the log when it ends, not a "Task exception was never retrieved" whenever the task is
    collected: without heartbeats, the replica's liveness runs out."""
    caplog.set_level(logging.INFO, logger="tieredkv.redis")
    async with RedisTier(
        own_redis_server.url, CAPACITY, prefix=new_prefix(), liveness=0.3, timeout=0.3
    ) as t:

        async def broken() -> bool:
            raise TypeError("a bug in the heartbeat")

        monkeypatch.setattr(t, "beat", broken)
        for _ in range(100):  # polled: the next heartbeat is at most 0.1 s away
            if any(r.levelno == logging.ERROR for r in caplog.records):
                break
            await anyio.sleep(0.05)
        (stopped,) = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert f"{t.name}: the heartbeat stopped" in stopped.getMessage()
        assert stopped.exc_info is not None
        assert isinstance(stopped.exc_info[1], TypeError)


def test_a_shared_tier_in_exclusive_mode_is_said_to_get_turns_only_when_evicted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """In exclusive mode a turn reaches a shared tier below host memory only when host
    memory evicts it (flush() does not wait for it): the cache says so when built, and says
    nothing in inclusive mode, the one for sharing."""
    caplog.set_level(logging.INFO, logger="tieredkv.cache")
    url = "redis://127.0.0.1:1/0"  # (built, not opened: nothing connects)
    TieredKVCache([HostMemoryTier(8 << 20), RedisTier(url, CAPACITY, name="fleet")])
    (said,) = [r for r in caplog.records if "exclusive mode" in r.getMessage()]
    assert "shared tier(s) 'fleet' below local ones in exclusive mode" in said.getMessage()
    assert "mode='inclusive' commits every turn" in said.getMessage()
    caplog.clear()
    TieredKVCache(
        [HostMemoryTier(8 << 20), RedisTier(url, CAPACITY, name="fleet")], mode="inclusive"
    )
    assert not [r for r in caplog.records if "exclusive mode" in r.getMessage()]


async def test_the_vllm_connectors_redis_timeout_bounds_a_call_to_a_stalled_server(
    own_redis_server: RedisServer,
) -> None:
    """``redis_timeout`` in ``kv_connector_extra_config`` reaches the worker's Redis tier: a
    call to a stalled server (SIGSTOP) gives up within it, so a load there is recomputed
    after about that long, not after the tier's default of 10 s."""
    from tieredkv.integrations.vllm.config import parse_config
    from tieredkv.integrations.vllm.worker import make_tiers

    config = parse_config({"redis_url": own_redis_server.url, "redis_timeout": 0.3})
    _, tier = make_tiers(config, 0)
    assert isinstance(tier, RedisTier)
    async with tier:
        assert await tier.beat()
        own_redis_server.pause()
        try:
            start = time.monotonic()
            answered = await tier.beat()
            took = time.monotonic() - start
        finally:
            own_redis_server.resume()
        assert not answered
        assert 0.3 <= took < 2.0, took
        assert await tier.beat()
