"""Pin groups: a pin may name a group (``RetentionHint(pin=True, group=...)``, e.g. a
tenant), and the cache bounds each group's pinned bytes (``max_pinned_bytes_per_group``)
where it bounds all of them (``max_pinned_bytes``): a pin past its group's bound is
refused with nothing changed, a pinned conversation that grows past it loses its pin, and
a release or the end of a pin's ttl takes its bytes out of its group."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

from tests.hinting import KIB, Clock, seg
from tieredkv import (
    HostMemoryTier,
    InvalidArgumentError,
    InvalidTypeError,
    PinLimitError,
    RetentionHint,
    TieredKVCache,
)

ONE = 4 * KIB
"""The stored bytes of each turn of 3 tokens (1 KiB each, and the segment's header, in a
tier that stores 4 KiB pages)."""


def pin(group: str | None = None, ttl: float | None = None) -> RetentionHint:
    return RetentionHint(pin=True, ttl=ttl, group=group)


def cache(clock: Clock | None = None, **bounds: Any) -> TieredKVCache:
    """A cache of one host tier, room for everything, with the given pin bounds."""
    return TieredKVCache(
        [HostMemoryTier(256 * KIB)], eviction="lru", clock=clock or Clock(), **bounds
    )


async def stored(c: TieredKVCache, *sessions: str) -> None:
    for i, session in enumerate(sessions):
        meta = await c.append(session, seg(3, i), answer_tokens=1)
        assert meta.nbytes == ONE


async def test_a_pin_past_its_groups_bound_is_refused_and_nothing_changes() -> None:
    async with cache(max_pinned_bytes_per_group=ONE + ONE // 2) as c:
        await stored(c, "a1", "a2")
        meta = c.hint("a1", pin("tenant-a"))
        assert (meta.pinned_until, meta.pin_group) == (math.inf, "tenant-a")
        c.hint("a2", RetentionHint(priority=3))
        before = c.channel["a2"]
        with pytest.raises(PinLimitError) as refused:
            c.hint("a2", RetentionHint(pin=True, ttl=60.0, priority=-1, group="tenant-a"))
        assert c.channel["a2"] == before  # nothing changed: not the priority either
        assert dict(c.channel.pins) == {"a1": math.inf}
        error = refused.value
        assert (error.session, error.group) == ("a2", "tenant-a")
        assert (error.nbytes, error.pinned, error.bound) == (ONE, ONE, ONE + ONE // 2)
        message = str(error)
        assert "of group 'tenant-a', past its bound of 6,144" in message
        assert "(max_pinned_bytes_per_group)" in message
        assert "release a pin of the group" in message
        # the same session's re-pin does not count its own bytes twice
        c.hint("a1", pin("tenant-a", ttl=30.0))
        assert c.channel["a1"].pinned_until == 30.0


async def test_groups_are_bounded_independently_and_ungrouped_pins_by_no_group() -> None:
    async with cache(max_pinned_bytes_per_group=ONE) as c:
        await stored(c, "a1", "a2", "b1", "free1", "free2")
        c.hint("a1", pin("tenant-a"))
        c.hint("b1", pin("tenant-b"))  # another group: its own bound
        c.hint("free1", pin())  # no group: only the bound on all pinned bytes
        c.hint("free2", pin())
        with pytest.raises(PinLimitError, match="group 'tenant-a'"):
            c.hint("a2", pin("tenant-a"))
        assert set(c.channel.pins) == {"a1", "b1", "free1", "free2"}
        # a pin moves to the group its latest pin names: b1 into tenant-a's, which is full
        with pytest.raises(PinLimitError, match="group 'tenant-a'"):
            c.hint("b1", pin("tenant-a"))
        assert c.channel["b1"].pin_group == "tenant-b"
        c.hint("a1", pin())  # a1 re-pinned without a group leaves tenant-a's
        assert c.channel["a1"].pin_group is None
        c.hint("a2", pin("tenant-a"))  # room in tenant-a now
        assert c.channel["a2"].pin_group == "tenant-a"


async def test_the_bound_on_all_pinned_bytes_applies_on_top_of_the_groups() -> None:
    async with cache(max_pinned_bytes=2 * ONE, max_pinned_bytes_per_group=2 * ONE) as c:
        await stored(c, "a1", "b1", "b2")
        c.hint("a1", pin("tenant-a"))
        c.hint("b1", pin("tenant-b"))
        with pytest.raises(PinLimitError) as refused:  # tenant-b has room; the cache none
            c.hint("b2", pin("tenant-b"))
        assert refused.value.group is None
        assert "(max_pinned_bytes)" in str(refused.value)
        assert c.channel["b2"].pinned_until is None


async def test_a_pinned_conversation_that_grows_past_its_groups_bound_loses_its_pin(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with cache(max_pinned_bytes_per_group=2 * ONE + ONE // 2) as c:
        await stored(c, "a1", "a2", "b1")
        c.hint("a1", pin("tenant-a"))
        c.hint("a2", pin("tenant-a"))
        c.hint("b1", pin("tenant-b"))
        with caplog.at_level(logging.WARNING, logger="tieredkv.cache"):
            meta = await c.append("a1", seg(3, 9), answer_tokens=1)
        assert (meta.nbytes, meta.pinned_until, meta.pin_group) == (2 * ONE, None, None)
        assert c.channel["a1"].pinned_until is None
        # the group's other pin, and another group's, stay
        assert dict(c.channel.pins) == {"a2": math.inf, "b1": math.inf}
        [record] = caplog.records
        message = record.getMessage()
        assert "conversation 'a1' grew to 8192 bytes" in message
        assert "the pinned bytes of group 'tenant-a' (12288)" in message
        assert "max_pinned_bytes_per_group (10240), so its pin is released" in message
        # a growth within the group's bound keeps the pin
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tieredkv.cache"):
            meta = await c.append("b1", seg(3, 10), answer_tokens=1)
        assert (meta.nbytes, meta.pinned_until, meta.pin_group) == (2 * ONE, math.inf, "tenant-b")
        assert caplog.records == []


@pytest.mark.parametrize("bound", ["max_pinned_bytes", "max_pinned_bytes_per_group"])
async def test_an_append_that_pins_again_is_checked_against_the_grown_history(
    bound: str,
) -> None:
    """A pinned conversation's append carries a pin hint again and takes it past a bound:
    the turn is stored, the old pin is released as the history grows, and the new pin is
    refused. Before, the hint's refusal came first and left the old pin on a history past
    the bound."""
    group = "tenant-a" if bound.endswith("group") else None
    bounds: dict[str, Any] = {bound: ONE + ONE // 2}
    async with cache(**bounds) as c:
        await stored(c, "a1")
        c.hint("a1", pin(group))
        with pytest.raises(PinLimitError) as refused:
            await c.append("a1", seg(3, 9), answer_tokens=1, hint=pin(group))
        assert (refused.value.nbytes, refused.value.pinned, refused.value.group) == (
            2 * ONE,
            0,
            group,
        )
        meta = c.channel["a1"]
        assert (meta.nbytes, meta.pinned_until, meta.pin_group) == (2 * ONE, None, None)
        assert dict(c.channel.pins) == {}


async def test_a_fork_and_its_pinned_parent_count_what_they_share_once() -> None:
    """A pinned parent (8 KiB) and its pinned fork (4 KiB of its own, the parent's 8 KiB
    inherited) hold 12 KiB of the tier: a bound of 12 KiB takes both. Before, each pin
    counted its whole history, the shared turns twice (20 KiB), and the fork's pin was
    refused."""
    async with cache(max_pinned_bytes=3 * ONE, max_pinned_bytes_per_group=3 * ONE) as c:
        await c.append("parent", seg(3, 0), answer_tokens=1)
        await c.append("parent", seg(3, 1), answer_tokens=1)
        fork = await c.append("fork", seg(3, 2), answer_tokens=1, parent="parent")
        assert (fork.nbytes, fork.shared_bytes) == (3 * ONE, 2 * ONE)
        c.hint("parent", pin("tenant-a"))
        assert c.hint("fork", pin("tenant-a")).pinned_until == math.inf
        # a third conversation's 4 KiB are past both bounds: refused, naming what it adds
        await stored(c, "other")
        with pytest.raises(PinLimitError) as refused:
            c.hint("other", pin())
        assert (refused.value.nbytes, refused.value.pinned) == (ONE, 3 * ONE)
        # the fork grows by 4 KiB: 16 KiB held, past both; it loses its pin, the parent not
        meta = await c.append("fork", seg(3, 3), answer_tokens=1)
        assert meta.pinned_until is None
        assert dict(c.channel.pins) == {"parent": math.inf}


async def test_a_release_and_a_pins_end_free_its_groups_bytes() -> None:
    clock = Clock()
    async with cache(clock, max_pinned_bytes_per_group=ONE) as c:
        await stored(c, "a1", "a2", "a3")
        c.hint("a1", pin("tenant-a"))
        with pytest.raises(PinLimitError):
            c.hint("a2", pin("tenant-a", ttl=10.0))
        meta = c.hint("a1", RetentionHint(pin=False))  # a release takes it out
        assert (meta.pinned_until, meta.pin_group) == (None, None)
        c.hint("a2", pin("tenant-a", ttl=10.0))
        clock.now = 9.0
        with pytest.raises(PinLimitError):
            c.hint("a3", pin("tenant-a"))
        clock.now = 10.0  # a2's pin ended: its bytes count no more
        assert c.hint("a3", pin("tenant-a")).pinned_until == math.inf
        # a2 grows after its pin ended: nothing to release, a3 keeps its pin
        await c.append("a2", seg(3, 11), answer_tokens=1)
        assert c.channel["a3"].pinned_until == math.inf


async def test_pin_groups_refuse_bad_input() -> None:
    with pytest.raises(InvalidTypeError, match="a pin's group must be a str, not 7"):
        RetentionHint(pin=True, group=7)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="a pin's group is empty; use any non-"):
        RetentionHint(pin=True, group="")
    with pytest.raises(ValueError, match="group is the group of a pin: give it with pin=True"):
        RetentionHint(priority=1, group="tenant-a")
    with pytest.raises(ValueError, match="give it with pin=True"):
        RetentionHint(pin=False, group="tenant-a")
    with pytest.raises(InvalidArgumentError, match="max_pinned_bytes_per_group must be from 0"):
        cache(max_pinned_bytes_per_group=-1)
    with pytest.raises(InvalidTypeError, match="max_pinned_bytes_per_group must be an int"):
        cache(max_pinned_bytes_per_group=1.5)
    async with cache(max_pinned_bytes_per_group=0) as c:  # 0: a group may pin nothing
        await stored(c, "a1")
        with pytest.raises(PinLimitError, match="past its bound of 0"):
            c.hint("a1", pin("tenant-a"))
        assert c.hint("a1", pin()).pinned_until == math.inf  # a pin of no group may
