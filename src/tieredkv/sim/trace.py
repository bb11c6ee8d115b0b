"""Turn streams: one row per turn of a conversation, columnar, sorted by time.

The text format is the one of the Bidaw authors' industrial trace: whitespace-separated
columns under the header ``user_id time_stamp(seconds) query_length response_length
round_index``; lengths are tokens, ``round_index`` counts from 0 per user.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

__all__ = ["HEADER", "Turns", "read_turns", "write_turns"]

HEADER = "user_id time_stamp(seconds) query_length response_length round_index"
"""Header line of the trace text format."""

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]


class Turns:
    """A stream of conversation turns, sorted by time (ties keep their input order).

    :param user: user (conversation) id per turn
    :param time: arrival time per turn, seconds
    :param query: query length per turn, tokens
    :param answer: answer length per turn, tokens
    :param round_index: turn number within its conversation, from 0
    :raises ValueError: if the columns differ in length, or a length is negative
    """

    __slots__ = ("answer", "query", "round_index", "time", "user")

    def __init__(
        self,
        user: Iterable[int] | IntArray,
        time: Iterable[float] | FloatArray,
        query: Iterable[int] | IntArray,
        answer: Iterable[int] | IntArray,
        round_index: Iterable[int] | IntArray,
    ) -> None:
        cols = [
            np.asarray(list(c) if not isinstance(c, np.ndarray) else c)
            for c in (user, time, query, answer, round_index)
        ]
        n = len(cols[0])
        if any(len(c) != n for c in cols):
            raise ValueError(
                "user, time, query, answer and round_index must have one value per turn "
                f"(got lengths {[len(c) for c in cols]})"
            )
        u, t, q, a, r = cols
        t = t.astype(np.float64)
        order = np.argsort(t, kind="stable")
        self.user: IntArray = u.astype(np.int64)[order]
        self.time: FloatArray = t[order]
        self.query: IntArray = q.astype(np.int64)[order]
        self.answer: IntArray = a.astype(np.int64)[order]
        self.round_index: IntArray = r.astype(np.int64)[order]
        if n and (self.query.min() < 0 or self.answer.min() < 0 or self.round_index.min() < 0):
            raise ValueError("query, answer and round_index must be >= 0 in every turn")

    def __len__(self) -> int:
        return len(self.user)

    def users(self) -> int:
        """Distinct users."""
        return len(np.unique(self.user))

    def context_after(self) -> IntArray:
        """Tokens of each turn's conversation after the turn: every query and answer of
        that user up to and including this turn (in round order)."""
        by_user = np.lexsort((self.round_index, self.user))
        tokens = (self.query + self.answer)[by_user]
        cum = np.cumsum(tokens)
        users = self.user[by_user]
        starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]])
        before_group = np.repeat(cum[starts] - tokens[starts], np.diff(np.r_[starts, len(users)]))
        out = np.empty_like(cum)
        out[by_user] = cum - before_group
        return out

    def next_index(self) -> IntArray:
        """Row of the same user's next turn, or -1 for a user's last turn."""
        by_user = np.lexsort((self.time, self.round_index, self.user))
        nxt = np.full(len(self), -1, dtype=np.int64)
        same = self.user[by_user[1:]] == self.user[by_user[:-1]]
        nxt[by_user[:-1][same]] = by_user[1:][same]
        return nxt


def read_turns(path: str | os.PathLike[str]) -> Turns:
    """Read a trace in the text format (see the module docstring).

    :raises ValueError: if a line does not have five numeric columns
    """
    user: list[int] = []
    time: list[float] = []
    query: list[int] = []
    answer: list[int] = []
    round_index: list[int] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            fields = line.split()
            if not fields or (lineno == 1 and not _numeric(fields[0])):
                continue  # blank line, or the header
            try:
                u, t, q, a, r = fields
                row = (int(u), float(t), int(q), int(a), int(r))
            except ValueError:
                raise ValueError(
                    f"{os.fspath(path)}:{lineno}: expected 5 numeric columns "
                    f"({HEADER}), got {line.strip()!r}"
                ) from None
            user.append(row[0])
            time.append(row[1])
            query.append(row[2])
            answer.append(row[3])
            round_index.append(row[4])
    return Turns(user, time, query, answer, round_index)


def write_turns(path: str | os.PathLike[str], turns: Turns) -> None:
    """Write turns in the trace text format (times rounded to milliseconds)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(HEADER + "\n")
        for u, t, q, a, r in zip(
            turns.user.tolist(),
            turns.time.tolist(),
            turns.query.tolist(),
            turns.answer.tolist(),
            turns.round_index.tolist(),
            strict=True,
        ):
            f.write(f"{u} {t:.3f} {q} {a} {r}\n")


def _numeric(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True
