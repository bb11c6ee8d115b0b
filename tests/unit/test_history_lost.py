"""A conversation whose history the cache lost (its last copy evicted, or found damaged)
is not extended by the next append as if nothing happened: the append that would extend
it raises ``HistoryLostError`` once and stores nothing, unless a call told the caller
first (a load that missed, a ``discover`` that found nothing, a ``drop``); after that,
the conversation starts afresh with the turn appended. Before, the append stored its turn
as the first of a new history, which a caller that appends without loading took for the
old one extended (fleet campaign seed 7005: an acknowledged five-turn history loaded as
its last turn alone)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from tieredkv import HistoryLostError, HostMemoryTier, SessionNotFoundError, SSDTier, TieredKVCache

from ..invariants import problems
from .test_cache import _flip_body, assert_same, joined, kv

KIB = 1 << 10


async def _evicted(cache: TieredKVCache) -> None:
    """``a``'s two turns, then other conversations until host memory (the only tier) has
    evicted ``a``: its history is lost."""
    for t in range(2):
        await cache.append("a", kv(8, t), answer_tokens=4)
    i = 0
    while cache.contains("a"):
        await cache.append(f"other{i}", kv(8, 100 + i), answer_tokens=4)
        i += 1
    assert cache.channel["a"].tier is None
    assert cache.stats().lost == 1


async def test_an_append_to_a_history_lost_since_it_was_loaded_raises_once() -> None:
    async with TieredKVCache([HostMemoryTier(64 * KIB)]) as cache:
        await _evicted(cache)
        before = cache.channel["a"]
        with pytest.raises(HistoryLostError, match="'a' lost its history") as caught:
            await cache.append("a", kv(8, 2), answer_tokens=4)
        assert isinstance(caught.value, SessionNotFoundError)  # (a KeyError: a miss)
        assert caught.value.session == "a"
        assert not cache.contains("a")
        assert cache.channel["a"] == before  # nothing stored
        assert problems(cache) == []
        meta = await cache.append("a", kv(8, 2), answer_tokens=4)  # told: a new history
        assert (meta.turns, meta.tokens) == (1, 8)
        assert_same(await cache.load("a"), kv(8, 2))


@pytest.mark.parametrize("told_by", ["load", "discover", "drop"])
async def test_a_call_that_reported_the_loss_lets_the_next_append_start_afresh(
    told_by: str,
) -> None:
    async def load(cache: TieredKVCache) -> None:
        with pytest.raises(SessionNotFoundError):
            await cache.load("a")

    async def discover(cache: TieredKVCache) -> None:
        assert not await cache.discover("a")

    async def drop(cache: TieredKVCache) -> None:
        await cache.drop("a")

    calls: dict[str, Callable[[TieredKVCache], Awaitable[None]]] = {
        "load": load,
        "discover": discover,
        "drop": drop,
    }
    async with TieredKVCache([HostMemoryTier(64 * KIB)]) as cache:
        await _evicted(cache)
        await calls[told_by](cache)
        meta = await cache.append("a", kv(8, 2), answer_tokens=4)
        assert meta.turns == 1
        assert_same(await cache.load("a"), kv(8, 2))
        assert problems(cache) == []


async def test_a_fork_under_the_key_of_a_lost_history_starts_afresh() -> None:
    """A fork's first turn names its parent: it starts the conversation whatever was
    stored under its key before, and the loss is not raised later."""
    async with TieredKVCache([HostMemoryTier(64 * KIB)]) as cache:
        await _evicted(cache)
        await cache.append("p", kv(8, 50), answer_tokens=4)
        meta = await cache.append("a", kv(8, 2), answer_tokens=4, parent="p")
        assert (meta.parent, meta.turns) == ("p", 2)
        meta = await cache.append("a", kv(8, 3), answer_tokens=4)
        assert meta.turns == 3
        assert_same(await cache.load("a"), joined([kv(8, 50), kv(8, 2), kv(8, 3)]))


@pytest.mark.parametrize("how", ["cancelled drop", "failed fork"])
async def test_a_drop_or_fork_that_did_not_happen_leaves_the_loss_to_be_told(how: str) -> None:
    """A drop cancelled before it did anything, or a fork whose parent is not stored, told
    the caller nothing: the loss is still raised by the next plain append (it used to be
    consumed, and the append stored its turn as the whole history: a splice)."""
    async with TieredKVCache([HostMemoryTier(64 * KIB)]) as cache:
        await _evicted(cache)
        if how == "cancelled drop":
            with anyio.move_on_after(0) as scope:
                await cache.drop("a")
            assert scope.cancelled_caught
            assert cache.stats().cancelled == 1
        else:
            with pytest.raises(SessionNotFoundError, match="nope"):
                await cache.append("a", kv(8, 2), answer_tokens=4, parent="nope")
        with pytest.raises(HistoryLostError, match="'a' lost its history"):
            await cache.append("a", kv(8, 3), answer_tokens=4)
        assert not cache.contains("a")
        assert problems(cache) == []
        meta = await cache.append("a", kv(8, 3), answer_tokens=4)  # told: a new history
        assert (meta.turns, meta.tokens) == (1, 8)


async def test_a_history_a_load_found_damaged_is_reported_by_that_load(tmp_path: Path) -> None:
    """The miss of a load that finds the only copy damaged is the report: the next append
    starts afresh; what a restart finds agrees."""
    async with TieredKVCache([SSDTier(tmp_path, 4 << 20)]) as cache:
        await cache.append("a", kv(8, 0), answer_tokens=4)
    _flip_body(tmp_path, "a")
    async with TieredKVCache([SSDTier(tmp_path, 4 << 20)]) as cache:
        with pytest.raises(SessionNotFoundError, match="damaged"):
            await cache.load("a")
        meta = await cache.append("a", kv(8, 1), answer_tokens=4)
        assert meta.turns == 1
        assert problems(cache) == []
    async with TieredKVCache([SSDTier(tmp_path, 4 << 20)]) as cache:
        assert_same(await cache.load("a"), kv(8, 1))


@pytest.mark.parametrize("told_by", ["load", "discover"])
async def test_a_call_that_finds_the_conversation_stored_tells_the_caller_of_an_earlier_loss(
    told_by: str,
) -> None:
    """A loss recorded for a conversation that is stored again by the time the caller asks
    about it (with a shared tier: another replica's history, taken in since) is told by
    that call: the append after it extends what is stored. (Fleet campaign seed 7036 on
    the first version of this rule: appends right after a load that had served the
    conversation were refused.) The loss is recorded here by hand, as a shared tier's
    look-up records it, on a cache without one."""
    async with TieredKVCache([HostMemoryTier(64 * KIB)]) as cache:
        await cache.append("a", kv(8, 0), answer_tokens=4)
        cache._core.lost("a")
        if told_by == "load":
            assert_same(await cache.load("a"), kv(8, 0))
        else:
            assert await cache.discover("a")
        meta = await cache.append("a", kv(8, 1), answer_tokens=4)
        assert meta.turns == 2
        assert_same(await cache.load("a"), joined([kv(8, 0), kv(8, 1)]))


async def test_a_lost_conversation_keeps_no_index_entry_and_is_still_told() -> None:
    """A cache whose last tier evicts loses a conversation at each eviction. Its index
    entry (1.5 KB of the 1.9 KB each kept: ``benchmarks/_lost_records.py``) goes once
    nothing uses it; the channel's record (``tier`` None) and the unreported loss stay, so
    the next append is still refused once, and a drop still ends the record. Before,
    every conversation ever lost stayed in the index until it was dropped."""
    async with TieredKVCache([HostMemoryTier(64 * KIB)]) as cache:
        core = cache._core
        await _evicted(cache)
        assert "a" not in core.sessions
        for i in range(200):
            await cache.append(f"more{i}", kv(8, 200 + i), answer_tokens=4)
        stored = {k for k in cache.channel if cache.channel[k].tier is not None}
        assert set(core.sessions) == stored  # only what the tier holds
        with pytest.raises(HistoryLostError):
            await cache.append("a", kv(8, 2), answer_tokens=4)
        assert "a" not in core.sessions  # (the refused append left no entry behind)
        assert cache.channel["a"].tier is None
        drops = cache.stats().drops
        await cache.drop("more0")  # lost, with no index entry: the drop ends its record
        assert "more0" not in cache.channel
        assert cache.stats().drops == drops + 1
        meta = await cache.append("more0", kv(8, 3), answer_tokens=4)  # told: afresh
        assert meta.turns == 1
        with pytest.raises(SessionNotFoundError):
            await cache.drop("never-stored")
        assert problems(cache) == []
