"""Forks in a Redis tier, against a real redis-server: a fork's manifest references its
parent's committed segments (no copy), every replica reads them, a parent's drop keeps what
forks reference, and a fork commit is fenced and refused cleanly when its parent's range is
gone; a load of a fork is its committed history byte for byte, or a miss."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

from tests.invariants import unowned
from tests.redis_server import RedisServer, new_prefix, own_redis_server, redis_server
from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.backends.base import SegmentKey
from tieredkv.backends.redis import RedisTier, conversation_tag
from tieredkv.backends.redis_manifest import Entry, Ref, encode_entry
from tieredkv.errors import (
    CorruptSegmentError,
    HistoryConflictError,
    InvalidArgumentError,
    SessionNotFoundError,
    StaleWriterError,
    TierIOError,
    TurnRefusedError,
)
from tieredkv.fsck_redis import RedisReport, check_prefix
from tieredkv.payload import RETIRED_SEQ, segment_id
from tieredkv.testing import Segment

__all__ = ["own_redis_server", "redis_server"]  # fixtures used below

CAPACITY = 64 << 20
SMALL_VALUES = 64 << 10


@pytest.fixture
def turns() -> Iterator[list[Segment]]:
    made: list[Segment] = []
    yield made
    for t in made:
        t.close()


@pytest.fixture
def prefix() -> str:
    return new_prefix()


def _replica(server: RedisServer, prefix: str, name: str, **kw: object) -> RedisTier:
    return RedisTier(server.url, CAPACITY, prefix=prefix, value_size=SMALL_VALUES, name=name, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def tier(redis_server: RedisServer, prefix: str) -> AsyncIterator[RedisTier]:
    async with _replica(redis_server, prefix, "A") as t:
        yield t


@pytest.fixture
async def peer(redis_server: RedisServer, prefix: str) -> AsyncIterator[RedisTier]:
    async with _replica(redis_server, prefix, "B") as t:
        yield t


async def _store(tier: RedisTier, t: Segment) -> None:
    assert tier.reserve(t.key, t.length)
    try:
        await tier.write(t.key, t.view)
    finally:
        tier.release(t.key)


async def _read(tier: RedisTier, keys: list[SegmentKey]) -> list[bytes]:
    outs = [memoryview(bytearray(tier.length(k))) for k in keys]
    await tier.read(keys, outs)
    return [bytes(o) for o in outs]


def _keys(server: RedisServer, prefix: str) -> set[str]:
    with server.client() as c:
        return {k.decode() for k in c.scan_iter(match=f"{prefix}:{{*")}


async def _fsck(server: RedisServer, prefix: str, secret: bytes | None = None) -> RedisReport:
    check = functools.partial(check_prefix, server.url, prefix, secret=secret)
    return await anyio.to_thread.run_sync(check)


def _base(prefix: str, session: str) -> str:
    return f"{prefix}:{{{conversation_tag(session)}}}"


async def _parent_and_fork(
    tier: RedisTier, turns: list[Segment], *, parent: str = "p", fork: str = "c"
) -> tuple[Segment, Segment, Segment]:
    """``parent``: two turns; ``fork``: a fork of its first turn and 100 tokens of its
    second, then its own turn (seq 2)."""
    p0, p1 = Segment(parent, 0, 300, seed=1), Segment(parent, 1, 400, seed=2)
    c2 = Segment(fork, 2, 200, seed=3, base=((parent, 0, 300), (parent, 1, 100)))
    turns += [p0, p1, c2]
    await _store(tier, p0)
    await _store(tier, p1)
    await _store(tier, c2)
    return p0, p1, c2


async def test_a_fork_references_its_parent_and_every_replica_reads_it(
    tier: RedisTier, peer: RedisTier, redis_server: RedisServer, prefix: str, turns: list[Segment]
) -> None:
    """The fork's manifest names the parent's segments (one copy of their bytes on the
    server, a reference set per segment naming the fork); another replica gets the whole
    history and reads it byte for byte."""
    p0, p1, c2 = await _parent_and_fork(tier, turns)
    keys = _keys(redis_server, prefix)
    assert not [k for k in keys if k.startswith(f"{_base(prefix, 'c')}:0:")]  # nothing copied
    refs = sorted(k for k in keys if k.endswith(":r"))
    assert len(refs) == 2
    with redis_server.client() as c:
        assert [c.smembers(r) for r in refs] == [{f"{_base(prefix, 'c')}:m".encode()}] * 2
    state = await peer.refresh("c")
    assert state.status == "changed"
    assert [(h.session, h.seq) for h in state.headers] == [("p", 0), ("p", 1), ("c", 2)]
    assert await _read(peer, [p0.key, p1.key, c2.key]) == [p0.data, p1.data, c2.data]
    assert (await peer.lookup("p"))[1].seq == 1
    report = await _fsck(redis_server, prefix)
    assert report.clean, report.damaged
    assert (report.segments, report.reclaimable) == (3, 0)


async def test_a_parent_dropped_on_another_replica_keeps_what_its_fork_lists(
    tier: RedisTier, peer: RedisTier, redis_server: RedisServer, prefix: str, turns: list[Segment]
) -> None:
    """The parent's writer drops it: its manifest goes, the segments the fork lists stay
    (retired) and the key cannot start a new history; the fork reads on, byte for byte.
    When the fork goes, the parent's last bytes go with it: nothing stays on the server."""
    p0, p1, c2 = await _parent_and_fork(tier, turns)
    p2 = Segment("p", 2, 50, seed=4)
    turns.append(p2)
    await _store(tier, p2)  # (the parent goes on after the fork: turn 2 is its own)
    await peer.refresh("c", take=True)
    assert await tier.discard("p")
    assert await peer.lookup("p") == []
    keys = _keys(redis_server, prefix)
    assert f"{_base(prefix, 'p')}:m" not in keys
    assert not [k for k in keys if k.startswith(f"{_base(prefix, 'p')}:2:")]  # unreferenced
    assert await _read(peer, [p0.key, p1.key, c2.key]) == [p0.data, p1.data, c2.data]
    new = Segment("p", 0, 300, seed=9)
    turns.append(new)
    third = _replica(redis_server, prefix, "C")  # (its open scans the fork)
    await third.open()
    try:
        with pytest.raises(HistoryConflictError, match="forks still list its history"):
            await _store(third, new)
        report = await _fsck(redis_server, prefix)
        assert report.clean, report.damaged
        # (the fork's own turn; p's two retired turns are checked as its references)
        assert (report.segments, report.leaked, report.reclaimable) == (1, 0, 0)
        assert await peer.discard("c")
        assert _keys(redis_server, prefix) <= {f"{_base(prefix, 'p')}:m"}  # (C's lease)
        await _store(third, new)  # the key is free again
        assert await _read(third, [new.key]) == [new.data]
    finally:
        await third.aclose()


async def test_a_fork_commit_is_refused_without_trace_when_its_parent_range_is_gone(
    tier: RedisTier, peer: RedisTier, redis_server: RedisServer, prefix: str, turns: list[Segment]
) -> None:
    """A replica whose view of the parent is stale (the parent was dropped meanwhile) or
    whose referenced bytes the server lost cannot commit the fork: nothing of it stays."""
    p0, p1 = Segment("p", 0, 300, seed=1), Segment("p", 1, 400, seed=2)
    turns += [p0, p1]
    await _store(tier, p0)
    await _store(tier, p1)
    await peer.refresh("p")  # the peer's view of p: then p is dropped
    assert await tier.discard("p")
    before = _keys(redis_server, prefix)
    c2 = Segment("c", 2, 200, seed=3, base=(("p", 0, 300), ("p", 1, 100)))
    turns.append(c2)
    with pytest.raises(HistoryConflictError, match="no longer in the shared tier"):
        await _store(peer, c2)
    assert not peer.contains(c2.key)
    # (the fork's empty manifest, the lease its writer took, holds no history)
    assert _keys(redis_server, prefix) - before <= {f"{_base(prefix, 'c')}:m"}
    assert await tier.lookup("c") == []
    # a referenced part evicted by the server: refused the same way
    q0, q1 = Segment("q", 0, 300, seed=5), Segment("q", 1, 400, seed=6)
    turns += [q0, q1]
    await _store(tier, q0)
    await _store(tier, q1)
    with redis_server.client() as c:
        c.delete(
            next(k for k in _keys(redis_server, prefix) if k.startswith(f"{_base(prefix, 'q')}:1:"))
        )
    d2 = Segment("d", 2, 200, seed=7, base=(("q", 0, 300), ("q", 1, 100)))
    turns.append(d2)
    with pytest.raises(HistoryConflictError, match="no longer in the shared tier"):
        await _store(tier, d2)
    assert not [k for k in _keys(redis_server, prefix) if k.endswith(":r")]
    assert await peer.lookup("d") == []


async def test_a_fork_commit_refuses_another_historys_turn_under_its_parents_key(
    tier: RedisTier, redis_server: RedisServer, prefix: str, turns: list[Segment]
) -> None:
    """A fork's first turn names the very segments it inherits (``base_ids``). Once the
    parent's history was dropped and another one started under its key, the tier indexes
    the new turn 0 there: a commit of the fork that names the old one is refused, and
    nothing of the fork is stored (it used to reference the new turn: every replica then
    served a splice of the new history's first tokens and the fork's own turn, or failed
    with a ``RuntimeError`` when the new turn was shorter than the tokens the fork takes,
    as in fleet campaign seed 6005). A fork that names the new turn commits."""
    # (the segment id is the header's: its creation time, which the cache sets, tells two
    # histories' turns apart; these differ in their length instead)
    old, new = Segment("p", 0, 300, seed=1), Segment("p", 0, 310, seed=9)
    turns += [old, new]
    await _store(tier, old)
    assert await tier.discard("p")
    await _store(tier, new)
    stale = Segment("c", 1, 200, seed=3, base=(("p", 0, 100),), base_ids=(segment_id(old.header),))
    turns.append(stale)
    before = _keys(redis_server, prefix)
    with pytest.raises(HistoryConflictError, match="another history's there now"):
        await _store(tier, stale)
    assert not tier.contains(stale.key)
    assert _keys(redis_server, prefix) - before <= {f"{_base(prefix, 'c')}:m"}  # (its lease)
    assert not [k for k in _keys(redis_server, prefix) if k.endswith(":r")]
    assert await tier.lookup("c") == []
    fork = Segment("d", 1, 200, seed=4, base=(("p", 0, 100),), base_ids=(segment_id(new.header),))
    turns.append(fork)
    await _store(tier, fork)
    assert await _read(tier, [new.key, fork.key]) == [new.data, fork.data]


async def test_a_fenced_replica_cannot_commit_a_fork(
    tier: RedisTier, peer: RedisTier, redis_server: RedisServer, prefix: str, turns: list[Segment]
) -> None:
    """A replica another one took the fork's key over from is refused by the server: no
    reference is recorded, the parent's drop then deletes all of it."""
    p0 = Segment("p", 0, 300, seed=1)
    turns.append(p0)
    await _store(tier, p0)
    await tier.acquire("c")
    await peer.acquire("c", force=True)
    c1 = Segment("c", 1, 100, seed=2, base=(("p", 0, 300),))
    turns.append(c1)
    with pytest.raises(StaleWriterError):
        await _store(tier, c1)
    assert not [k for k in _keys(redis_server, prefix) if k.endswith(":r")]
    assert await tier.discard("p")
    assert _keys(redis_server, prefix) <= {f"{_base(prefix, 'c')}:m"}


async def test_a_fork_whose_referenced_bytes_vanished_is_never_spliced(
    tier: RedisTier, peer: RedisTier, redis_server: RedisServer, prefix: str, turns: list[Segment]
) -> None:
    """A referenced part the server evicted: reading the fork fails (never other bytes),
    and every conversation listing that segment (the fork, its parent) is taken out."""
    p0, p1, c2 = await _parent_and_fork(tier, turns)
    await peer.refresh("c")
    with redis_server.client() as c:
        c.delete(
            next(
                k
                for k in _keys(redis_server, prefix)
                if k.startswith(f"{_base(prefix, 'p')}:1:") and not k.endswith(":r")
            )
        )
    with pytest.raises(CorruptSegmentError, match="gone"):
        await _read(peer, [p0.key, p1.key, c2.key])
    assert not peer.contains(c2.key)
    assert await tier.lookup("c") == []  # taken out for every replica
    with pytest.raises(CorruptSegmentError, match="gone"):  # (and p, by its next reader)
        await _read(tier, [p1.key])
    assert await peer.lookup("p") == []


async def test_restart_empty_loses_the_fork_as_a_whole(
    own_redis_server: RedisServer, turns: list[Segment]
) -> None:
    """A server restarted empty: a replica that knew the fork finds it lost (a miss for
    the cache), never a part of it."""
    prefix = new_prefix()
    async with _replica(own_redis_server, prefix, "A") as tier:
        await _parent_and_fork(tier, turns)
        own_redis_server.restart(empty=True)
        assert (await tier.refresh("c")).status == "lost"
        assert not tier.contains(("c", 2))
        assert (await tier.refresh("p")).status == "lost"
        assert not tier.contains(("p", 0))


async def test_fsck_reports_a_dangling_reference_and_a_reclaimable_range(
    tier: RedisTier, redis_server: RedisServer, prefix: str, turns: list[Segment]
) -> None:
    """A fork whose referenced bytes are gone is damage; a retired range whose only
    referrer's manifest vanished (evicted under maxmemory) is reclaimable."""
    await _parent_and_fork(tier, turns)
    with redis_server.client() as c:
        c.delete(
            next(
                k
                for k in _keys(redis_server, prefix)
                if k.startswith(f"{_base(prefix, 'p')}:0:") and not k.endswith(":r")
            )
        )
    report = await _fsck(redis_server, prefix)
    dangling = [
        d.problem for d in report.damaged if d.path == f"{_base(prefix, 'c')}:m reference 0"
    ]
    assert dangling
    assert dangling[0].startswith("a dangling reference: value ")
    assert not report.clean
    other = new_prefix()
    async with _replica(redis_server, other, "A2") as t2:
        await _parent_and_fork(t2, turns)
        assert await t2.discard("p")  # retired: the fork lists p's turns 0 and 1
        with redis_server.client() as c:
            c.delete(f"{_base(other, 'c')}:m")  # the fork's manifest evicted
        report = await _fsck(redis_server, other)
        # (the fork's own turn is leaked: nothing names it any more)
        assert (report.reclaimable, report.leaked, report.damaged) == (2, 1, [])


async def test_fsck_reports_a_fork_whose_reference_names_another_historys_turn(
    tier: RedisTier, redis_server: RedisServer, prefix: str, turns: list[Segment]
) -> None:
    """A fork manifest whose reference names a segment other than the one its first turn
    names in ``base_ids`` (another history's turn 0 of its parent's key, as a commit before
    that check could reference: forged here from a copy of such a turn's values) is damage,
    though every value it names checks out; the fork as committed is clean."""
    old, new = Segment("p", 0, 300, seed=1), Segment("p", 0, 310, seed=9)
    fork = Segment("c", 1, 200, seed=3, base=(("p", 0, 100),), base_ids=(segment_id(new.header),))
    turns += [old, new, fork]
    other = new_prefix()
    async with _replica(redis_server, other, "elsewhere") as elsewhere:
        await _store(elsewhere, old)
    await _store(tier, new)
    await _store(tier, fork)
    assert (await _fsck(redis_server, prefix)).clean
    with redis_server.client() as c:
        p, m = f"{_base(prefix, 'p')}:m", f"{_base(prefix, 'c')}:m"
        entry = msgspec.msgpack.decode(c.hget(f"{_base(other, 'p')}:m", "e:0"), type=Entry)
        for i in range(entry.parts):  # old's values, under this prefix's key for p's turn 0
            src, dst = (f"{_base(x, 'p')}:0:{entry.nonce}:{i}" for x in (other, prefix))
            c.copy(src, dst)
        ref = Ref("p", c.hget(p, "id").decode(), 0, entry)
        c.hset(m, mapping={"r:0": encode_entry(ref), "q:0": ref.qfield(prefix)})
        c.sadd(f"{_base(prefix, 'p')}:0:{entry.nonce}:r", m)
    report = await _fsck(redis_server, prefix)
    assert [(d.path, d.problem.split(":")[0]) for d in report.damaged] == [
        (f"{_base(prefix, 'c')}:m reference", "a dangling reference")
    ]
    assert "another history's turns" in report.damaged[0].problem
    assert [(s.session, s.turns) for s in report.sessions] == [("c", 0), ("p", 1)]


async def test_forks_with_a_secret(
    redis_server: RedisServer, prefix: str, turns: list[Segment]
) -> None:
    """With a secret, a fork's references are part of its manifest's MAC, and the parent's
    segments are checked with the parent's incarnation by every replica."""
    secret = b"0123456789abcdef-fleet"
    async with (
        _replica(redis_server, prefix, "A", secret=secret) as a,
        _replica(redis_server, prefix, "B", secret=secret) as b,
    ):
        p0, p1, c2 = await _parent_and_fork(a, turns)
        assert (await b.refresh("c")).status == "changed"
        keys = [p0.key, p1.key, c2.key]
        got = await _read(b, keys)
        assert got == await _read(a, keys)  # (as authenticated: MACs in their headers)
        assert [len(g) for g in got] == [p0.length, p1.length, c2.length]
        assert (await _fsck(redis_server, prefix, secret)).clean


# -- forks through the cache, several replicas over one server ----------------------------


def _kv(i: int, tokens: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + i)
    return {n: torch.randn(tokens, 64, generator=gen).to(torch.bfloat16) for n in ("k", "v")}


def _cat(*parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: torch.cat([p[n] for p in parts]) for n in ("k", "v")}


def _cut(kv: dict[str, torch.Tensor], tokens: int) -> dict[str, torch.Tensor]:
    return {n: t[:tokens] for n, t in kv.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.int16), b[k].view(torch.int16))
        for k in a
    )


def _cache(server: RedisServer, prefix: str) -> TieredKVCache:
    shared = RedisTier(server.url, CAPACITY, prefix=prefix, value_size=SMALL_VALUES, lease_ttl=0.3)
    return TieredKVCache([HostMemoryTier(8 << 20), shared], mode="inclusive")


P0, P1, C = _kv(0, 48), _kv(1, 40), _kv(2, 24)
"""The parent's two turns (48 and 40 tokens), the fork's own turn."""
FORK = _cat(_cut(_cat(P0, P1), 60), C)
"""The fork's history: the parent's first 60 tokens (inside its second turn), its turn."""


async def _parent_on_a_fork_on_b(a: TieredKVCache, b: TieredKVCache) -> None:
    await a.append("p", P0, answer_tokens=8)
    await a.append("p", P1, answer_tokens=8)
    await a.flush()
    await b.append("c", C, answer_tokens=4, parent="p", parent_tokens=60)
    await b.flush()


async def test_a_fork_of_another_replicas_conversation_is_served_everywhere(
    redis_server: RedisServer, prefix: str
) -> None:
    """Replica B forks a conversation replica A wrote; the fork commits only its own turn
    to the shared tier (the parent's bytes stay stored once) and every replica loads the
    fork's history byte for byte, the parent's too."""
    async with _cache(redis_server, prefix) as a, _cache(redis_server, prefix) as b:
        await _parent_on_a_fork_on_b(a, b)
        forked = [k for k in _keys(redis_server, prefix) if k.startswith(_base(prefix, "c"))]
        assert len(forked) == 2  # its manifest and its one turn's value: nothing copied
        assert _same(await a.load("c"), FORK)
        assert _same(await b.load("c"), FORK)
        assert _same(await b.load("p"), _cat(P0, P1))
    async with _cache(redis_server, prefix) as fresh:
        assert _same(await fresh.load("c"), FORK)


async def test_a_parent_dropped_on_another_replica_stays_for_its_fork(
    redis_server: RedisServer, prefix: str
) -> None:
    """A drops the parent after B forked it: the parent is gone for everyone, the fork is
    served byte for byte on every replica, and once the fork goes nothing of either stays
    on the server."""
    async with _cache(redis_server, prefix) as a, _cache(redis_server, prefix) as b:
        await _parent_on_a_fork_on_b(a, b)
        await a.drop("p")
        async with _cache(redis_server, prefix) as c:
            # (its open does not bring the fork back: its parent's segments are not listed
            # by any manifest it scans; its first load reads it from the server, and the
            # open reports no truncation: nothing of it is lost)
            assert c.truncated() == {}
            assert c.stats().truncated == 0
            assert _same(await c.load("c"), FORK)
            with pytest.raises(SessionNotFoundError):
                await c.load("p")
        assert _same(await a.load("c"), FORK)
        await a.drop("c")  # (A took it over with the load: its writer drops it)
    assert _keys(redis_server, prefix) == set()


async def test_a_history_replaced_on_the_server_keeps_its_key_taken_for_a_fork_here(
    redis_server: RedisServer, prefix: str
) -> None:
    """B writes p and forks c from both of p's turns. Another replica takes both over and
    drops them, then writes a new p of other turns. B's load of p cannot take that history
    in (its stale fork c lists the old p's turns under the same keys): a miss, and p's key
    stays taken for c, every turn of it c lists (the load used to forget B's copy of p
    without recording the turns c lists as retired, only the one that conflicted: a later
    turn of another conversation under p's key was then stored over c's, a ``ValueError``
    in fleet campaign seed 454)."""
    async with _cache(redis_server, prefix) as a, _cache(redis_server, prefix) as b:
        await b.append("p", P0, answer_tokens=8)
        await b.append("p", P1, answer_tokens=8)
        await b.append("c", C, answer_tokens=4, parent="p", parent_tokens=60)
        await b.flush()
        await anyio.sleep(0.5)  # (B's leases run out)
        for key in ("c", "p"):
            await a.load(key)
            await a.drop(key)
        for i in range(3):
            await a.append("p", _kv(10 + i, 16), answer_tokens=1)
        await a.flush()
        with pytest.raises(SessionNotFoundError):
            await b.load("p")
        assert unowned(b) == []
        with pytest.raises(InvalidArgumentError, match="forks still list its history"):
            await b.append("p", _kv(20, 16), answer_tokens=1)
        with pytest.raises(SessionNotFoundError):  # (dropped on the server)
            await b.load("c")
        assert unowned(b) == []


async def test_a_fenced_replica_cannot_extend_a_fork(
    redis_server: RedisServer, prefix: str
) -> None:
    """Once another replica took the fork over (it loaded it), the replica that made it
    cannot append to it: nothing of its turn is stored, and the fork stays as committed."""
    async with _cache(redis_server, prefix) as a, _cache(redis_server, prefix) as b:
        await _parent_on_a_fork_on_b(a, b)
        assert _same(await a.load("c"), FORK)
        with pytest.raises(StaleWriterError):
            await b.append("c", _kv(3, 8), answer_tokens=1)
        assert _same(await a.load("c"), FORK)


async def test_a_fork_the_server_lost_is_a_counted_miss(own_redis_server: RedisServer) -> None:
    """The server restarted empty: the fork (and its parent) cannot be proven current, and
    a load is a counted miss, never a part of the history."""
    prefix = new_prefix()
    async with _cache(own_redis_server, prefix) as a, _cache(own_redis_server, prefix) as b:
        await _parent_on_a_fork_on_b(a, b)
        own_redis_server.restart(empty=True)
        with pytest.raises(SessionNotFoundError, match="lost its history"):
            await b.load("c")
        assert b.stats().unproven == 1
        with pytest.raises(SessionNotFoundError):
            await a.load("c")


@pytest.mark.parametrize("then", ["restart-empty", "dropped-again"])
async def test_a_history_taken_over_and_dropped_elsewhere_is_not_served_as_new_here(
    own_redis_server: RedisServer, then: str
) -> None:
    """A commits ``p``; B takes it over, drops it, starts it again and forks it. A's load
    of the fork indexes B's new turn 0 under ``p``'s key, which drops A's view of ``p``
    (stale) while A still holds its old writer token. Then the server restarts empty, or B
    drops ``p`` again: A's load of ``p`` is a counted miss. It used to find no manifest,
    no view to compare with and its own token, take ``p`` for a conversation started here
    and never committed, and serve A's old turn (found by the fleet campaign, seed 1637).
    A's new history under the key is then committed if the server no longer holds the
    fork, and refused if it does."""
    prefix = new_prefix()
    async with _cache(own_redis_server, prefix) as a, _cache(own_redis_server, prefix) as b:
        await a.append("p", P0, answer_tokens=8)
        await a.flush()
        assert _same(await b.load("p"), P0)  # B takes it over
        await b.drop("p")
        await b.append("p", P1, answer_tokens=8)  # another history under the key
        await b.append("f", C, answer_tokens=4, parent="p")
        await b.flush()
        with pytest.raises(SessionNotFoundError):  # (its turn 0 is not A's: a miss)
            await a.load("f")
        if then == "restart-empty":
            own_redis_server.restart(empty=True)
        else:
            await b.drop("p")
        shared = a.tiers[1]
        assert isinstance(shared, RedisTier)
        assert await shared.lookup("p") == []  # (a fork's write-through asks so: it is
        before = a.stats()  # still reported lost to the load after it)
        with pytest.raises(SessionNotFoundError, match="lost its history"):
            await a.load("p")
        after = a.stats()
        assert (after.unproven, after.lost) == (before.unproven + 1, before.lost + 1)
        assert not a.contains("p")
        assert "1 history(ies) found lost" in shared.stats().notes[2]  # (counted once)
        with pytest.raises(SessionNotFoundError, match="lost its history"):
            await a.load("p")
        # A starts ``p`` again. Its tier's view of the fork still indexes B's turn 0 under
        # ``p``'s key; it is read again first. After the empty restart the server holds no
        # fork: A's turn is committed (it used to be refused at every append, until A
        # happened to read the fork again). After the drop the fork keeps that turn: refused.
        await a.append("p", C, answer_tokens=4)
        if then == "restart-empty":
            await a.flush()
            async with _cache(own_redis_server, prefix) as c:
                assert _same(await c.load("p"), C)
        else:
            with pytest.raises(TurnRefusedError, match="a fork lists it"):
                await a.flush()
            assert _same(await b.load("f"), _cat(P1, C))


async def test_a_fork_of_a_conversation_dropped_meanwhile_is_refused(
    redis_server: RedisServer, prefix: str
) -> None:
    """B forks a conversation whose only copy is the shared tier's, after A dropped it: B
    learns it is gone and stores nothing."""
    async with _cache(redis_server, prefix) as a, _cache(redis_server, prefix) as b:
        await a.append("p", P0, answer_tokens=8)
        await a.flush()
        await a.drop("p")
        with pytest.raises(SessionNotFoundError):
            await b.append("c", C, answer_tokens=4, parent="p", parent_tokens=20)
        assert not b.contains("c")


def _with_ssd(server: RedisServer, prefix: str, ssd: SSDTier) -> TieredKVCache:
    """B of the tests below: host memory, ``ssd``, then the shared tier."""
    shared = RedisTier(server.url, CAPACITY, prefix=prefix, value_size=SMALL_VALUES, lease_ttl=0.3)
    return TieredKVCache([HostMemoryTier(8 << 20), ssd, shared], mode="inclusive")


async def _parent_lost_on_b(
    server: RedisServer, prefix: str, a: TieredKVCache, b: TieredKVCache
) -> Callable[[], None]:
    """A's ``p`` and B's fork ``c`` of it; the server loses ``p``'s manifest (as
    ``maxmemory`` evicts one), B's load finds ``p`` gone and B loads ``c``. Returns what
    puts the manifest back."""
    await _parent_on_a_fork_on_b(a, b)
    manifest = f"{_base(prefix, 'p')}:m"
    with server.client() as c:
        saved = c.dump(manifest)
        c.delete(manifest)
    with pytest.raises(SessionNotFoundError):
        await b.load("p")
    assert _same(await b.load("c"), FORK)

    def back() -> None:
        with server.client() as c:
            c.restore(manifest, 0, saved)

    return back


async def test_a_conversation_taken_in_again_loses_its_marker_and_its_drop_writes_one(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """B (host, SSD, Redis) forks A's conversation; the server loses the parent's manifest
    (as ``maxmemory`` evicts one) and B's load finds it gone: its key stays taken on B for
    the fork (its turns are the fork's), and the fork's copy into SSD writes the parent's
    retirement marker there. The manifest comes back and B takes the parent in again: it
    is live, so its marker goes (left there, a restart would take the parent for retired
    and serve none of its turns). Dropping it then writes one again (the fork still lists
    its turns): the drop succeeds and the fork is still served byte for byte."""
    C3 = _kv(3, 8)
    b = _with_ssd(redis_server, prefix, SSDTier(tmp_path / "ssd", 8 << 20))
    async with _cache(redis_server, prefix) as a, b:
        back = await _parent_lost_on_b(redis_server, prefix, a, b)
        await b.append("c", C3, answer_tokens=1)  # (written through to SSD: p's turns too)
        await b.flush()
        assert b.stats().tiers[1].segments == 5  # p's two turns, c's two, p's marker
        back()
        assert _same(await b.load("p"), _cat(P0, P1))
        await b.flush()
        assert b.stats().tiers[1].segments == 4  # the marker is gone
        await b.drop("p")
        assert b.stats().tiers[1].segments == 5  # written again
        assert _same(await b.load("c"), _cat(FORK, C3))
        assert _same(await a.load("c"), _cat(FORK, C3))


async def _forked_on_b_then_lost(
    server: RedisServer, prefix: str, a: TieredKVCache, b: TieredKVCache, g: dict[str, torch.Tensor]
) -> None:
    """A's p (one turn), taken in by B, which forks g (turn ``g``) from its first 20
    tokens; then the server loses p's manifest (as ``maxmemory`` evicts one)."""
    await a.append("p", P0, answer_tokens=8)
    await a.flush()
    assert _same(await b.load("p"), P0)
    await b.append("g", g, answer_tokens=1, parent="p", parent_tokens=20)
    await b.flush()
    with server.client() as c:
        c.delete(f"{_base(prefix, 'p')}:m")


async def _forked_on_b_then_extended_on_a(
    a: TieredKVCache, b: TieredKVCache, g: dict[str, torch.Tensor]
) -> None:
    """A's p (one turn), taken in by B, which forks g (turn ``g``) from its first 20
    tokens; then A extends p (``P1``) and forks c (``C``) from its first 60 tokens. Every
    lease has run out when it returns."""
    await a.append("p", P0, answer_tokens=8)
    await a.flush()
    assert _same(await b.load("p"), P0)
    await b.append("g", g, answer_tokens=1, parent="p", parent_tokens=20)
    await b.flush()
    await anyio.sleep(0.5)  # (B's lease on p runs out)
    assert _same(await a.load("p"), P0)
    await a.append("p", P1, answer_tokens=8)
    await a.append("c", C, answer_tokens=4, parent="p", parent_tokens=60)
    await a.flush()
    await anyio.sleep(0.5)  # (A's leases run out)


@pytest.mark.parametrize("then", ["append", "load"])
async def test_a_history_the_server_lost_stays_retired_here_across_a_restart(
    redis_server: RedisServer, prefix: str, tmp_path: Path, then: str
) -> None:
    """B (host, SSD, Redis) took in A's p and forked g from it; the server loses p's
    manifest, and B's load of p is a miss: p's turn stays in SSD for g only, and p's key
    stays taken (a new p is refused). B restarts over the same SSD: the same holds (its
    load still misses, a new p is still refused), and g is served byte for byte. The
    load used to record p as retired without writing its retirement marker into SSD: the
    restarted B took p's turn there for a live p, and appended a new turn of p to the
    history it had reported lost."""
    G = _kv(4, 8)
    async with _cache(redis_server, prefix) as a:
        ssd = SSDTier(tmp_path / "ssd", 8 << 20)
        async with _with_ssd(redis_server, prefix, ssd) as b:
            await _forked_on_b_then_lost(redis_server, prefix, a, b, G)
            with pytest.raises(SessionNotFoundError):
                await b.load("p")
            assert sorted(ssd.keys()) == [("g", 1), ("p", 0), ("p", RETIRED_SEQ)]
            with pytest.raises(InvalidArgumentError, match="forks still list its history"):
                await b.append("p", P1, answer_tokens=1)
        async with _with_ssd(redis_server, prefix, SSDTier(tmp_path / "ssd", 8 << 20)) as b:
            assert not b.contains("p")
            if then == "load":
                with pytest.raises(SessionNotFoundError):
                    await b.load("p")
            with pytest.raises(InvalidArgumentError, match="forks still list its history"):
                await b.append("p", P1, answer_tokens=1)
            assert _same(await b.load("g"), _cat(_cut(P0, 20), G))
            assert b.stats().errors == 0


class _MarkerGate(SSDTier):
    """An SSD tier whose writes of retirement markers wait for :attr:`go` once
    :attr:`hold` is set (:attr:`waiting` says one does), then fail if :attr:`fail` is."""

    def __init__(self, root: Path, capacity: int) -> None:
        super().__init__(root, capacity)
        self.hold = False
        self.fail = False
        self.waiting = anyio.Event()
        self.go = anyio.Event()

    async def write_filled(
        self,
        key: SegmentKey,
        data: memoryview,
        cuts: Sequence[int],
        fill: Callable[[int], None],
    ) -> None:
        if self.hold and key[1] == RETIRED_SEQ:
            self.waiting.set()
            await self.go.wait()
            if self.fail:
                raise TierIOError(self.name, "write a retirement marker", "injected")
        await super().write_filled(key, data, cuts, fill)


async def test_a_retirement_marker_a_load_could_not_write_is_written_at_the_next_load(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """As above, but SSD refuses the marker's write: the load that finds p lost raises
    ``TierIOError`` (the marker is missing), and the next load of p writes it, then
    misses. p's key stays taken throughout, and g is served byte for byte."""
    G = _kv(4, 8)
    ssd = _MarkerGate(tmp_path / "ssd", 8 << 20)
    async with _cache(redis_server, prefix) as a, _with_ssd(redis_server, prefix, ssd) as b:
        await _forked_on_b_then_lost(redis_server, prefix, a, b, G)
        ssd.hold = ssd.fail = True
        ssd.go.set()
        with pytest.raises(TierIOError, match="retirement marker"):
            await b.load("p")
        assert sorted(ssd.keys()) == [("g", 1), ("p", 0)]
        with pytest.raises(InvalidArgumentError, match="forks still list its history"):
            await b.append("p", P1, answer_tokens=1)
        ssd.fail = False
        with pytest.raises(SessionNotFoundError):
            await b.load("p")
        assert sorted(ssd.keys()) == [("g", 1), ("p", 0), ("p", RETIRED_SEQ)]
        assert _same(await b.load("g"), _cat(_cut(P0, 20), G))


async def test_a_parent_taken_in_again_while_its_marker_is_written_loses_it_once_written(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    """As above, but B takes the parent in again while the fork's copy into SSD is still
    writing the parent's retirement marker there. The load waits for that write, then
    deletes the marker (it used to forget the parent's record meanwhile: the marker was
    then in SSD unlisted, and the parent's drop tried to write it again and failed with a
    ``ValueError``). The drop succeeds, and the fork is served byte for byte."""
    C3 = _kv(3, 8)
    ssd = _MarkerGate(tmp_path / "ssd", 8 << 20)
    b = _with_ssd(redis_server, prefix, ssd)
    async with _cache(redis_server, prefix) as a, b:
        back = await _parent_lost_on_b(redis_server, prefix, a, b)
        ssd.hold = True
        await b.append("c", C3, answer_tokens=1)  # (its copy into SSD writes p's marker)
        with anyio.fail_after(10):
            await ssd.waiting.wait()
        back()
        async with anyio.create_task_group() as tg:

            async def load() -> None:
                assert _same(await b.load("p"), _cat(P0, P1))

            tg.start_soon(load)
            await anyio.sleep(0.2)  # (the load waits for the marker's write)
            ssd.go.set()
        await b.flush()
        assert b.stats().tiers[1].segments == 4  # p's two turns, c's two: no marker
        await b.drop("p")
        assert _same(await b.load("c"), _cat(FORK, C3))
        assert _same(await a.load("c"), _cat(FORK, C3))


class _FailingMarkers(RedisTier):
    """A Redis tier whose writes of retirement markers fail once :attr:`fail` is set."""

    fail = False

    def _check(self, key: SegmentKey) -> None:
        if self.fail and key[1] == RETIRED_SEQ:
            raise TierIOError(self.name, "write a retirement marker", "injected")

    async def write(self, key: SegmentKey, data: memoryview) -> None:
        self._check(key)
        await super().write(key, data)

    async def write_pieces(self, key: SegmentKey, *args: Any, **kwargs: Any) -> None:
        self._check(key)
        await super().write_pieces(key, *args, **kwargs)


@pytest.mark.parametrize(
    ("first", "drop"), [("drop", "succeeds"), ("drop", "fails"), ("copy", "succeeds")]
)
async def test_a_fork_loaded_while_its_parent_is_retired_here_shares_the_parents_marker(
    redis_server: RedisServer, prefix: str, tmp_path: Path, first: str, drop: str
) -> None:
    """B (host, SSD, Redis) took in p's first turn and forked g from it; A then extended p
    and forked c from its second turn. B drops p (g lists its turn: the drop writes p's
    retirement marker into SSD, then into Redis) and, while the marker is being written
    into SSD, loads c and appends to it: c lists p's second turn, which B never listed, so
    B records p as retired for c, and c's copy into SSD needs p's marker there. The copy
    waits for the drop's marker and takes it for its own (it wrote a second one, which
    failed with a ``ValueError`` and took the drop's reservation with it). If the drop
    then fails (its marker cannot be written into Redis: ``fails``), the marker stays in
    SSD for c's copy of p's turn. In the other order (``copy`` first: c's copy is writing
    p's marker into SSD when the drop begins, and the drop's retirement extends the record
    that copy made), the drop waits for that marker and takes it for its own. Either way
    nothing else fails, every tier holding a
    retired turn holds its marker, and g and c are served byte for byte, on B and after a
    restart over the same SSD."""
    G, C3 = _kv(4, 8), _kv(3, 8)
    ssd = _MarkerGate(tmp_path / "ssd", 8 << 20)
    shared = _FailingMarkers(
        redis_server.url, CAPACITY, prefix=prefix, value_size=SMALL_VALUES, lease_ttl=0.3
    )
    async with _cache(redis_server, prefix) as a:
        async with TieredKVCache([HostMemoryTier(8 << 20), ssd, shared], mode="inclusive") as b:
            await _forked_on_b_then_extended_on_a(a, b, G)
            ssd.hold = True
            shared.fail = drop == "fails"
            dropped: list[str] = []

            async def drop_p() -> None:
                try:
                    await b.drop("p")
                    dropped.append("dropped")
                except TierIOError:
                    dropped.append("failed")

            async def copy_c() -> None:
                assert _same(await b.load("c"), FORK)
                await b.append("c", C3, answer_tokens=1)  # (its copy into SSD: p's turns)

            async with anyio.create_task_group() as tg:
                tg.start_soon(drop_p if first == "drop" else copy_c)
                with anyio.fail_after(10):
                    await ssd.waiting.wait()  # (the first one writes p's marker into SSD)
                if first == "drop":
                    await copy_c()
                else:
                    tg.start_soon(drop_p)
                await anyio.sleep(0.2)  # (the second one waits for that marker)
                ssd.go.set()
            assert dropped == ["dropped" if drop == "succeeds" else "failed"]
            shared.fail = False
            await b.flush()
            assert b.stats().errors == 0
            assert unowned(b) == []
            # p's turns (the first for g, both for c), c's two, g's, and p's marker
            assert sorted(ssd.keys()) == [
                ("c", 2),
                ("c", 3),
                ("g", 1),
                ("p", 0),
                ("p", 1),
                ("p", RETIRED_SEQ),
            ]
            assert _same(await b.load("g"), _cat(_cut(P0, 20), G))
            assert _same(await b.load("c"), _cat(FORK, C3))
        async with _with_ssd(redis_server, prefix, SSDTier(tmp_path / "ssd", 8 << 20)) as b:
            assert _same(await b.load("g"), _cat(_cut(P0, 20), G))
            assert _same(await b.load("c"), _cat(FORK, C3))


async def test_a_fork_over_a_key_another_history_holds_here_is_a_conflict(
    redis_server: RedisServer, prefix: str
) -> None:
    """B forks ``c`` from A's conversation and leaves; A's shared tier indexes that fork
    (a look-up, as a load's) without A taking it in. A then forks B's other conversation
    ``q`` (served from the shared tier) under ``c``: its first own turn would fall on a
    turn of the history A's tier indexes under ``c``. Refused as a conflict (a look-up is
    no read of the history that lets A take ``c``'s lease), leaving no trace; the fork B
    made is served as committed."""
    async with _cache(redis_server, prefix) as a:
        async with _cache(redis_server, prefix) as b:
            await _parent_on_a_fork_on_b(a, b)
            await b.append("q", P0, answer_tokens=8)
            await b.append("q", P1, answer_tokens=8)
            await b.flush()
        shared = a.tiers[1]
        assert isinstance(shared, RedisTier)
        assert len(await shared.lookup("c")) == 3
        with pytest.raises(HistoryConflictError, match="which this replica has not read"):
            await a.append("c", C, answer_tokens=4, parent="q")
        assert not a.contains("c")
        await a.flush()
        assert _same(await a.load("c"), FORK)
        assert _same(await a.load("q"), _cat(P0, P1))


async def test_a_parent_started_again_elsewhere_leaves_its_forks_turns_in_the_shared_tier(
    redis_server: RedisServer, prefix: str
) -> None:
    """A forks its own conversation ``p``; B drops ``p`` and starts it again (B's commit is
    refused, but its writer lease leaves ``p`` an empty history on the server, which keeps
    ``p``'s turns for the fork). A's load of ``p`` finds that history: ``p`` leaves A's
    index, while the turns the fork lists stay counted in the shared tier, where the server
    keeps them. So moving the fork down out of a full host tier writes nothing (it used to
    copy ``p``'s turns into the shared tier again, which the tier refused with a
    ``ValueError``, or as another history, costing the fork its acknowledged turns), and
    the fork, extended, is served byte for byte here and on a third replica."""
    shared = RedisTier(
        redis_server.url, CAPACITY, prefix=prefix, value_size=SMALL_VALUES, lease_ttl=0.3
    )
    a = TieredKVCache([HostMemoryTier(96 << 10), shared], mode="inclusive")
    C3 = _kv(3, 8)
    async with a, _cache(redis_server, prefix) as b:
        await a.append("p", P0, answer_tokens=8)
        await a.append("p", P1, answer_tokens=8)
        await a.append("c", C, answer_tokens=4, parent="p", parent_tokens=60)
        await a.flush()
        await b.load("p")
        await b.drop("p")
        await b.append("p", _kv(9, 16), answer_tokens=1)
        with pytest.raises(TurnRefusedError, match="forks still list its history"):
            await b.flush()
        with pytest.raises(SessionNotFoundError):
            await a.load("p")
        written = shared.stats().writes
        for i in range(3):  # (the host tier holds 96 KiB: the fork moves down)
            await a.append("x", _kv(20 + i, 200), answer_tokens=1)
        assert a.where("c") == "redis"
        assert shared.stats().writes == written + 3  # x's turns only
        await a.append("c", C3, answer_tokens=1)
        await a.flush()
        assert a.stats().errors == 0
        assert _same(await a.load("c"), _cat(FORK, C3))
        async with _cache(redis_server, prefix) as third:
            assert _same(await third.load("c"), _cat(FORK, C3))


def _slow_to_commit(server: RedisServer, prefix: str) -> TieredKVCache:
    """A cache whose shared tier gives up on a stopped server after 0.2 s (its commits wait
    to be tried again) and holds its leases for 5 s (it stays the writer meanwhile)."""
    shared = RedisTier(
        server.url,
        CAPACITY,
        prefix=prefix,
        value_size=SMALL_VALUES,
        lease_ttl=5.0,
        liveness=0.3,  # (a fresh server: the first commit waits thrice this)
        timeout=0.2,
    )
    return TieredKVCache([HostMemoryTier(8 << 20), shared], mode="inclusive")


async def _failing_twice(
    server: RedisServer, cache: TieredKVCache, append: Callable[[], Awaitable[object]]
) -> None:
    """``append`` (a turn acknowledged here), then the server stopped until two tries of
    its commit have failed: the next try is 0.2 s off when this returns, the server back."""
    errors = cache.stats().errors
    await append()
    server.pause()
    try:
        for _ in range(1000):  # polled: the write-through runs in its own task
            if cache.stats().errors >= errors + 2:
                break
            await anyio.sleep(0.01)
    finally:
        server.resume()


async def _fork_waiting(server: RedisServer, a: TieredKVCache) -> None:
    """``p`` (two turns, committed), then its fork ``c`` (:data:`FORK`), whose first turn
    waits to be committed."""
    await a.append("p", P0, answer_tokens=8)
    await a.append("p", P1, answer_tokens=8)
    await a.flush()
    fork = functools.partial(a.append, "c", C, answer_tokens=4, parent="p", parent_tokens=60)
    await _failing_twice(server, a, fork)


async def test_a_parent_dropped_while_its_forks_turn_waits_keeps_what_the_fork_lists(
    own_redis_server: RedisServer,
) -> None:
    """A's fork ``c`` of its conversation ``p`` gets a turn that waits to be committed (the
    server was stopped). Between two tries the server is back and A drops ``p``: the
    server keeps ``p``'s turns for the fork, and so does A's index of the shared tier. The
    fork's turn is then committed (it used to be refused, with the turns it inherits, as A
    tried to write them again as ``p``'s: lost for the fork), and a third replica is
    served all of it."""
    prefix = new_prefix()
    C3 = _kv(3, 8)
    async with _slow_to_commit(own_redis_server, prefix) as a:
        await a.append("p", P0, answer_tokens=8)
        await a.append("p", P1, answer_tokens=8)
        await a.append("c", C, answer_tokens=4, parent="p", parent_tokens=60)
        await a.flush()
        await _failing_twice(own_redis_server, a, lambda: a.append("c", C3, answer_tokens=1))
        await a.drop("p")
        await a.flush()
        assert _same(await a.load("c"), _cat(FORK, C3))
        async with _cache(own_redis_server, prefix) as third:
            assert _same(await third.load("c"), _cat(FORK, C3))


async def test_a_flush_while_a_drop_fails_does_not_take_a_waiting_commit_for_made(
    own_redis_server: RedisServer, tmp_path: Path
) -> None:
    """A's ``p`` (forked as ``c``) has a turn whose commit waits (the server was stopped).
    With the server stopped again, A drops ``p``: the drop writes ``p``'s retirement
    marker into SSD first, and that write fails. A ``flush()`` meanwhile reports the
    waiting commit (it used to return as if it were made: the drop had forgotten it before
    its point of no return); once the server is back, a flush commits it and another
    replica is served ``p`` whole."""
    prefix = new_prefix()
    ssd = _MarkerGate(tmp_path / "ssd", 8 << 20)
    shared = RedisTier(
        own_redis_server.url,
        CAPACITY,
        prefix=prefix,
        value_size=SMALL_VALUES,
        lease_ttl=5.0,
        liveness=0.3,
        timeout=0.2,
    )
    async with TieredKVCache([HostMemoryTier(8 << 20), ssd, shared], mode="inclusive") as a:
        await a.append("p", P0, answer_tokens=8)
        await a.append("c", C, answer_tokens=4, parent="p", parent_tokens=20)
        await a.flush()
        await _failing_twice(own_redis_server, a, lambda: a.append("p", P1, answer_tokens=8))
        own_redis_server.pause()
        ssd.hold = ssd.fail = True
        try:
            async with anyio.create_task_group() as tg:

                async def drop() -> None:
                    with pytest.raises(TierIOError, match="injected"):
                        await a.drop("p")

                tg.start_soon(drop)
                with anyio.fail_after(10):
                    await ssd.waiting.wait()
                with pytest.raises(TierIOError, match="commit the latest turns"):
                    await a.flush()
                ssd.go.set()
        finally:
            own_redis_server.resume()
        await a.flush()
        async with _cache(own_redis_server, prefix) as third:
            assert _same(await third.load("p"), _cat(P0, P1))


async def test_a_fork_loaded_while_its_first_turn_waits_is_served_and_committed(
    own_redis_server: RedisServer,
) -> None:
    """A forks its conversation, and the fork's first turn waits to be committed (the
    server was stopped): its manifest there is empty (A holds its lease). A load of the
    fork meanwhile serves A's copy, and the flush then commits the turn: nothing is refused
    (the load used to take the shared tier out of the turns the fork inherits, as if they
    were the fork's own turns past an empty history, and the commit then refused them all),
    and a third replica is served the fork."""
    prefix = new_prefix()
    async with _slow_to_commit(own_redis_server, prefix) as a:
        await _fork_waiting(own_redis_server, a)
        assert _same(await a.load("c"), FORK)
        await a.flush()
        assert a.stats().refused == 0
        async with _cache(own_redis_server, prefix) as third:
            assert _same(await third.load("c"), FORK)


async def test_a_parent_dropped_before_its_forks_first_turn_is_committed_stays_dropped(
    own_redis_server: RedisServer,
) -> None:
    """A forks ``p`` and the fork's first turn waits to be committed; A drops ``p`` meanwhile.
    Nothing references ``p``'s turns on the server yet, so the drop deletes them: the
    fork cannot be committed, and its turns are refused (reported by the flush). ``p``
    stays dropped for every replica (the fork's write-through used to write ``p``'s turns
    again under ``p``'s key, bringing the dropped conversation back)."""
    prefix = new_prefix()
    async with _slow_to_commit(own_redis_server, prefix) as a:
        await _fork_waiting(own_redis_server, a)
        await a.drop("p")
        with pytest.raises(TurnRefusedError, match="turns it inherits left the shared tier"):
            await a.flush()
        async with _cache(own_redis_server, prefix) as third:
            for key in ("p", "c"):
                with pytest.raises(SessionNotFoundError):
                    await third.load(key)
        base = _base(prefix, "p")
        assert not [k for k in _keys(own_redis_server, prefix) if k.startswith(f"{base}:")]


async def test_a_fork_whose_parent_another_history_replaced_is_refused_never_spliced(
    own_redis_server: RedisServer,
) -> None:
    """A forks ``p`` at 20 tokens and the fork's first turn waits to be committed. B drops
    ``p`` and starts it again with other KV (``X``). A's load of ``p`` finds that history
    under the key the fork lists (a miss on A, which keeps the key for its fork). The fork
    is then refused, never committed: its turn was computed after ``P0``'s first 20
    tokens, not ``X``'s (its commit used to reference ``X``'s turn, and every replica was
    served ``X``'s tokens followed by the fork's turn)."""
    prefix = new_prefix()
    X = _kv(7, 48)
    async with _slow_to_commit(own_redis_server, prefix) as a:
        async with _cache(own_redis_server, prefix) as b:
            await a.append("p", P0, answer_tokens=8)
            await a.flush()
            fork = functools.partial(
                a.append, "c", C, answer_tokens=4, parent="p", parent_tokens=20
            )
            await _failing_twice(own_redis_server, a, fork)
            await b.load("p")
            await b.drop("p")
            await b.append("p", X, answer_tokens=8)
            await b.flush()
        with pytest.raises(SessionNotFoundError):
            await a.load("p")
        with pytest.raises(TurnRefusedError, match="turns it inherits left the shared tier"):
            await a.flush()
        async with _cache(own_redis_server, prefix) as third:
            with pytest.raises(SessionNotFoundError):
                await third.load("c")
            assert _same(await third.load("p"), X)


async def test_a_forks_first_turn_that_does_not_fit_waits_and_its_parent_stays(
    redis_server: RedisServer, prefix: str
) -> None:
    """A's shared tier, as A counts it, has room for the parent ``p`` but not for the first
    turn of its fork as well. The fork's write-through does not make room by taking ``p``
    out (the turns its commit references): the turn waits for room, acknowledged here and
    not refused (it used to be refused with the turns it inherits, ``p`` taken out of the
    shared tier on this replica), and ``p`` stays committed there."""
    sizes = _cache(redis_server, new_prefix())
    async with sizes:
        await _parent_on_a_fork_on_b(sizes, sizes)
        used = sizes.stats().tiers[1].used
    shared = RedisTier(
        redis_server.url, used - 4096, prefix=prefix, value_size=SMALL_VALUES, lease_ttl=0.3
    )
    async with TieredKVCache([HostMemoryTier(8 << 20), shared], mode="inclusive") as a:
        await a.append("p", P0, answer_tokens=8)
        await a.append("p", P1, answer_tokens=8)
        await a.flush()
        await a.append("c", C, answer_tokens=4, parent="p", parent_tokens=60)
        with pytest.raises(TierIOError, match="the tier is full"):
            await a.flush()
        assert a.stats().refused == 0
        assert _same(await a.load("c"), FORK)
    async with _cache(redis_server, prefix) as b:
        assert _same(await b.load("p"), _cat(P0, P1))


async def test_a_parent_evicted_here_while_its_forks_first_turn_waits_is_not_refused(
    own_redis_server: RedisServer,
) -> None:
    """A forks ``p`` and the fork's first turn waits to be committed; then another
    conversation's turn evicts ``p`` from both of A's tiers (A's share of the shared tier
    is small): ``p`` leaves A's index, while the server keeps it. The fork's write-through
    finds ``p``'s turns in ``p``'s committed history there, indexes them again and commits
    the fork: nothing is refused (refusing it, as the fork of a dropped parent is, was a
    regression of the gate that keeps a dropped parent from coming back), and a third
    replica is served both."""
    prefix = new_prefix()
    P2 = _kv(4, 40)
    shared = RedisTier(
        own_redis_server.url,
        88 << 10,
        prefix=prefix,
        value_size=SMALL_VALUES,
        lease_ttl=5.0,
        liveness=0.3,
        timeout=0.2,
    )
    async with TieredKVCache([HostMemoryTier(96 << 10), shared], mode="inclusive") as a:
        for kv in (P0, P1, P2):
            await a.append("p", kv, answer_tokens=1)
        await a.flush()
        fork = functools.partial(a.append, "c", C, answer_tokens=4, parent="p", parent_tokens=60)
        await _failing_twice(own_redis_server, a, fork)
        await a.append("x", _kv(9, 200), answer_tokens=1)
        await a.flush()
        assert a.stats().refused == 0
        assert not a.contains("p")
    async with _cache(own_redis_server, prefix) as third:
        assert _same(await third.load("c"), FORK)
        assert _same(await third.load("p"), _cat(P0, P1, P2))


async def test_a_committed_forks_later_turn_makes_room_from_its_parents_own_turns(
    redis_server: RedisServer, prefix: str
) -> None:
    """A's share of the shared tier holds ``p`` (three turns) and the first turn of its
    fork, little more. The fork's next turn makes room there by letting ``p`` go from
    A's count: the two turns the fork lists stay (the server keeps them for it), ``p``'s
    third frees the room, and the turn is committed (protecting ``p`` as a victim for
    good, not only until the fork's first turn is committed, left it waiting for room
    forever)."""
    P2, C3 = _kv(4, 40), _kv(3, 24)
    shared = RedisTier(
        redis_server.url, 52 << 10, prefix=prefix, value_size=SMALL_VALUES, lease_ttl=0.3
    )
    async with TieredKVCache([HostMemoryTier(8 << 20), shared], mode="inclusive") as a:
        for kv in (P0, P1, P2):
            await a.append("p", kv, answer_tokens=1)
        await a.append("c", C, answer_tokens=4, parent="p", parent_tokens=60)
        await a.flush()
        await a.append("c", C3, answer_tokens=1)
        await a.flush()
        assert a.stats().refused == 0
    async with _cache(redis_server, prefix) as b:
        assert _same(await b.load("c"), _cat(FORK, C3))
