"""A synthetic interactive (multi-turn chat) workload, shaped like the Bidaw authors'
industrial trace.

Users arrive as a Poisson process. Each has a number of turns; each turn a query and an
answer length; between two turns the user *reads* the previous answer (time proportional
to its length) and *types* the next query (a lognormal delay), so the gap grows with the
previous answer's length, as the paper observes. Every distribution is lognormal, cut at
the trace's maxima. The defaults are calibrated to the shape reported for the industrial
trace (``docs/explanation/scheduling.md`` has the comparison; :func:`describe` measures it):

- turns per user: mean 22.4, median 18, P90 46;
- query tokens: mean 35, max 394; answer tokens: mean 44, max 424;
- gap between a user's turns: median 43 s, P10 18 s, P90 87 s, growing with the previous
  answer's length;
- final context per user: median 1,422 tokens, P90 3,668.

Generation is vectorized and seeded (:class:`numpy.random.Generator`): the same
parameters give the same turns.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np

from .trace import Turns

__all__ = ["SyntheticWorkload", "describe"]


class SyntheticWorkload(msgspec.Struct, frozen=True, kw_only=True):
    """Parameters of the synthetic interactive workload; :meth:`generate` makes the turns.

    :param users: conversations to generate
    :param arrival_rate: new users per second (Poisson arrivals)
    :param turns_median: median turns per user
    :param turns_sigma: lognormal shape of turns per user
    :param turns_max: most turns of one user
    :param query_median: median query tokens
    :param query_sigma: lognormal shape of query tokens
    :param query_max: longest query, tokens
    :param answer_median: median answer tokens
    :param answer_sigma: lognormal shape of answer tokens
    :param answer_max: longest answer, tokens
    :param read_seconds_per_token: reading time per token of the previous answer
    :param type_median: median of the rest of the gap (typing, thinking), seconds
    :param type_sigma: lognormal shape of that rest
    :param seed: seed of the random generator
    """

    users: int = 2000
    arrival_rate: float = 1.0
    turns_median: float = 18.0
    turns_sigma: float = 0.7
    turns_max: int = 400
    query_median: float = 25.0
    query_sigma: float = 0.85
    query_max: int = 394
    answer_median: float = 31.0
    answer_sigma: float = 0.85
    answer_max: int = 424
    read_seconds_per_token: float = 0.3
    type_median: float = 28.0
    type_sigma: float = 0.75
    seed: int = 0

    def __post_init__(self) -> None:
        if self.users < 0 or self.arrival_rate <= 0:
            raise ValueError("users must be >= 0 and arrival_rate > 0 (users per second)")
        positive = (self.turns_median, self.query_median, self.answer_median, self.type_median)
        if min(positive) <= 0 or min(self.turns_max, self.query_max, self.answer_max) < 1:
            raise ValueError("medians must be positive and maxima at least 1")
        if min(self.turns_sigma, self.query_sigma, self.answer_sigma, self.type_sigma) < 0:
            raise ValueError("lognormal shapes (sigma) must be >= 0")
        if self.read_seconds_per_token < 0:
            raise ValueError("read_seconds_per_token must be >= 0")

    def generate(self) -> Turns:
        """The turns of every user, sorted by time."""
        rng = np.random.default_rng(self.seed)
        n = self.users
        starts = np.cumsum(rng.exponential(1.0 / self.arrival_rate, size=n))
        turns = _lognormal_int(rng, self.turns_median, self.turns_sigma, n, self.turns_max)
        total = int(turns.sum())
        user = np.repeat(np.arange(n, dtype=np.int64), turns)
        first = np.r_[0, np.cumsum(turns)[:-1]]
        round_index = np.arange(total, dtype=np.int64) - np.repeat(first, turns)
        query = _lognormal_int(rng, self.query_median, self.query_sigma, total, self.query_max)
        answer = _lognormal_int(rng, self.answer_median, self.answer_sigma, total, self.answer_max)
        typing = rng.lognormal(math.log(self.type_median), self.type_sigma, size=total)
        # The gap before turn k: read answer k-1, then type query k.
        prev_answer = np.r_[0, answer[:-1]]
        gap = self.read_seconds_per_token * prev_answer + typing
        gap[round_index == 0] = 0.0
        cum = np.cumsum(gap)
        time = np.repeat(starts, turns) + cum - np.repeat(cum[first], turns)
        return Turns(user, time, query, answer, round_index)


def _lognormal_int(
    rng: np.random.Generator, median: float, sigma: float, size: int, top: int
) -> np.ndarray[tuple[int], np.dtype[np.int64]]:
    values = np.rint(rng.lognormal(math.log(median), sigma, size=size))
    return np.clip(values, 1, top).astype(np.int64)


def describe(turns: Turns) -> dict[str, float]:
    """The shape statistics the synthetic workload is calibrated on, measured on ``turns``:
    turns per user (mean, median, P90), query and answer tokens (mean, max), gap between a
    user's consecutive turns (P10, median, P90, in seconds), final context per user
    (median, P90, tokens), and the arrival of new users: ``rate_mean`` (users per minute,
    first arrival to last) and ``rate_peak`` (the busiest 10 minutes, users per minute)."""
    if not len(turns):
        return {}
    _, per_user = np.unique(turns.user, return_counts=True)
    by_user = np.lexsort((turns.round_index, turns.user))
    users = turns.user[by_user]
    same = users[1:] == users[:-1]
    gaps = np.diff(turns.time[by_user])[same]
    context = turns.context_after()
    last = np.r_[~same, True]
    final = context[by_user][last]
    out = {
        "users": float(len(per_user)),
        "turns": float(len(turns)),
        "turns_mean": float(per_user.mean()),
        "turns_median": float(np.median(per_user)),
        "turns_p90": float(np.percentile(per_user, 90)),
        "query_mean": float(turns.query.mean()),
        "query_max": float(turns.query.max()),
        "answer_mean": float(turns.answer.mean()),
        "answer_max": float(turns.answer.max()),
        "final_context_median": float(np.median(final)),
        "final_context_p90": float(np.percentile(final, 90)),
    }
    if len(gaps):
        p10, p50, p90 = np.percentile(gaps, [10, 50, 90])
        out.update(gap_p10=float(p10), gap_median=float(p50), gap_p90=float(p90))
    out.update(_arrivals(np.sort(turns.time[by_user][np.r_[True, ~same]])))
    return out


_PEAK_WINDOW = 600.0  # seconds: the window of ``rate_peak``


def _arrivals(first: np.ndarray[tuple[int], np.dtype[np.float64]]) -> dict[str, float]:
    """Mean and peak (busiest 10-minute window) users per minute of sorted first arrivals."""
    span = float(first[-1] - first[0])
    mean = len(first) / (span / 60.0) if span > 0 else float(len(first))
    if span <= _PEAK_WINDOW:
        return {"rate_mean": mean, "rate_peak": mean}
    ends = np.searchsorted(first, first + _PEAK_WINDOW, side="left")
    busiest = int((ends - np.arange(len(first))).max())
    return {"rate_mean": mean, "rate_peak": busiest / (_PEAK_WINDOW / 60.0)}
