"""``TieredKVCache(max_lost_records=N)``: the records a cache keeps of the conversations it
lost (the channel's entry with ``tier`` None, and the loss not yet reported) stay within
``N``; past it the oldest go, counted and announced (:class:`~tieredkv.Forgotten`).

Without a bound a server whose last tier evicts keeps about 480 bytes per conversation it
ever lost (``benchmarks/_lost_records.py``: 10,992 records after 10,000 conversations on
7 December 2026). With ``max_lost_records=1000`` the same run kept 1,000, and the memory
left allocated stayed at about 0.56 MB whether 10,000 or 30,000 conversations were lost.
"""

from __future__ import annotations

import pytest

from tieredkv import (
    Event,
    Forgotten,
    HistoryLengthError,
    HistoryLostError,
    HostMemoryTier,
    InvalidArgumentError,
    InvalidTypeError,
    KVMeta,
    MetadataChannel,
    SessionNotFoundError,
    TieredKVCache,
)
from tieredkv._cache.lost import LostRecords

from ..invariants import problems
from .test_cache import assert_same, kv

KIB = 1 << 10


async def lose(cache: TieredKVCache, names: list[str]) -> None:
    """Store each of ``names`` (one turn), then others until the host tier (the only one)
    has evicted it: each is lost, in that order."""
    for n, name in enumerate(names):
        await cache.append(name, kv(8, n), answer_tokens=4)
        fillers: list[str] = []
        while cache.contains(name):  # (LRU: the fillers, newer, stay)
            fillers.append(f"{name}-filler{len(fillers)}")
            await cache.append(fillers[-1], kv(8, 100 + len(fillers)), answer_tokens=4)
        for filler in fillers:  # (stored: a drop leaves no record of them)
            await cache.drop(filler)
        assert cache.channel[name].tier is None


def lost_keys(cache: TieredKVCache) -> set[str]:
    return {k for k in cache.channel if cache.channel[k].tier is None}


async def test_the_oldest_records_go_past_the_bound_counted_and_announced() -> None:
    names = [f"c{i}" for i in range(10)]
    events: list[Event] = []
    async with TieredKVCache([HostMemoryTier(64 * KIB)], max_lost_records=3) as cache:
        cache.channel.subscribe(events.append)
        await lose(cache, names)
        assert lost_keys(cache) == {"c7", "c8", "c9"}
        assert set(cache._core.unreported) == {"c7", "c8", "c9"}
        assert cache.stats().lost_records_forgotten == 7
        forgotten = [e for e in events if isinstance(e, Forgotten)]
        assert [e.session for e in forgotten] == names[:7]
        assert all(e.nbytes == 0 for e in forgotten)
        assert problems(cache) == []
        # a loss still recorded is told, as without a bound
        with pytest.raises(HistoryLostError):
            await cache.append("c9", kv(8, 50), answer_tokens=4)
        # one whose record went: the cache knows nothing of it. The caller's count
        # refuses a continuation; a drop finds nothing; a first turn starts afresh
        with pytest.raises(HistoryLengthError, match="holds 0 tokens"):
            await cache.append("c0", kv(8, 50), answer_tokens=4, expected_tokens=8)
        with pytest.raises(SessionNotFoundError):
            await cache.drop("c0")
        meta = await cache.append("c0", kv(8, 51), answer_tokens=4, expected_tokens=0)
        assert (meta.turns, meta.tokens) == (1, 8)
        assert_same(await cache.load("c0"), kv(8, 51))
        assert problems(cache) == []


async def test_a_conversation_stored_again_or_dropped_is_no_record_to_forget() -> None:
    """Records leave the count when the conversation is stored again or dropped: the
    bound holds the most recent losses still recorded, and a stored conversation's
    metadata is never taken off the channel."""
    async with TieredKVCache([HostMemoryTier(64 * KIB)], max_lost_records=2) as cache:
        records = cache._core.lost_records
        await lose(cache, ["a", "b"])
        assert len(records) == 2
        await cache.append("a", kv(8, 7), answer_tokens=4, expected_tokens=0)  # again
        await cache.drop("b")  # (lost: the drop ends its record)
        assert len(records) == 0
        assert cache.channel["a"].tier is not None
        await lose(cache, ["c"])  # (LRU: a, older than c's fillers, is lost first)
        assert lost_keys(cache) == {"a", "c"}
        assert cache.stats().lost_records_forgotten == 0
        await lose(cache, ["d"])
        assert lost_keys(cache) == {"c", "d"}
        assert cache.stats().lost_records_forgotten == 1
        assert problems(cache) == []


async def test_without_a_bound_every_record_stays() -> None:
    async with TieredKVCache([HostMemoryTier(64 * KIB)]) as cache:
        await lose(cache, [f"c{i}" for i in range(6)])
        assert lost_keys(cache) == {f"c{i}" for i in range(6)}
        assert cache.stats().lost_records_forgotten == 0


@pytest.mark.parametrize(
    ("value", "error"),
    [(-1, InvalidArgumentError), ("3", InvalidTypeError), (True, InvalidTypeError)],
)
def test_a_bad_bound_is_refused_saying_which(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="max_lost_records"):
        TieredKVCache([HostMemoryTier(64 * KIB)], max_lost_records=value)  # type: ignore[arg-type]


def _meta(session: str, tier: str | None) -> KVMeta:
    return KVMeta(
        session=session, tier=tier, nbytes=0, tokens=0, turns=0, last_access=0.0, created=0.0
    )


def test_records_in_use_stay_and_the_oldest_others_go() -> None:
    """As the cache calls it: a conversation is still indexed (in use) when its loss is
    published, and stays so while an operation holds it; its record stays meanwhile, even
    past the bound, and goes at a later loss once nothing uses it."""
    channel = MetadataChannel()
    gone: list[str] = []
    used = {"a", "b"}
    records = LostRecords(channel, 1, gone.append, used.__contains__)
    records.put(_meta("a", None))
    records.put(_meta("b", None))  # both in use: both kept, past the bound
    assert gone == []
    assert set(channel) == {"a", "b"}
    assert len(records) == 2
    used.clear()
    used.add("c")
    records.put(_meta("c", None))
    assert gone == ["a", "b"]
    assert set(channel) == {"c"}
    used.clear()
    records.put(_meta("d", None))
    assert gone == ["a", "b", "c"]
    assert set(channel) == {"d"}
    records.put(_meta("d", "host"))  # stored again: not a record any more
    assert len(records) == 0
    assert records.remove("d") is not None
    assert "d" not in channel
    assert gone == ["a", "b", "c"]
