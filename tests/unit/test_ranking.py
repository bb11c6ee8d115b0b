"""The grouped ranking behind the Bidaw evictions: its indexed heap stays exact under any
sequence of changes, and choosing walks it as a linear scan of the same candidates would."""

from __future__ import annotations

import random

import pytest

from tieredkv.policies.ranking import ResidentRanking


def _check_heap(r: ResidentRanking) -> None:
    """One entry per live slot (a group's oldest, and its newest when another), each at
    the index the ranking records for it, in heap order."""
    heap, where = r._heap, r._where
    assert len(where) == len(heap)
    for i, (_, end, group, session) in enumerate(heap):
        assert where[group << 1 | end] == i
        if i:
            assert not heap[i] < heap[(i - 1) >> 1]
        order = list(r.groups[group])
        assert session == (order[0] if end == 0 else order[-1])
        assert end == 0 or len(order) > 1
    live = sum(1 if len(order) == 1 else 2 for order in r.groups.values())
    assert len(heap) == live


def _linear_choose(
    r: ResidentRanking,
    score: dict[str, float],
    need: int,
    protected: set[str],
    sizes: dict[str, int],
) -> tuple[list[str], int]:
    """The same choice by a linear scan of every group's ends (all scores fresh): the
    lowest end goes; a taken or protected end uncovers the next member behind it."""
    ends: list[tuple[float, int, int, str]] = []
    for group, members in r.groups.items():
        order = list(members)
        ends.append((score[order[0]], 0, group, order[0]))
        if len(order) > 1:
            ends.append((score[order[-1]], 1, group, order[-1]))
    chosen: list[str] = []
    taken: set[str] = set()
    freed = 0
    while freed < need and ends:
        low = min(ends)
        ends.remove(low)
        _, end, group, session = low
        if session in taken:
            continue
        if session not in protected:
            chosen.append(session)
            taken.add(session)
            freed += sizes[session]
        order = list(r.groups[group])
        for other in order if end == 0 else reversed(order):
            if other not in taken and other not in protected:
                ends.append((score[other], end, group, other))
                break
    return chosen, freed


@pytest.mark.parametrize("seed", range(6))
def test_the_heap_stays_exact_and_choosing_equals_a_linear_scan(seed: int) -> None:
    rng = random.Random(seed)
    score: dict[str, float] = {}
    r = ResidentRanking(score.__getitem__, size_aware=True)
    names = [f"s{i}" for i in range(rng.randint(2, 80))]
    group: dict[str, int] = {}
    sizes: dict[str, int] = {}
    checked = 0
    for _ in range(1500):
        s = rng.choice(names)
        op = rng.random()
        if op < 0.5:  # an access: the newest of its (possibly new) group
            score[s] = float(rng.randint(0, 30))  # (ties between ends and groups too)
            sizes[s] = rng.choice([1, 3, 100, 5000])
            group[s] = r.place(s, group.get(s, -1), rng.randint(0, 4), sizes[s])
        elif op < 0.7 and s in group:  # evicted
            r.unplace(s, group.pop(s))
            del sizes[s]
        elif op < 0.8:  # elapsed distances move: some groups are rescored in turn
            for t in score:
                score[t] = float(rng.randint(0, 30))
            r.rescore_some(rng.randint(1, 40), 10.0)
        elif op < 0.85:  # new tables
            r.rescore_all()
        if rng.random() < 0.6:
            r.flush()
            _check_heap(r)
        if rng.random() < 0.15 and group:
            for g in r.groups:  # every score fresh: a linear scan can be the reference
                r.touch(g)
            r.flush()
            _check_heap(r)
            before = list(r._heap)
            protected = set(rng.sample(sorted(group), min(len(group), rng.randint(0, 6))))
            need = rng.randint(1, 12_000)
            got = r.choose(need, protected, sizes)
            assert got == _linear_choose(r, score, need, protected, sizes)
            assert r._heap == before  # choosing changes nothing
            checked += 1
    assert checked > 50


def test_an_empty_ranking_chooses_nothing() -> None:
    r = ResidentRanking(lambda s: 0.0, size_aware=False)
    r.flush()
    assert r.choose(10, set(), {}) == ([], 0)
    g = r.place("a", -1, 0, 10)
    r.flush()
    assert r.choose(10, {"a"}, {"a": 10}) == ([], 0)
    assert r.choose(10, set(), {"a": 10}) == (["a"], 10)
    r.unplace("a", g)
    r.flush()
    assert r._heap == []
    assert r._where == {}
