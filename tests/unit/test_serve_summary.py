"""The serving loop's summary figures, on hand-made timelines (exact values)."""

from __future__ import annotations

import math

import pytest

from tieredkv.serve import ServedTurn, model_stall, summarize


def turn(
    session: str, arrival: float, start: float, end: float, phases: tuple[float, ...] = (0, 0, 0)
) -> ServedTurn:
    return ServedTurn(
        session=session,
        arrival=arrival,
        start=start,
        end=end,
        host_hit=None,
        restored_tokens=0,
        recomputed_tokens=0,
        answer=(),
        restore=phases[0],
        compute=phases[1],
        store=phases[2],
    )


def test_stall_counts_idle_model_with_requests_waiting() -> None:
    results = [
        turn("a", 0.0, 0.1, 0.5),  # waited 0.1 s for its load, model idle: stall 0.1
        turn("b", 0.2, 0.5, 0.9),  # waited behind a: queueing, not a stall
        turn("c", 1.0, 1.3, 1.5),  # model idle 0.9-1.3, c waiting from 1.0: stall 0.3
        turn("d", 2.0, 2.0, 2.1),  # model idle 1.5-2.0 with nobody waiting: no stall
    ]
    assert model_stall(results) == pytest.approx(0.4)
    assert model_stall(list(reversed(results))) == pytest.approx(0.4)  # order-free
    assert summarize(results)["model_stall"] == pytest.approx(0.4)


def test_stall_sees_a_request_held_behind_a_loading_head() -> None:
    # FCFS: "late" starts after "head", which waited for its load, yet "late" arrived first
    # among those still waiting when the model went idle at 1.0
    results = [
        turn("x", 0.0, 0.0, 1.0),
        turn("head", 1.2, 1.5, 2.0),
        turn("late", 0.8, 2.0, 2.2),
    ]
    assert model_stall(results) == pytest.approx(0.5)  # idle 1.0-1.5, "late" waiting


def test_summary_of_nothing_is_empty_and_no_hits_is_nan() -> None:
    assert summarize([]) == {}
    assert model_stall([]) == 0.0
    assert math.isnan(summarize([turn("a", 0.0, 0.0, 1.0)])["host_hit_ratio"])


def test_summary_averages_the_phases_of_a_turn() -> None:
    results = [turn("a", 0.0, 0.0, 1.0, (0.1, 0.7, 0.2)), turn("b", 0.0, 1.0, 1.5, (0, 0.4, 0.1))]
    summary = summarize(results)
    assert summary["service_mean"] == pytest.approx(0.75)
    assert summary["restore_mean"] == pytest.approx(0.05)
    assert summary["compute_mean"] == pytest.approx(0.55)
    assert summary["store_mean"] == pytest.approx(0.15)
