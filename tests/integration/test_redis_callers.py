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

from tests.fleet import TOKENS, ReplicaProcess, runs, tags, turn
from tests.redis_server import RedisServer, new_prefix, own_redis_server
from tieredkv import HostMemoryTier, TieredKVCache
from tieredkv.backends.redis import RedisTier, conversation_tag
from tieredkv.errors import (
    CommitDelayedError,
    HistoryConflictError,
    HistoryLengthError,
    InvalidArgumentError,
    LeaseHeldError,
    SessionNotFoundError,
    TierIOError,
    TurnRefusedError,
    UnauthenticatedWriterError,
)

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
        messages: list[str] = []

        async def flush() -> None:
            try:
                await a.flush()
            except TurnRefusedError as exc:
                outcomes.append(exc.refusals)
                messages.append(str(exc))
            else:
                outcomes.append("returned")

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(flush)
        assert outcomes == [[("chat", [1])]] * 3
        # one piece of advice, not the refusing error's own nested in it
        assert "take it back" not in messages[0]
        assert messages[0].count("load") == 1, messages[0]
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
    and it is not: A's history is [t0], and once B's lease has ended the same append
    succeeds and a fresh replica loads [t0, t1]."""
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
        wait = info.value.retry_in
        with anyio.fail_after(20):  # until B's lease ends (B is alive: it is waited for)
            while True:
                await anyio.sleep(wait + 0.05)
                try:
                    await a.append("chat", turn(1, 1024), answer_tokens=1)
                    break
                except CommitDelayedError as exc:
                    wait = exc.retry_in
        await a.flush()
    async with replica(server.url, prefix) as c:
        assert [tag for tag, _ in runs(await c.load("chat"))] == [0, 1]


NOT_FOUND_ADVICE = "append() a segment first"
"""What a load of a conversation never stored is told: never a damaged or unproven one."""


async def test_a_damaged_history_is_named_to_its_reader_and_its_writer(
    server: RedisServer,
) -> None:
    """With a secret, a value of turn 1 is overwritten by another client. A reader's load
    is a miss whose error says the history was found damaged (not "append() a segment
    first"); the writer's next append is refused with StaleWriterError saying the copy was
    found damaged (not merely "another replica took it over")."""
    prefix, secret = new_prefix(), bytes(range(32))
    async with (
        ReplicaProcess(server.url, prefix, secret=secret.hex(), lease_ttl=2.0) as writer,
        replica(server.url, prefix, secret=secret) as reader,
    ):
        for tag in (0, 1, 2):
            assert (await writer.append("chat", tag))["ok"]
        assert (await writer.flush())["ok"]
        with server.client() as client:
            [part] = list(client.scan_iter(match=f"{prefix}:{{{conversation_tag('chat')}}}:1:*"))
            value = client.get(part)
            assert value is not None
            client.set(part, value[:-1] + bytes([value[-1] ^ 1]))
        with pytest.raises(SessionNotFoundError) as info:
            await reader.load("chat")
        message = str(info.value)
        assert NOT_FOUND_ADVICE not in message
        assert "damaged" in message
        assert info.value.reason is not None
        answer = await writer.append("chat", 3)
        assert answer["error"] == "StaleWriterError", answer
        assert "found its shared copy damaged" in answer["message"]
        assert "took it over" not in answer["message"]


async def test_a_lost_history_is_a_miss_that_says_so(server: RedisServer) -> None:
    """The server loses a conversation's manifest (as maxmemory evicts it): the writer's
    next load is a miss whose error says the shared tier lost the history."""
    prefix = new_prefix()
    async with replica(server.url, prefix) as a:
        await a.append("chat", turn(0), answer_tokens=1)
        await a.flush()
        with server.client() as client:
            client.delete(f"{prefix}:{{{conversation_tag('chat')}}}:m")
        with pytest.raises(SessionNotFoundError, match="lost its history") as info:
            await a.load("chat")
        assert NOT_FOUND_ADVICE not in str(info.value)
        assert a.stats().unproven == 1


async def test_a_held_lease_advises_what_the_cache_can_do(server: RedisServer) -> None:
    """B (another process) starts a conversation; A appends to it at once: LeaseHeldError
    names B's lease and advises load() (what TieredKVCache has), never acquire(force=True)."""
    prefix = new_prefix()
    async with (
        ReplicaProcess(server.url, prefix, lease_ttl=10.0) as b,
        replica(server.url, prefix, lease_ttl=10.0) as a,
    ):
        assert (await b.append("chat", 0))["ok"]
        with pytest.raises(LeaseHeldError) as info:
            await a.append("chat", turn(1), answer_tokens=1)
        message = str(info.value)
        assert "force=True" not in message
        assert "acquire(" not in message
        assert "load()" in message


async def test_out_of_memory_without_eviction_says_what_to_change(server: RedisServer) -> None:
    """Under maxmemory with noeviction, flush() raises TierIOError naming the server's
    memory policy, not "flush() again later" (which cannot succeed), and without a stray
    ". ;"."""
    prefix = new_prefix()
    async with replica(server.url, prefix, lease_ttl=10.0) as a:
        await a.append("chat", turn(0), answer_tokens=1)
        await a.flush()
        with server.client() as client:
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", "1")
        try:
            await a.append("chat", turn(1), answer_tokens=1)
            with pytest.raises(TierIOError) as info:
                await a.flush()
        finally:
            with server.client() as client:
                client.config_set("maxmemory", "0")
        message = str(info.value)
        assert "maxmemory" in message
        assert "evicting policy" in message
        assert "flush() again later" not in message
        assert ". ;" not in message
        assert "tried again in the background" in message
        await a.flush()


async def test_a_drop_leaves_nothing_of_the_conversation_on_the_server(
    server: RedisServer,
) -> None:
    """The writer drops a conversation: no key of it stays on the server (its manifest
    neither), fsck lists no conversation, another replica finds nothing, and a new
    conversation under the same key starts afresh, for every replica."""
    from tieredkv.fsck_redis import check_prefix

    prefix = new_prefix()
    async with replica(server.url, prefix) as a, replica(server.url, prefix) as b:
        await a.append("chat", turn(0), answer_tokens=1)
        await a.flush()
        assert tags(await b.load("chat")) == [0]
        await b.append("chat", turn(1), answer_tokens=1)
        await b.flush()
        await b.drop("chat")
        with server.client() as client:  # (the replicas' own keys aside: :auth, :live:)
            assert list(client.scan_iter(match=f"{prefix}:{{*")) == []
        report = await anyio.to_thread.run_sync(check_prefix, server.url, prefix)
        assert report.sessions == []
        assert not await a.discover("chat")
        with pytest.raises(SessionNotFoundError):
            await a.load("chat")
        await b.append("chat", turn(2), answer_tokens=1)
        await b.flush()
        assert tags(await a.load("chat")) == [2]


async def test_fsck_reports_a_key_of_another_type_under_a_manifests_name_and_checks_the_rest(
    server: RedisServer,
) -> None:
    """Another client left a string where a manifest (a hash) would be: fsck reports that
    key as damaged and checks the other conversations. Before, the WRONGTYPE reply ended
    the whole check as if the server could not be read."""
    from tieredkv.fsck_redis import check_prefix

    prefix = new_prefix()
    async with replica(server.url, prefix) as a:
        await a.append("chat", turn(0), answer_tokens=1)
        await a.flush()
    stray = f"{prefix}:{{{conversation_tag('other')}}}:m"
    with server.client() as client:
        client.set(stray, "x")
    report = await anyio.to_thread.run_sync(check_prefix, server.url, prefix)
    assert [(d.path, d.problem.split(":")[0]) for d in report.damaged] == [
        (stray, "not a manifest (a hash)")
    ]
    assert [(s.session, s.turns) for s in report.sessions] == [("chat", 1)]


async def test_a_replica_without_the_secret_is_refused_before_it_writes(
    server: RedisServer,
) -> None:
    """A replica without ``secret=`` opened before any replica with one (so the prefix was
    not marked yet) loads an authenticated conversation and appends to it: its commit is
    refused (a refused turn, reported by flush()), so the replicas with the secret still
    serve the conversation, and it may not start a new conversation either. Once the
    prefix is marked, a replica without the secret, or with another one, is refused at
    open, saying what to fix."""
    prefix, secret = new_prefix(), bytes(range(32))
    async with replica(server.url, prefix, lease_ttl=0.5) as unkeyed:
        async with replica(server.url, prefix, secret=secret, lease_ttl=0.5) as keyed:
            await keyed.append("chat", turn(0), answer_tokens=1)
            await keyed.flush()
        assert tags(await unkeyed.load("chat")) == [0]
        await unkeyed.append("chat", turn(1), answer_tokens=1)
        with pytest.raises(TurnRefusedError, match="this replica has no secret") as info:
            await unkeyed.flush()
        assert info.value.refusals == [("chat", [1])]
        with pytest.raises(UnauthenticatedWriterError, match="same secret="):
            await unkeyed.append("new", turn(2), answer_tokens=1)  # nor starts one
    async with replica(server.url, prefix, secret=secret) as other:
        assert tags(await other.load("chat")) == [0]
    for wrong in (None, bytes(32)):
        with pytest.raises(InvalidArgumentError, match="same secret"):
            async with replica(server.url, prefix, secret=wrong):
                pass


async def test_a_replica_without_the_secret_opened_after_an_empty_restart_is_refused(
    server: RedisServer,
) -> None:
    """The server restarts empty (the prefix's mark goes with everything else) while a
    replica with the secret runs. A replica without the secret opened at once, before the
    keyed replica's next heartbeat marks the prefix again, may not start a conversation:
    its open waits until the server has been up for a liveness period, and it is refused;
    the keyed replica goes on writing."""
    prefix, secret = new_prefix(), bytes(range(32))

    async def start_a_conversation_without_the_secret() -> None:
        async with replica(server.url, prefix, lease_ttl=3.0) as unkeyed:
            await unkeyed.append("new", turn(1), answer_tokens=1)
            await unkeyed.flush()

    async with replica(server.url, prefix, secret=secret, lease_ttl=3.0) as keyed:
        await keyed.append("chat", turn(0), answer_tokens=1)
        await keyed.flush()
        server.restart(empty=True)
        with pytest.raises((UnauthenticatedWriterError, InvalidArgumentError)):
            await start_a_conversation_without_the_secret()
        await keyed.append("next", turn(2), answer_tokens=1)
        await keyed.flush()
    async with replica(server.url, prefix, secret=secret) as other:
        assert tags(await other.load("next")) == [2]
        with pytest.raises(SessionNotFoundError):
            await other.load("new")


async def test_after_an_empty_restart_a_replica_without_the_secret_waits_before_it_commits(
    server: RedisServer,
) -> None:
    """A replica without ``secret=`` (1 s liveness, so 3 s of settling) on an unmarked
    prefix commits at once. The server restarts empty, forgetting whether the prefix was
    marked: the replica's next commit waits until the prefix has been unmarked for the
    settling period (the replicas with the secret, if any, mark it again meanwhile), then
    goes through, and is served."""
    prefix = new_prefix()
    async with replica(server.url, prefix, lease_ttl=1.0) as unkeyed:
        await unkeyed.append("a", turn(0), answer_tokens=1)
        with anyio.fail_after(2.5):
            await unkeyed.flush()  # (the prefix was found unmarked on an old server)
        server.restart(empty=True)
        await unkeyed.append("b", turn(1), answer_tokens=1)
        began = anyio.current_time()
        with anyio.fail_after(30):
            await unkeyed.flush()
        assert anyio.current_time() - began >= 2.5
    async with replica(server.url, prefix) as other:
        assert tags(await other.load("b")) == [1]


async def test_after_an_empty_restart_a_replica_without_the_secret_is_refused_once_marked(
    server: RedisServer,
) -> None:
    """A replica without ``secret=`` (3 s of settling) runs on an unmarked prefix. The
    server restarts empty, and the replica appends and flushes at once: its commit waits
    out the settling period; a replica with the secret opens meanwhile (marking the prefix)
    and writes; the unkeyed commit is then refused (a refused turn), so nothing without a
    MAC lands under a prefix the keyed replicas serve."""
    prefix, secret = new_prefix(), bytes(range(32))
    refused: list[tuple[str, list[tuple[str, list[int]]]]] = []
    async with replica(server.url, prefix, lease_ttl=1.0) as unkeyed:
        server.restart(empty=True)
        await unkeyed.append("new", turn(1), answer_tokens=1)

        async def flush_unkeyed() -> None:
            try:
                with anyio.fail_after(30):
                    await unkeyed.flush()
            except TurnRefusedError as exc:
                refused.append((str(exc), exc.refusals))

        async with anyio.create_task_group() as tg:
            tg.start_soon(flush_unkeyed)
            await anyio.sleep(0.5)
            async with replica(server.url, prefix, secret=secret) as keyed:
                await keyed.append("chat", turn(0), answer_tokens=1)
                await keyed.flush()
    assert len(refused) == 1, "the commit without the secret went through"
    assert "no secret" in refused[0][0]
    assert refused[0][1] == [("new", [0])]
    async with replica(server.url, prefix, secret=secret) as keyed:
        assert tags(await keyed.load("chat")) == [0]
        with pytest.raises(SessionNotFoundError):
            await keyed.load("new")


@pytest.mark.parametrize("holder", ["dead", "alive"])
async def test_a_takeover_waits_for_a_live_holder_only(server: RedisServer, holder: str) -> None:
    """B (another process, a 30 s lease, 1 s liveness) writes t0 and flushes; A takes the
    conversation over and appends t1. If B was SIGKILLed first, A's flush() commits t1
    within a few seconds (B's liveness ran out), not after B's 30 s lease. If B is alive,
    A's commit still waits for B's lease (B may be serving its copy): flush() has not
    returned after 3 s."""
    prefix = new_prefix()
    options = {"lease_ttl": 30.0, "redis": {"liveness": 1.0}}
    async with (
        ReplicaProcess(server.url, prefix, **options) as b,
        replica(server.url, prefix, lease_ttl=30.0, liveness=1.0) as a,
    ):
        assert (await b.append("chat", 0))["ok"]
        assert (await b.flush())["ok"]
        if holder == "dead":
            await b.kill()
        assert tags(await a.load("chat")) == [0]
        await a.append("chat", turn(1), answer_tokens=1)
        if holder == "dead":
            with anyio.fail_after(10):
                await a.flush()
        else:
            with anyio.move_on_after(3) as waited:
                await a.flush()
            assert waited.cancel_called, "the commit did not wait for a live holder's lease"
    if holder == "dead":
        async with replica(server.url, prefix) as c:
            assert tags(await c.load("chat")) == [0, 1]


async def test_expected_tokens_counts_the_shared_history_this_replica_has_read(
    server: RedisServer,
) -> None:
    """``append(..., expected_tokens=N)`` on a replica sharing a RedisTier. A replica that
    has not read a conversation stored since it opened is refused by the shared tier's
    writer check, which comes first (``HistoryConflictError``: load it); once a load has
    brought the shared history in, the count is that history's: the turn extends it, and
    a first turn under the key is refused. (A replica that opens after the conversation
    is stored reads it at open.)"""
    prefix = new_prefix()
    async with replica(server.url, prefix) as b:
        async with replica(server.url, prefix) as a:
            await a.append("chat", turn(0), answer_tokens=1, expected_tokens=0)
            await a.flush()
        with pytest.raises(HistoryConflictError, match="which this replica has not read"):
            await b.append("chat", turn(1), answer_tokens=1, expected_tokens=TOKENS)
        assert tags(await b.load("chat")) == [0]  # nothing of the refused turn anywhere
        meta = await b.append("chat", turn(1), answer_tokens=1, expected_tokens=TOKENS)
        assert (meta.turns, meta.tokens) == (2, 2 * TOKENS)
        for expected in (0, TOKENS):
            with pytest.raises(HistoryLengthError, match=f"holds {2 * TOKENS} tokens"):
                await b.append("chat", turn(2), answer_tokens=1, expected_tokens=expected)
        await b.flush()
    async with replica(server.url, prefix) as c:
        assert c.channel["chat"].tokens == 2 * TOKENS  # read at open
        assert tags(await c.load("chat")) == [0, 1]
