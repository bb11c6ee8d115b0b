"""Several TieredKVCache replicas sharing one RedisTier (a real redis-server).

Turns of one conversation alternate between replicas: each load returns, byte for byte,
every turn appended so far on whichever replica, and the metadata channel learns the
conversation's size, tokens and previous answer length from the shared manifest. A
replica that lost the conversation to another cannot append to it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from tests.redis_server import (
    RedisServer,
    new_prefix,
    own_aof_server,
    own_redis_server,
    redis_server,
)
from tieredkv import HostMemoryTier, TieredKVCache
from tieredkv.backends.redis import RedisTier
from tieredkv.errors import (
    CommitDelayedError,
    SchemaMismatchError,
    SessionNotFoundError,
    StaleWriterError,
)

__all__ = ["own_aof_server", "own_redis_server", "redis_server"]  # the fixtures, used below

MiB = 1 << 20
Replica = Callable[..., AbstractAsyncContextManager[TieredKVCache]]


def turn(i: int, tokens: int = 48, width: int = 64) -> dict[str, torch.Tensor]:
    """Turn ``i``'s K/V: seeded, so every process builds the same tensors."""
    gen = torch.Generator().manual_seed(1000 + i)
    return {n: torch.randn(tokens + i, width, generator=gen).to(torch.bfloat16) for n in ("k", "v")}


def history(n: int) -> dict[str, torch.Tensor]:
    """Turns 0..n-1 joined along the token dimension."""
    turns = [turn(i) for i in range(n)]
    return {n_: torch.cat([t[n_] for t in turns]) for n_ in ("k", "v")}


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))
        for k in a
    )


@pytest.fixture
def replica(redis_server: RedisServer) -> Replica:
    """Build a replica: its own host tier over the shared Redis tier (same prefix)."""
    prefix = new_prefix()

    def make(host: int = 8 * MiB, mode: str = "inclusive") -> TieredKVCache:
        # a short lease: a takeover's first commit waits for the previous writer's to end
        shared = RedisTier(
            redis_server.url, 64 * MiB, prefix=prefix, value_size=64 << 10, lease_ttl=0.3
        )
        return TieredKVCache([HostMemoryTier(host), shared], mode=mode)  # type: ignore[arg-type]

    return make


@pytest.fixture
async def two(replica: Replica) -> AsyncIterator[tuple[TieredKVCache, TieredKVCache]]:
    async with replica() as a, replica() as b:
        yield a, b


async def test_turns_alternating_replicas_load_every_turn_exactly(
    two: tuple[TieredKVCache, TieredKVCache],
) -> None:
    """Six turns, alternating A, B, A, ...: each replica loads the whole history (turns
    written by both) byte for byte, and its channel has the right size, tokens and answer
    length before it appends."""
    a, b = two
    for i in range(6):
        r = (a, b)[i % 2]
        if i:
            got = await r.load("chat")
            assert same_bytes(got, history(i))
            meta = r.channel.get("chat")
            assert meta is not None
            assert (meta.turns, meta.tokens) == (i, sum(48 + j for j in range(i)))
            assert meta.prev_answer_tokens == 10 * i  # turn i-1's answer
        await r.append("chat", turn(i), answer_tokens=10 * (i + 1))
        await r.flush()  # the write-through into the shared tier
    assert same_bytes(await a.load("chat"), history(6))
    shared = b.tiers[1]
    assert isinstance(shared, RedisTier)
    assert [h.seq for h in await shared.lookup("chat")] == list(range(6))


async def test_stale_replica_is_refused_and_nothing_is_corrupted(
    two: tuple[TieredKVCache, TieredKVCache],
) -> None:
    """A writes turn 0; B loads the conversation (taking it over); A, not having seen that,
    appends turn 1: StaleWriterError, nothing stored. B's turn 1 stands, and A's next load
    takes B's history (dropping its own stale copy)."""
    a, b = two
    await a.append("chat", turn(0), answer_tokens=5)
    await a.flush()
    assert same_bytes(await b.load("chat"), history(1))
    with pytest.raises(StaleWriterError, match="another replica took it over"):
        await a.append("chat", turn(1), answer_tokens=6)
    meta = a.channel.get("chat")
    assert meta is not None
    assert meta.turns == 1
    await b.append("chat", turn(1), answer_tokens=6)
    await b.flush()
    assert same_bytes(await a.load("chat"), history(2))
    assert a.where("chat") == a.tiers[0].name  # promoted from the shared tier
    await a.append("chat", turn(2), answer_tokens=7)  # A took it back by loading it
    await a.flush()
    assert same_bytes(await b.load("chat"), history(3))


async def test_a_drop_removes_the_shared_history_only_from_its_writer(
    two: tuple[TieredKVCache, TieredKVCache],
) -> None:
    """B's drop of A's conversation removes B's copies only (A still loads it, and so does
    B, from the shared tier); a drop after a load (B the writer then) removes it for
    every replica, as drop() documents."""
    a, b = two
    await a.append("chat", turn(0), answer_tokens=5)
    await a.flush()
    await b.discover("chat")
    assert b.contains("chat")
    await b.drop("chat")  # (B never loaded it: A is the writer)
    assert not b.contains("chat")
    assert same_bytes(await a.load("chat"), history(1))
    assert same_bytes(await b.load("chat"), history(1))  # read again; B is the writer now
    await b.drop("chat")
    assert not await a.discover("chat")
    with pytest.raises(SessionNotFoundError):
        await a.load("chat")


def _scripts_run(server: RedisServer) -> int:
    """How many Lua steps (``EVALSHA``) the server has run."""
    with server.client() as c:
        stats = c.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


def _redis_only(server: RedisServer, prefix: str, lease: float = 60) -> TieredKVCache:
    """A replica whose only tier is the shared one (its heartbeats run no Lua step)."""
    shared = RedisTier(
        server.url, 64 * MiB, prefix=prefix, value_size=64 << 10, lease_ttl=lease, liveness=0.3
    )
    return TieredKVCache([shared])


async def test_an_append_into_the_shared_tier_alone_checks_its_writer_in_its_commit(
    redis_server: RedisServer,
) -> None:
    """With the shared tier as the cache's only tier, each append's segment can only be
    committed there, and the commit checks the writer (and renews its lease) in the same
    Lua step: after the first append, which takes the lease, an append runs one Lua step
    on the server (it ran two, a writer check and the commit, each a round trip). Every
    turn comes back byte for byte."""
    prefix = new_prefix()
    async with _redis_only(redis_server, prefix) as a:
        await a.append("chat", turn(0), answer_tokens=1)  # takes the lease, then commits
        for i in range(1, 4):
            before = _scripts_run(redis_server)
            await a.append("chat", turn(i), answer_tokens=i + 1)
            assert _scripts_run(redis_server) - before == 1
        assert same_bytes(await a.load("chat"), history(4))


async def test_a_stale_replica_appending_into_the_shared_tier_alone_is_refused(
    redis_server: RedisServer,
) -> None:
    """The same as with a host tier in front: A writes turn 0 straight into the shared
    tier; B loads the conversation (taking it over); A's append of turn 1 is refused by
    its commit (StaleWriterError) and stores nothing; B's turn 1 stands (committed once
    A's lease has ended), and A can go on once it has loaded B's history."""
    prefix = new_prefix()
    lease = 0.3
    async with (
        _redis_only(redis_server, prefix, lease) as a,
        _redis_only(redis_server, prefix, lease) as b,
    ):
        await a.append("chat", turn(0), answer_tokens=5)
        assert same_bytes(await b.load("chat"), history(1))
        with pytest.raises(StaleWriterError, match="another replica took it over"):
            await a.append("chat", turn(1), answer_tokens=6)
        meta = a.channel.get("chat")
        assert meta is not None
        assert meta.turns == 1
        with redis_server.client() as c:  # the refused commit left no value behind
            keys = [k.partition(b"}:")[2] for k in c.scan_iter(f"{prefix}:{{*")]
        assert sorted(k.split(b":")[0] for k in keys if k not in (b"m", b"t")) == [b"0"], keys
        await _append_when_free(b, 1, lease)
        assert same_bytes(await a.load("chat"), history(2))
        await _append_when_free(a, 2, lease)  # A took it back by loading it
        assert same_bytes(await b.load("chat"), history(3))


async def _append_when_free(r: TieredKVCache, i: int, lease: float) -> None:
    """Append turn ``i`` to "chat" once the lease of the replica it was taken from ends."""
    for _ in range(50):
        try:
            await r.append("chat", turn(i), answer_tokens=i + 5)
            return
        except CommitDelayedError as exc:
            await anyio.sleep(min(exc.retry_in, lease) + 0.05)
    raise AssertionError("the previous writer's lease never ended")


async def test_discover_answers_for_other_replicas(replica: Replica) -> None:
    """contains() knows only this replica; discover() asks the shared tier; a conversation
    that exists nowhere stays unknown (load raises SessionNotFoundError)."""
    async with replica() as a, replica(mode="exclusive") as b:
        await a.append("chat", turn(0), answer_tokens=3)
        await a.flush()
        assert not b.contains("chat")
        assert await b.discover("chat")
        assert b.where("chat") == b.tiers[1].name
        assert b.contains("chat")
        assert await b.prefetch("chat") == b.tiers[0].name
        assert not await b.discover("nobody")
        with pytest.raises(SessionNotFoundError):
            await b.load("nobody")
        assert "nobody" not in b.sessions()


async def test_another_model_under_the_same_key_is_refused(replica: Replica) -> None:
    """A replica of another model (other tensor shapes) sharing the prefix finds the
    conversation, but its append is refused with SchemaMismatchError, as for any segment
    that does not match its session's earlier ones; the first replica's data is untouched."""
    async with replica() as a, replica() as b:
        await a.append("chat", turn(0), answer_tokens=3)
        await a.flush()
        assert same_bytes(await b.load("chat"), history(1))
        other = {n: torch.zeros(40, 32, dtype=torch.bfloat16) for n in ("k", "v")}
        with pytest.raises(SchemaMismatchError, match="non-token shape"):
            await b.append("chat", other, answer_tokens=1)
        assert same_bytes(await a.load("chat"), history(1))


CHILD = """
import sys, anyio, torch
sys.path.insert(0, sys.argv[3])
from tests.integration.test_redis_replicas import history, same_bytes, turn
from tieredkv import HostMemoryTier, TieredKVCache
from tieredkv.backends.redis import RedisTier

async def main() -> None:
    shared = RedisTier(
        sys.argv[1], 64 << 20, prefix=sys.argv[2], value_size=64 << 10, lease_ttl=0.5
    )
    async with TieredKVCache([HostMemoryTier(8 << 20), shared], mode="inclusive") as c:
        assert same_bytes(await c.load("chat"), history(2))
        await c.append("chat", turn(2), answer_tokens=30)
        await c.flush()
    print("child ok")

anyio.run(main)
"""


@pytest.mark.slow
async def test_two_processes_share_a_conversation(redis_server: RedisServer) -> None:
    """Turn 0 and 1 in this process, turn 2 in another process (its own cache), then this
    process loads all three byte for byte."""
    prefix = new_prefix()
    root = str(Path(__file__).resolve().parents[2])
    # a short lease: the child takes the conversation over, and its first commit waits
    # for this process's lease to end
    shared = RedisTier(
        redis_server.url, 64 * MiB, prefix=prefix, value_size=64 << 10, lease_ttl=0.5
    )
    async with TieredKVCache([HostMemoryTier(8 * MiB), shared], mode="inclusive") as c:
        await c.append("chat", turn(0), answer_tokens=10)
        await c.append("chat", turn(1), answer_tokens=20)
        await c.flush()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
        }
        done = await anyio.run_process(
            [sys.executable, "-W", "error", "-c", CHILD, redis_server.url, prefix, root],
            env=env,
            check=False,
        )
        assert done.returncode == 0, (done.stdout + done.stderr).decode()
        assert same_bytes(await c.load("chat"), history(3))
        meta = c.channel.get("chat")
        assert meta is not None
        assert (meta.turns, meta.prev_answer_tokens) == (3, 30)


class _KillsAtItsFirstWrite(RedisTier):
    """A RedisTier that SIGKILLs the server just before its first segment write (the
    write then meets a dead server: a transient error, retried later)."""

    def __init__(self, server: RedisServer, *args: Any, **kwargs: Any) -> None:
        super().__init__(server.url, *args, **kwargs)
        self.server = server
        self.killed = anyio.Event()

    def _first(self) -> None:
        if not self.killed.is_set():
            self.server.kill()
            self.killed.set()

    async def write_pieces(self, *args: Any, **kwargs: Any) -> None:
        self._first()
        await super().write_pieces(*args, **kwargs)

    async def write(self, *args: Any, **kwargs: Any) -> None:
        self._first()
        await super().write(*args, **kwargs)


@pytest.mark.slow  # about 7 s: four failed commits, and the backoff between them
async def test_a_conversation_started_here_and_not_committed_yet_survives_an_empty_restart(
    own_redis_server: RedisServer,
) -> None:
    """A's append took the writer lease (the server holds an empty history); the server
    dies as the commit goes out, and comes back empty before the commit is retried. The
    server holds nothing, and A's lease covered no committed turn: A serves its own turn
    (it is the writer, nothing of it was ever committed; the only test of that branch of
    the cache's adoption), and the write-through, retried, starts the history again and
    commits it, so A's flush returns and another replica loads the turn exactly."""
    prefix = new_prefix()
    shared = _KillsAtItsFirstWrite(
        own_redis_server, 64 * MiB, prefix=prefix, value_size=64 << 10, lease_ttl=0.3, timeout=0.5
    )
    async with TieredKVCache([HostMemoryTier(8 * MiB), shared], mode="inclusive") as a:
        await a.append("chat", turn(0), answer_tokens=5)
        token = shared.token("chat")
        assert token is not None
        with anyio.fail_after(30):  # the commit and its retries fail, with growing backoff:
            while a.stats().errors < 4:  # noqa: ASYNC110 (polled: no event says it)
                await anyio.sleep(0.01)
        own_redis_server.start()  # (empty) while the next retry is 0.8 s away
        assert same_bytes(await a.load("chat"), history(1))
        assert shared.token("chat") == token  # (the load found nothing there: "absent")
        assert a.stats().unproven == 0
        with anyio.fail_after(30):
            await a.flush()
    other = RedisTier(  # (a short liveness: it opens after a settling period of thrice it)
        own_redis_server.url, 64 * MiB, prefix=prefix, value_size=64 << 10, liveness=0.3
    )
    async with TieredKVCache([HostMemoryTier(8 * MiB), other], mode="inclusive") as b:
        assert same_bytes(await b.load("chat"), history(1))


@pytest.mark.slow  # 8-18 s each: a failing server, growing backoff (a new server settling)
@pytest.mark.parametrize("then", ["append", "load"])
async def test_when_a_commit_gets_through_again_the_others_waiting_go_at_once(
    own_aof_server: RedisServer, then: str
) -> None:
    """The server dies; the latest turns of two conversations fail to commit and wait, with
    growing backoff. It comes back (with what it had acknowledged) and a new turn of one
    conversation commits at once (``append``), or the replica loads a third conversation
    (``load``: it asks the server about it): the waiting commits follow within a fraction
    of a second, not at the end of their backoff, and another replica loads them exactly."""
    prefix = new_prefix()

    def tier(**kw: Any) -> RedisTier:
        return RedisTier(
            own_aof_server.url, 64 * MiB, prefix=prefix, value_size=64 << 10, timeout=0.5, **kw
        )

    async with TieredKVCache([HostMemoryTier(8 * MiB), tier()], mode="inclusive") as a:
        for key in ("talks", "waits", "reads"):
            await a.append(key, turn(0), answer_tokens=5)
        await a.flush()
        own_aof_server.kill()
        for key in ("talks", "waits"):
            await a.append(key, turn(1), answer_tokens=5)
        waiting = a._pumps._waiting
        with anyio.fail_after(30):  # until a retry of "waits" is 3.2 s away
            while "waits" not in waiting or waiting["waits"].attempts < 6:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        own_aof_server.start()
        due = min(waiting["waits"].due, waiting["talks"].due)
        if then == "append":
            await a.append("talks", turn(2), answer_tokens=5)  # its pump tries at once
        else:
            assert same_bytes(await a.load("reads"), history(1))
        with anyio.fail_after(30):
            while "waits" in waiting or "talks" in waiting:  # noqa: ASYNC110 (polled)
                await anyio.sleep(0.01)
        committed = time.monotonic()
        assert committed < due - 0.5, (committed, due)  # well before its backoff ended
        await a.flush()
    async with TieredKVCache([HostMemoryTier(8 * MiB), tier(liveness=0.3)], mode="inclusive") as b:
        assert same_bytes(await b.load("talks"), history(3 if then == "append" else 2))
        assert same_bytes(await b.load("waits"), history(2))
        assert same_bytes(await b.load("reads"), history(1))
