"""``append(..., expected_tokens=N)``: the turn is stored only if the cache holds exactly
``N`` tokens of the conversation, checked under its lock.

Without it, the cache tells a continuation of a lost history from a new conversation only
by its record of the loss (:class:`~tieredkv.HistoryLostError`), and a cache opened after
the loss keeps no such record: on 7 December 2026 a turn appended to a conversation
evicted from an SSD tier before a close was stored, after the reopen, as a one-turn
history (a script like the second test, without ``expected_tokens``). A caller that says
how long the history it extends is gets that refused, and two appends racing to extend
the same history cannot both be stored.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from tieredkv import (
    HistoryLengthError,
    HistoryLostError,
    HostMemoryTier,
    InvalidArgumentError,
    InvalidTypeError,
    SSDTier,
    TieredKVCache,
)

from ..invariants import problems
from .test_cache import assert_same, joined, kv
from .test_history_lost import _evicted

KIB = 1 << 10


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


async def test_a_turn_extends_the_history_it_names_and_nothing_else() -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20)]) as cache:
        meta = await cache.append("a", kv(8, 0), answer_tokens=4, expected_tokens=0)
        assert (meta.turns, meta.tokens) == (1, 8)
        meta = await cache.append("a", kv(8, 1), answer_tokens=4, expected_tokens=8)
        assert (meta.turns, meta.tokens) == (2, 16)
        before = cache.channel["a"]
        for expected, match in [
            (8, "holds 16 tokens in this cache, but this turn extends a history of 8 "),
            (24, "holds 16 tokens in this cache, but this turn extends a history of 24 "),
            (0, "already stored: append only the tokens after its 16"),
        ]:
            with pytest.raises(HistoryLengthError, match=match) as caught:
                await cache.append("a", kv(8, 2), answer_tokens=4, expected_tokens=expected)
            assert (caught.value.session, caught.value.held) == ("a", 16)
            assert caught.value.expected == expected
        assert cache.channel["a"] == before  # nothing stored
        assert_same(await cache.load("a"), joined([kv(8, 0), kv(8, 1)]))
        with pytest.raises(HistoryLengthError, match="the history is not here") as caught:
            await cache.append("b", kv(8, 3), answer_tokens=4, expected_tokens=8)
        assert (caught.value.held, caught.value.expected) == (0, 8)
        assert "b" not in cache.channel
        assert "b" not in cache._core.sessions
        assert problems(cache) == []


async def test_a_history_lost_before_a_restart_is_not_extended(tmp_path: Path) -> None:
    """The cache opened after the loss has no record of it: only the caller's count of the
    history tells the continuation apart from a first turn."""
    async with TieredKVCache([SSDTier(tmp_path, 64 * KIB)]) as cache:
        await _evicted(cache)
    on_disk = files(tmp_path)
    async with TieredKVCache([SSDTier(tmp_path, 64 * KIB)]) as cache:
        assert "a" not in cache.channel  # no record of the loss survives the close
        with pytest.raises(HistoryLengthError, match="holds 0 tokens") as caught:
            await cache.append("a", kv(8, 2), answer_tokens=4, expected_tokens=16)
        assert (caught.value.held, caught.value.expected) == (0, 16)
        assert "a" not in cache.channel
        assert files(tmp_path) == on_disk  # nothing written, nothing removed
        # the caller recomputes the whole history and stores it from its start
        whole = joined([kv(8, 0), kv(8, 1), kv(8, 2)])
        meta = await cache.append("a", whole, answer_tokens=4, expected_tokens=0)
        assert (meta.turns, meta.tokens) == (1, 24)
        assert problems(cache) == []
    async with TieredKVCache([SSDTier(tmp_path, 64 * KIB)]) as cache:
        assert_same(await cache.load("a"), whole)


async def test_a_loss_not_yet_told_starts_afresh_at_0_and_refuses_a_continuation() -> None:
    async with TieredKVCache([HostMemoryTier(64 * KIB)]) as cache:
        await _evicted(cache)
        with pytest.raises(HistoryLostError, match="'a' lost its history"):
            await cache.append("a", kv(8, 2), answer_tokens=4, expected_tokens=16)
        # told once; the cache still holds nothing of the 16 tokens
        with pytest.raises(HistoryLengthError, match="holds 0 tokens"):
            await cache.append("a", kv(8, 2), answer_tokens=4, expected_tokens=16)
        assert cache.channel["a"].tier is None
        await _evicted_again(cache)
        # a first turn needs no report of the loss first: it cannot be taken for the old
        # history extended
        meta = await cache.append("a", kv(8, 5), answer_tokens=4, expected_tokens=0)
        assert (meta.turns, meta.tokens) == (1, 8)
        assert "a" not in cache._core.unreported
        assert_same(await cache.load("a"), kv(8, 5))
        assert problems(cache) == []


async def _evicted_again(cache: TieredKVCache) -> None:
    """``a`` stored afresh, then lost once more (an unreported loss again)."""
    await cache.append("a", kv(8, 0), answer_tokens=4, expected_tokens=0)
    i = 0
    while cache.contains("a"):
        await cache.append(f"again{i}", kv(8, 300 + i), answer_tokens=4)
        i += 1
    assert "a" in cache._core.unreported


async def test_a_fork_expects_the_tokens_it_inherits() -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20)]) as cache:
        await cache.append("p", joined([kv(8, 0), kv(8, 1)]), answer_tokens=4)
        with pytest.raises(HistoryLengthError, match="holds 8 tokens") as caught:
            await cache.append(
                "f", kv(8, 2), answer_tokens=4, parent="p", parent_tokens=8, expected_tokens=16
            )
        assert caught.value.held == 8
        assert "f" not in cache.channel
        meta = await cache.append(
            "f", kv(8, 2), answer_tokens=4, parent="p", parent_tokens=12, expected_tokens=12
        )
        assert (meta.parent, meta.parent_tokens, meta.tokens) == ("p", 12, 20)
        whole = joined([kv(8, 0), kv(8, 1)])
        head = {name: t[:12] for name, t in whole.items()}
        assert_same(await cache.load("f"), joined([head, kv(8, 2)]))
        assert problems(cache) == []


async def test_two_appends_racing_to_extend_one_history_store_one() -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20)]) as cache:
        await cache.append("a", kv(8, 0), answer_tokens=4, expected_tokens=0)
        outcomes: dict[int, object] = {}

        async def extend(seed: int) -> None:
            try:
                outcomes[seed] = await cache.append(
                    "a", kv(8, seed), answer_tokens=4, expected_tokens=8
                )
            except HistoryLengthError as exc:
                outcomes[seed] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(extend, 1)
            tg.start_soon(extend, 2)
        won = [s for s, o in outcomes.items() if not isinstance(o, HistoryLengthError)]
        (lost,) = [o for o in outcomes.values() if isinstance(o, HistoryLengthError)]
        assert len(won) == 1
        assert (lost.held, lost.expected) == (16, 8)
        assert_same(await cache.load("a"), joined([kv(8, 0), kv(8, won[0])]))


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (-1, InvalidArgumentError, "expected_tokens"),
        (True, InvalidTypeError, "expected_tokens must be an int"),
        ("8", InvalidTypeError, "expected_tokens must be an int"),
    ],
)
async def test_a_bad_expected_tokens_is_refused_and_stores_nothing(
    value: object, error: type[Exception], match: str
) -> None:
    async with TieredKVCache([HostMemoryTier(1 << 20)]) as cache:
        await cache.append("a", kv(8, 0), answer_tokens=4)
        before = cache.channel["a"]
        with pytest.raises(error, match=match):
            await cache.append("a", kv(8, 1), answer_tokens=4, expected_tokens=value)  # type: ignore[arg-type]
        assert cache.channel["a"] == before
        assert_same(await cache.load("a"), kv(8, 0))
