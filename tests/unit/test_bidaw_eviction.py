"""Bidaw's eviction: exact reuse distances, what it learns, and how potential behaves."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tieredkv.meta import KVMeta, MetadataChannel, TierInfo
from tieredkv.policies import BidawEviction
from tieredkv.policies.reuse import ReuseTracker

GB = 10**9


def meta(session: str, nbytes: int, answer: int = 10, turns: int = 1) -> KVMeta:
    return KVMeta(
        session=session, tier="host", nbytes=nbytes, turns=turns, prev_answer_tokens=answer
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(1, 1000)), max_size=200))
def test_reuse_distance_is_the_bytes_of_distinct_others_in_between(
    accesses: list[tuple[int, int]],
) -> None:
    tracker = ReuseTracker(min_positions=16)  # small: compaction happens often
    history: list[tuple[str, int]] = []
    for i, size in accesses:
        session = f"s{i}"
        prev = max((k for k, (s, _) in enumerate(history) if s == session), default=None)
        expected = None
        if prev is not None:
            latest = dict(history[prev + 1 :])  # each other session's latest size
            expected = sum(latest.values())
        assert tracker.access(session, size) == expected
        history.append((session, size))
        assert tracker.elapsed(session) == 0


def test_tracker_forgets_beyond_horizon_but_keeps_kept_sessions() -> None:
    tracker = ReuseTracker(min_positions=16)
    for s in "abcd":
        tracker.access(s, 10)
    assert tracker.sweep(horizon=20, keep={"b"}, max_tracked=100) == ["a", "b"]
    assert "a" not in tracker
    assert "b" in tracker  # retired: still measured
    assert tracker.elapsed("b") == 20
    assert tracker.sweep(horizon=20, keep=set(), max_tracked=100) == []  # c: 10 < 20
    tracker.forget("b")
    assert len(tracker) == 2


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("aaaaaaaaafs"), st.integers(0, 80), st.integers(1, 1000)),
        min_size=100,
        max_size=600,
    )
)
def test_elapsed_distances_stay_exact_for_every_tracked_session_across_rebuilds(
    ops: list[tuple[str, int, int]],
) -> None:
    """Accesses, forgets and sweeps, with a new tree started every few accesses: every
    tracked session's elapsed distance counts each tracked session accessed since, and of
    the sessions forgotten since at most their latest access (their bytes stay in the tree
    until a rebuild leaves them out), as the tracker documents."""
    tracker = ReuseTracker(min_positions=16)
    # each life of a session (it starts again after it is forgotten), by latest access
    order: list[tuple[str, int]] = []
    size: dict[tuple[str, int], int] = {}
    life = dict.fromkeys((f"s{i}" for i in range(81)), 0)
    tracked: set[str] = set()

    def drop(session: str) -> None:
        if session in tracked:
            tracked.discard(session)
            life[session] += 1

    for op, i, n in ops:
        session = f"s{i}"
        if op == "a":
            key = (session, life[session])
            if key in size:
                order.remove(key)
            order.append(key)
            size[key] = n
            tracked.add(session)
            tracker.access(session, n)
        elif op == "f":
            tracker.forget(session)
            drop(session)
        else:
            keep = {f"s{k}" for k in range(0, 81, 3)}
            for gone in tracker.sweep(horizon=n, keep=keep, max_tracked=i):
                if gone not in keep:
                    drop(gone)
        assert len(tracker) == len(tracked)
        for k, (s, t) in enumerate(order):
            if s not in tracked or t != life[s]:
                continue
            after = order[k + 1 :]
            least = sum(size[o] for o in after if o[0] in tracked and o[1] == life[o[0]])
            assert least <= (tracker.elapsed(s) or 0) <= sum(size[o] for o in after)
    for s in life:
        assert (s in tracker) == (s in tracked)


def test_a_rebuild_moves_a_few_positions_per_access_and_the_tree_shrinks_back() -> None:
    """Distances stay exact while a new tree fills and after it takes over, no access pays
    for a whole rebuild, and once most sessions are forgotten, the next rebuilds give their
    positions back (the state stays bounded)."""
    tracker = ReuseTracker(min_positions=16)
    exact = ReuseTracker(min_positions=1 << 17)  # never rebuilt in 40,000 accesses
    rng = random.Random(7)
    sessions = [f"s{i}" for i in range(4096)]
    rebuilds = 0
    for _ in range(40_000):
        before = tracker._rebuild  # (private: the rebuild's progress is what is tested)
        cursor = None if before is None else before.cursor
        session, nbytes = rng.choice(sessions), rng.randrange(1, 1 << 20)
        assert tracker.access(session, nbytes) == exact.access(session, nbytes)
        if before is not None and tracker._rebuild is before:
            assert cursor is not None
            assert before.cursor - cursor <= 8
        elif before is not None:
            rebuilds += 1
    assert rebuilds >= 2
    assert tracker._span >= 4 * 4096
    for s in sessions[3:]:
        tracker.forget(s)
    for k in range(39_999):  # s0, s1, s2, ..., s2
        tracker.access(sessions[k % 3], 100)
    assert tracker._span == 16
    assert tracker.access(sessions[0], 100) == 200  # s1 and s2, 100 bytes each


def drive_turns(
    policy: BidawEviction, session: str, answer: int, turn: int, size: int, t: float
) -> None:
    m = meta(session, size, answer, turn)
    policy.on_access(session, m, t)


def test_live_pattern_samples_only_the_think_time_gap() -> None:
    """A live turn is a load then an append: only append -> next load is a think-time gap."""
    p = BidawEviction(capacity=100 * GB)
    p.on_access("u", meta("u", GB, answer=10, turns=1), 0.0)  # append of turn 1
    p.on_access("x", meta("x", 3 * GB), 1.0)  # other traffic while the user thinks
    p.on_access("u", meta("u", GB, answer=10, turns=1), 2.0)  # load for turn 2
    p.on_access("y", meta("y", 5 * GB), 3.0)  # traffic during turn 2's compute
    p.on_access("u", meta("u", 2 * GB, answer=300, turns=2), 4.0)  # append of turn 2
    bucket = p.bucket_of(10)
    assert p.observed(bucket) == [3 * GB]
    assert p.observed(p.bucket_of(300)) == []


def test_session_first_seen_through_an_admission_takes_no_sample() -> None:
    """A promotion of a session the policy had forgotten, then its load: the load is no
    reuse the policy measured, so it must not be recorded as a think-time gap of 0."""
    p = BidawEviction(capacity=100 * GB)
    m = meta("x", 4096, answer=5, turns=3)
    p.on_admit("x", m, 0.0)  # first seen through an admission (a promotion)
    p.on_access("x", m, 0.0)  # its load
    assert p.observed(p.bucket_of(5)) == []


def learn(p: BidawEviction, rng: random.Random, rounds: int) -> None:
    """Users with short answers return after ~10 GB of other sessions (0.25 C at C = 40 GB),
    long answers after all ~120 others (3 C)."""
    t = 0.0
    # 5 short-answer users return every ~10 accesses, 120 long ones every ~300: about 0.9
    # accesses per unit of time, so the schedule below keeps up and distances are as drawn.
    users = [f"u{i}" for i in range(125)]
    answers = {u: 5 if i < 5 else 400 for i, u in enumerate(users)}
    due = {u: rng.uniform(0, 300) for u in users}
    traffic = 0.0
    turns = dict.fromkeys(users, 0)
    for _ in range(rounds):
        u = min(due, key=due.__getitem__)
        traffic = max(traffic, due[u])
        turns[u] += 1
        p.on_access(u, meta(u, GB, answers[u], turns[u]), t)
        t += 1
        traffic += 1
        due[u] = traffic + (rng.uniform(5, 15) if answers[u] == 5 else rng.uniform(250, 350))


def test_short_answers_earn_more_potential_than_long_ones() -> None:
    p = BidawEviction(capacity=40 * GB, refresh_every=64)
    learn(p, random.Random(1), 5000)
    short, long = p.table(p.bucket_of(5)), p.table(p.bucket_of(400))
    assert short is not None
    assert long is not None
    assert short[0] > 0.9  # returns within 0.25 C: a sure hit
    assert long[0] < 0.2  # returns after ~3 C: beyond the promising range
    # ... but a long-answer user who is due (elapsed ~2.5 C) is worth keeping again.
    due_bin = int(2.5 * p.bins_per_capacity)
    assert long[due_bin] > long[0] + 0.3


def test_a_young_cache_learns_before_the_first_full_period() -> None:
    p = BidawEviction(capacity=40 * GB)  # refresh_every=1024
    learn(p, random.Random(3), 15)
    assert p.table(p.bucket_of(5)) is None  # nothing learned yet: LRU order
    learn(p, random.Random(3), 300)  # refreshed at 16, 32, ..., 256 accesses
    short = p.table(p.bucket_of(5))
    assert short is not None
    assert short[0] > 0.5


def test_potential_tables_are_unimodal() -> None:
    p = BidawEviction(capacity=40 * GB, refresh_every=64)
    learn(p, random.Random(2), 3000)
    for bucket in range(len(p.answer_edges) + 1):
        row = p.table(bucket)
        assert row is not None
        peak = row.index(max(row))
        rising, falling = row[: peak + 1], row[peak:]
        assert all(a <= b for a, b in itertools.pairwise(rising))
        assert all(a >= b for a, b in itertools.pairwise(falling))


def test_overdue_user_loses_potential_and_is_evicted_first() -> None:
    p = BidawEviction(capacity=40 * GB, refresh_every=64)
    view = MetadataChannel([TierInfo(name="host", level=0, capacity=40 * GB)])
    learn(p, random.Random(3), 4000)
    m = meta("leaver", GB, answer=5, turns=1)
    p.on_access("leaver", m, 0.0)
    p.on_admit("leaver", m, 0.0)
    fresh = p.potential("leaver")
    assert fresh is not None
    assert fresh > 0.9
    history = []
    for i in range(150):  # 150 GB of new traffic: far past the ~10 GB a short answer takes
        s = f"o{i}"
        p.on_access(s, meta(s, GB, answer=5, turns=1), 1.0 + i)
        current = p.potential("leaver")
        assert current is not None
        history.append(current)
    assert history[-1] < 0.1 * fresh
    assert history[-1] <= min(history[:10])
    keeper = meta("stayer", GB, answer=5, turns=1)
    p.on_access("stayer", keeper, 200.0)
    p.on_admit("stayer", keeper, 200.0)
    assert p.victims(GB, 200.0, view) == ["leaver"]


def test_without_knowledge_it_evicts_like_lru() -> None:
    p = BidawEviction()
    view = MetadataChannel([TierInfo(name="host", level=0, capacity=10 * GB)])
    for t, s in enumerate("abcd"):
        p.on_access(s, meta(s, GB), float(t))
        p.on_admit(s, meta(s, GB), float(t))
    p.on_access("a", meta("a", GB, turns=2), 5.0)
    chosen = p.victims(4 * GB, 6.0, view)
    assert chosen == ["b", "c", "d", "a"]
    assert p.capacity == 10 * GB  # read from the view


def test_capacity_falls_back_to_resident_bytes() -> None:
    p = BidawEviction()
    p.on_admit("a", meta("a", 5), 0.0)
    assert p.victims(5, 0.0, MetadataChannel()) == ["a"]
    assert p.capacity == 5


def test_departed_sessions_count_against_their_bucket() -> None:
    p = BidawEviction(capacity=10 * GB, horizon=3.0, refresh_every=16)
    p.on_access("gone", meta("gone", GB, answer=5), 0.0)
    p.on_admit("gone", meta("gone", GB, answer=5), 0.0)
    for i in range(40):
        p.on_access(f"o{i}", meta(f"o{i}", GB), float(i))
    assert p.potential("gone") == 0.0  # past 3 C of traffic: retired
    p.on_remove("gone")
    assert p.tracked() <= 40


@pytest.mark.parametrize(
    "kwargs",
    [{"capacity": 0}, {"horizon": 2.0}, {"promising": 0}, {"samples": 0}, {"refresh_every": 0}],
)
def test_bad_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 (each message names its parameter)
        BidawEviction(**kwargs)  # type: ignore[arg-type]
