"""The paper's workload analyses: weighted reuse distance, its lower bound per previous-answer
length, their Spearman correlation, KV load-time variation, and live KV over time.

The *weighted reuse distance* of an access by user u is the total KV size of the distinct
other users accessed between u's previous access and this one. Each turn is one access of
its conversation's KV, sized (as in :func:`tieredkv.sim.replay.replay`) by the history the
turn leaves behind, capped at ``history_cap`` tokens.

The *lower bound* per previous-answer-length group follows the authors' artifact: drop the
group's points below ``Q1 - 1.5 IQR`` and take the minimum of the rest.
"""

from __future__ import annotations

import msgspec
import numpy as np
import numpy.typing as npt

from ..policies.reuse import ReuseTracker
from .trace import Turns

__all__ = [
    "AnswerGroups",
    "answer_groups",
    "live_kv",
    "load_time_cv",
    "reuse_distances",
    "share_beyond",
    "spearman",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


def reuse_distances(
    turns: Turns,
    bytes_per_token: int,
    history_cap: int = 2048,
    *,
    start: float = -np.inf,
    end: float = np.inf,
) -> tuple[FloatArray, IntArray]:
    """Weighted reuse distance of every access that has a previous one, in bytes, and the
    previous answer length (tokens) of each such access, in stream order.

    :param start: accesses earlier than this (trace time) are tracked but not reported
        (leave out the ramp-up, when few users are active)
    :param end: accesses later than this are tracked but not reported
    """
    tokens = np.minimum(turns.context_after(), history_cap) * bytes_per_token
    tracker = ReuseTracker()
    distances: list[float] = []
    prev_answer: list[int] = []
    last_answer: dict[int, int] = {}
    access = tracker.access
    for user, nbytes, answer, t in zip(
        turns.user.tolist(),
        tokens.tolist(),
        turns.answer.tolist(),
        turns.time.tolist(),
        strict=True,
    ):
        d = access(str(user), nbytes)
        if d is not None and start <= t <= end:
            distances.append(float(d))
            prev_answer.append(last_answer[user])
        last_answer[user] = answer
    return np.asarray(distances, dtype=np.float64), np.asarray(prev_answer, dtype=np.int64)


class AnswerGroups(msgspec.Struct, frozen=True, kw_only=True):
    """Reuse-distance lower bounds per previous-answer-length group.

    :param answer: the group's representative answer length (its lower edge), tokens
    :param lower_bound: the group's lower bound of the reuse distance, bytes
    :param count: accesses in the group
    :param spearman: Spearman rank correlation of ``answer`` and ``lower_bound``
    """

    answer: list[int]
    lower_bound: list[float]
    count: list[int]
    spearman: float


def answer_groups(
    distances: FloatArray,
    prev_answer: IntArray,
    *,
    width: int = 10,
    min_count: int = 30,
    max_answer: int | None = None,
) -> AnswerGroups:
    """Group accesses by previous answer length (``width``-token groups), take each
    group's lower bound (the minimum after dropping points below Q1 - 1.5 IQR), and
    correlate it with the answer length.

    :param width: tokens per group
    :param min_count: groups with fewer accesses are left out (too noisy)
    :param max_answer: answers above it are left out (``None``: none)
    """
    if width < 1 or min_count < 1:
        raise ValueError("width and min_count must be >= 1")
    groups = prev_answer // width
    keep = np.ones(len(groups), dtype=bool) if max_answer is None else prev_answer <= max_answer
    answers: list[int] = []
    bounds: list[float] = []
    counts: list[int] = []
    for g in np.unique(groups[keep]).tolist():
        d = distances[(groups == g) & keep]
        if len(d) < min_count:
            continue
        q1, q3 = np.percentile(d, [25, 75])
        kept = d[d >= q1 - 1.5 * (q3 - q1)]
        answers.append(int(g * width))
        bounds.append(float(kept.min()))
        counts.append(len(d))
    rho = spearman(np.asarray(answers, dtype=np.float64), np.asarray(bounds)) if answers else 0.0
    return AnswerGroups(answer=answers, lower_bound=bounds, count=counts, spearman=rho)


def spearman(x: FloatArray, y: FloatArray) -> float:
    """Spearman rank correlation (average ranks for ties); 0 when undefined."""
    if len(x) != len(y):
        raise ValueError(f"x and y differ in length ({len(x)} vs {len(y)})")
    if len(x) < 2:
        return 0.0
    rx, ry = _ranks(np.asarray(x, dtype=np.float64)), _ranks(np.asarray(y, dtype=np.float64))
    sx, sy = rx.std(), ry.std()
    if sx == 0 or sy == 0:
        return 0.0
    return float(((rx - rx.mean()) * (ry - ry.mean())).mean() / (sx * sy))


def _ranks(a: FloatArray) -> FloatArray:
    order = np.argsort(a, kind="stable")
    ranks = np.empty(len(a), dtype=np.float64)
    ranks[order] = np.arange(len(a), dtype=np.float64)
    # average the ranks of ties
    _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return np.asarray(sums[inverse] / counts[inverse], dtype=np.float64)


def share_beyond(distances: FloatArray, host_bytes: float) -> float:
    """Fraction of accesses whose reuse distance exceeds ``host_bytes`` (LRU misses them)."""
    return float((distances > host_bytes).mean()) if len(distances) else 0.0


def load_time_cv(
    nbytes: FloatArray, hit: npt.NDArray[np.bool_], link_bps: float, ssd_bps: float
) -> float:
    """Coefficient of variation (std / mean) of KV load times: ``nbytes / link_bps`` for a
    host hit, plus ``nbytes / ssd_bps`` for a miss."""
    if not len(nbytes):
        return 0.0
    t = nbytes / link_bps + np.where(hit, 0.0, nbytes / ssd_bps)
    return float(t.std() / t.mean()) if t.mean() > 0 else 0.0


def live_kv(
    turns: Turns, bytes_per_token: int, history_cap: int = 2048
) -> tuple[FloatArray, FloatArray]:
    """Live KV over time: the history bytes of every conversation that has started and not
    yet had its last turn, after each turn (by trace time).

    :returns: ``(times, live_bytes)``, one point per turn
    """
    if not len(turns):
        return np.zeros(0), np.zeros(0)
    after = np.minimum(turns.context_after(), history_cap) * bytes_per_token
    nxt = turns.next_index()
    order = np.lexsort((turns.time, turns.round_index, turns.user))
    prev = np.zeros(len(turns), dtype=np.int64)
    users = turns.user[order]
    same = users[1:] == users[:-1]
    prev[order[1:][same]] = after[order[:-1][same]]
    delta = np.where(nxt >= 0, after - prev, -prev).astype(np.float64)
    return turns.time.copy(), np.cumsum(delta)
