"""The synthetic interactive workload: seeded, shaped like the industrial trace, readable
and writable in the trace's text format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tieredkv.sim.synthetic import SyntheticWorkload, describe
from tieredkv.sim.trace import HEADER, Turns, read_turns, write_turns


@pytest.fixture(scope="module")
def big() -> Turns:
    return SyntheticWorkload(users=8000, seed=7).generate()


def test_same_seed_same_turns_other_seed_other_turns() -> None:
    a = SyntheticWorkload(users=200, seed=3).generate()
    b = SyntheticWorkload(users=200, seed=3).generate()
    c = SyntheticWorkload(users=200, seed=4).generate()
    for col in ("user", "time", "query", "answer", "round_index"):
        assert np.array_equal(getattr(a, col), getattr(b, col))
    assert not np.array_equal(a.time, c.time)


# (statistic, trace value, relative tolerance): the trace's shape from bidaw.md
SHAPE = [
    ("turns_mean", 22.4, 0.06),
    ("turns_median", 18, 0.06),
    ("turns_p90", 46, 0.08),
    ("query_mean", 35, 0.06),
    ("answer_mean", 44, 0.06),
    ("gap_median", 43, 0.06),
    ("gap_p10", 18, 0.12),
    ("gap_p90", 87, 0.06),
    ("final_context_median", 1422, 0.06),
    ("final_context_p90", 3668, 0.06),
]


@pytest.mark.parametrize(("stat", "target", "tolerance"), SHAPE)
def test_shape_matches_the_industrial_trace(
    big: Turns, stat: str, target: float, tolerance: float
) -> None:
    value = describe(big)[stat]
    assert abs(value - target) <= tolerance * target, f"{stat}={value:.1f}, trace {target}"


def test_lengths_respect_the_trace_maxima(big: Turns) -> None:
    shape = describe(big)
    assert shape["query_max"] <= 394
    assert shape["answer_max"] <= 424
    assert big.query.min() >= 1
    assert big.answer.min() >= 1


def test_gap_grows_with_the_previous_answer(big: Turns) -> None:
    order = np.lexsort((big.round_index, big.user))
    users, times, answers = big.user[order], big.time[order], big.answer[order]
    same = users[1:] == users[:-1]
    gaps, prev = np.diff(times)[same], answers[:-1][same]
    short = np.median(gaps[prev <= 15])
    mid = np.median(gaps[(prev > 30) & (prev <= 60)])
    long = np.median(gaps[prev > 120])
    assert short < mid < long
    assert long - short > 30  # seconds: reading 100+ tokens more takes time


def test_turns_are_sorted_and_rounds_count_from_zero(big: Turns) -> None:
    assert np.all(np.diff(big.time) >= 0)
    order = np.lexsort((big.round_index, big.user))
    users, rounds = big.user[order], big.round_index[order]
    first = np.r_[True, users[1:] != users[:-1]]
    assert np.all(rounds[first] == 0)
    assert np.all(rounds[~first] == rounds[np.flatnonzero(~first) - 1] + 1)


def test_context_and_next_index() -> None:
    turns = Turns([1, 2, 1, 1], [0.0, 1.0, 2.0, 3.0], [5, 7, 1, 2], [10, 20, 3, 4], [0, 0, 1, 2])
    assert turns.context_after().tolist() == [15, 27, 19, 25]
    assert turns.next_index().tolist() == [2, -1, 3, -1]
    assert turns.users() == 2


def test_write_then_read_round_trips(tmp_path: Path) -> None:
    turns = SyntheticWorkload(users=30, seed=1).generate()
    path = tmp_path / "trace.txt"
    write_turns(path, turns)
    assert path.read_text().splitlines()[0] == HEADER
    back = read_turns(path)
    assert np.array_equal(back.user, turns.user)
    assert np.allclose(back.time, turns.time, atol=1e-3)
    assert np.array_equal(back.answer, turns.answer)
    assert np.array_equal(back.round_index, turns.round_index)


def test_bad_trace_line_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.txt"
    path.write_text(f"{HEADER}\n1 0 5 6 0\n2 x 5 6 0\n")
    with pytest.raises(ValueError, match=r"bad.txt:3: expected 5 numeric columns"):
        read_turns(path)


def test_bad_columns_and_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="one value per turn"):
        Turns([1], [0.0, 1.0], [1], [1], [0])
    with pytest.raises(ValueError, match=">= 0"):
        Turns([1], [0.0], [-1], [1], [0])
    with pytest.raises(ValueError, match="arrival_rate"):
        SyntheticWorkload(arrival_rate=0)
    with pytest.raises(ValueError, match="sigma"):
        SyntheticWorkload(answer_sigma=-1)
