"""The eviction contract, one generic suite that every registered policy plugs into.

A policy passes if it keeps exact accounting, answers :meth:`victims` atomically (enough
bytes from resident, unprotected sessions, or ``None`` with nothing changed), and never
removes anything on its own (the cache calls ``on_remove``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tieredkv.meta import KVMeta, MetadataChannel, TierInfo
from tieredkv.policies import Eviction, eviction_names, make_eviction

CAPACITY = 1_000


def meta(
    session: str, nbytes: int, *, answer: int = 10, turns: int = 1, nxt: float | None = None
) -> KVMeta:
    return KVMeta(
        session=session,
        tier="host",
        copies=("host",),
        nbytes=nbytes,
        tokens=nbytes,
        turns=turns,
        prev_answer_tokens=answer,
        next_access=nxt,
    )


@pytest.fixture(params=eviction_names())
def make(request: pytest.FixtureRequest) -> Callable[[], Eviction]:
    name: str = request.param
    return lambda: make_eviction(name)


@pytest.fixture
def view() -> MetadataChannel:
    return MetadataChannel([TierInfo(name="host", level=0, capacity=CAPACITY)])


def fill(policy: Eviction, view: MetadataChannel, sizes: dict[str, int], t0: float = 0.0) -> None:
    """Access and admit each session once, in order, one second apart."""
    for i, (session, size) in enumerate(sizes.items()):
        m = meta(session, size, nxt=1000.0 + i)
        view.put(m)
        policy.on_access(session, m, t0 + i)
        policy.on_admit(session, m, t0 + i)


SIZES = {"a": 100, "b": 200, "c": 300, "d": 50, "e": 150}


def test_satisfies_protocol_and_registry_name(make: Callable[[], Eviction]) -> None:
    policy = make()
    assert isinstance(policy, Eviction)
    assert policy.name in eviction_names()


def test_empty_policy_frees_nothing(make: Callable[[], Eviction], view: MetadataChannel) -> None:
    policy = make()
    assert len(policy) == 0
    assert policy.resident_bytes() == 0
    assert policy.victims(0, 0.0, view) == []
    assert policy.victims(1, 0.0, view) is None


def test_accounting_tracks_admit_resize_and_remove(
    make: Callable[[], Eviction], view: MetadataChannel
) -> None:
    policy = make()
    fill(policy, view, SIZES)
    assert len(policy) == 5
    assert policy.resident_bytes() == sum(SIZES.values())
    bigger = meta("b", 260, turns=2)
    policy.on_access("b", bigger, 10.0)
    policy.on_admit("b", bigger, 10.0)
    assert len(policy) == 5
    assert policy.resident_bytes() == sum(SIZES.values()) + 60
    policy.on_remove("c")
    policy.on_remove("c")  # twice: the second is a no-op
    policy.on_remove("never-seen")
    assert len(policy) == 4
    assert policy.resident_bytes() == sum(SIZES.values()) + 60 - 300


def test_access_of_non_resident_session_does_not_admit_it(
    make: Callable[[], Eviction], view: MetadataChannel
) -> None:
    policy = make()
    fill(policy, view, SIZES)
    policy.on_access("stranger", meta("stranger", 500), 20.0)
    assert len(policy) == 5
    chosen = policy.victims(sum(SIZES.values()), 21.0, view)
    assert chosen is not None
    assert "stranger" not in chosen


@pytest.mark.parametrize("need", [1, 50, 151, 400, 500])
def test_victims_free_enough_from_distinct_unprotected_residents(
    make: Callable[[], Eviction], view: MetadataChannel, need: int
) -> None:
    policy = make()
    fill(policy, view, SIZES)
    protected = frozenset({"c"})
    chosen = policy.victims(need, 10.0, view, protected)
    assert chosen is not None
    assert len(set(chosen)) == len(chosen)
    assert set(chosen) <= set(SIZES) - protected
    assert sum(SIZES[s] for s in chosen) >= need


def test_victims_do_not_remove(make: Callable[[], Eviction], view: MetadataChannel) -> None:
    policy = make()
    fill(policy, view, SIZES)
    assert policy.victims(300, 10.0, view)
    assert len(policy) == 5
    assert policy.resident_bytes() == sum(SIZES.values())


def test_impossible_request_answers_none_and_changes_nothing(
    make: Callable[[], Eviction], view: MetadataChannel
) -> None:
    probe, twin = make(), make()
    fill(probe, view, SIZES)
    fill(twin, view, SIZES)
    assert probe.victims(sum(SIZES.values()) + 1, 10.0, view) is None
    assert probe.victims(10, 10.0, view, protected=frozenset(SIZES)) is None
    assert probe.victims(401, 10.0, view, protected=frozenset({"a", "b", "e"})) is None
    assert len(probe) == len(twin)
    assert probe.resident_bytes() == twin.resident_bytes()
    for need in (1, 120, 350, 799):
        assert probe.victims(need, 11.0, view) == twin.victims(need, 11.0, view)


def test_removed_session_is_never_a_victim(
    make: Callable[[], Eviction], view: MetadataChannel
) -> None:
    policy = make()
    fill(policy, view, SIZES)
    for session in ("a", "d"):
        policy.on_remove(session)
    chosen = policy.victims(sum(SIZES.values()) - 150, 10.0, view)
    assert chosen is not None
    assert not {"a", "d"} & set(chosen)


def test_readmitted_session_is_tracked_once(
    make: Callable[[], Eviction], view: MetadataChannel
) -> None:
    policy = make()
    fill(policy, view, SIZES)
    policy.on_remove("b")
    m = meta("b", 120, turns=2, nxt=2000.0)
    view.put(m)
    policy.on_access("b", m, 30.0)
    policy.on_admit("b", m, 30.0)
    policy.on_admit("b", m, 30.0)  # an idempotent re-admission
    assert len(policy) == 5
    assert policy.resident_bytes() == sum(SIZES.values()) - 200 + 120
    chosen = policy.victims(policy.resident_bytes(), 31.0, view)
    assert chosen is not None
    assert sorted(chosen) == sorted(SIZES)


def test_pinned_sessions_are_never_victims_until_the_pin_ends(
    make: Callable[[], Eviction], view: MetadataChannel
) -> None:
    """Pins (``KVMeta.pinned_until``, indexed by the view's ``pins``) are enforced where
    victims are chosen: a pinned session is protected until ``now`` reaches its end."""
    policy = make()
    fill(policy, view, SIZES)
    view.update("a", pinned_until=20.0)
    view.update("c", pinned_until=float("inf"))
    everything = sum(SIZES.values())
    assert policy.victims(everything, 10.0, view) is None  # a and c may not go
    chosen = policy.victims(everything - 400, 10.0, view)
    assert chosen is not None
    assert {"a", "c"}.isdisjoint(chosen)
    chosen = policy.victims(everything - 300, 20.0, view)  # a's pin has ended
    assert chosen is not None
    assert "a" in chosen
    assert "c" not in chosen
    view.update("c", pinned_until=None)  # released
    assert set(policy.victims(everything, 20.0, view) or []) == set(SIZES)
