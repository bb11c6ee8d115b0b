"""Workload analyses: reuse distances, lower bounds per answer group, Spearman, live KV."""

from __future__ import annotations

import numpy as np
import pytest

from tieredkv.sim.analysis import (
    answer_groups,
    live_kv,
    load_time_cv,
    reuse_distances,
    share_beyond,
    spearman,
)
from tieredkv.sim.trace import Turns


def test_spearman_is_rank_based_and_handles_ties() -> None:
    x = np.array([1.0, 2.0, 3.0, 4.0])
    assert spearman(x, x**3) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert spearman(np.array([1.0, 2.0, 2.0, 3.0]), np.array([1.0, 2.0, 2.0, 3.0])) == (
        pytest.approx(1.0)
    )
    assert spearman(x, np.ones(4)) == 0.0
    with pytest.raises(ValueError, match="differ in length"):
        spearman(x, x[:2])


def test_reuse_distance_counts_distinct_other_users_bytes() -> None:
    # users 1,2,3,2,1: user 1's second access sees 2 and 3 (2 once, though accessed twice)
    turns = Turns([1, 2, 3, 2, 1], [0.0, 1, 2, 3, 4], [1, 2, 3, 0, 0], [0] * 5, [0, 0, 0, 1, 1])
    d, prev = reuse_distances(turns, bytes_per_token=1)
    # sizes after each turn: u1 1, u2 2, u3 3, u2 2, u1 1
    assert d.tolist() == [3.0, 2 + 3.0]
    assert prev.tolist() == [0, 0]
    d, _ = reuse_distances(turns, bytes_per_token=1, start=3.5)
    assert d.tolist() == [5.0]


def test_lower_bound_drops_low_outliers_then_takes_the_minimum() -> None:
    base = np.array([100.0, 101, 102, 103, 104, 105, 106, 107])
    distances = np.r_[base, 1.0, base * 2, 2.0]
    prev = np.r_[np.full(9, 5), np.full(9, 25)]
    g = answer_groups(distances, prev.astype(np.int64), width=10, min_count=5)
    assert g.answer == [0, 20]
    assert g.lower_bound == [100.0, 200.0]  # the outliers 1 and 2 are dropped
    assert g.count == [9, 9]
    assert g.spearman == pytest.approx(1.0)


def test_live_kv_rises_with_histories_and_falls_when_users_leave() -> None:
    turns = Turns([1, 2, 1, 2], [0.0, 1, 2, 3], [1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1])
    t, live = live_kv(turns, bytes_per_token=10)
    assert t.tolist() == [0, 1, 2, 3]
    assert live.tolist() == [20, 40, 20, 0]  # the last turns end the conversations


def test_shares_and_load_time_cv() -> None:
    d = np.array([1.0, 5.0, 10.0, 20.0])
    assert share_beyond(d, 6.0) == 0.5
    same = load_time_cv(np.array([5.0, 5.0]), np.array([True, True]), 1.0, 1.0)
    assert same == 0.0
    mixed = load_time_cv(np.array([5.0, 5.0]), np.array([True, False]), 10.0, 1.0)
    assert mixed > 0.8
