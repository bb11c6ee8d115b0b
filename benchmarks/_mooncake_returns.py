"""Which turns of a Mooncake conversation trace are followed by another, by what an online
policy can see when the turn is served: a diagnostic for the eviction, not a benchmark.

The trace is read as the replay reads it (:func:`tieredkv.sim.workloads.read_mooncake`:
conversations from the prefix block hashes; a turn's query is its input minus the previous
turn's input and answer). For each turn it asks one thing that only hindsight knows:
does its conversation have another turn later? And it prints the share of turns that do,
grouped by each thing known when the turn is served:

- the turns the conversation has had so far, this one included;
- the answer's length (what Bidaw's eviction predicts from);
- the query's length: the tokens new in this turn's input;
- for a later turn, the seconds since the conversation's previous turn (its pace), with
  the median seconds to its next turn where it has one.

A group's share is what a policy that knows the group, and nothing more, can predict of a
return; a policy ranks conversations by such shares (over the bytes they hold, and the
time they are held). Run it on the whole trace (default) or on the head the tests ship::

    .venv/bin/python benchmarks/_mooncake_returns.py [--trace PATH]
"""

from __future__ import annotations

import argparse
import bisect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from tieredkv.sim.trace import Turns
from tieredkv.sim.workloads import read_mooncake

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_fast25" / "conversation_trace.jsonl"
TURNS_SO_FAR = (1, 2, 3, 4, 6, 10)
ANSWER_TOKENS = (0, 100, 200, 300, 400, 500, 700, 1000)
QUERY_TOKENS = (0, 500, 1000, 2000, 4000, 8000, 16000)
PREVIOUS_GAP = (0, 10, 30, 60, 120, 300)


def returns(turns: Turns) -> list[bool]:
    """Per turn, whether its conversation has a later turn."""
    users = [int(u) for u in turns.user]
    last = {user: i for i, user in enumerate(users)}  # (the latest index wins)
    return [last[user] != i for i, user in enumerate(users)]


def gaps(turns: Turns) -> tuple[list[float | None], list[float | None]]:
    """Per turn, the seconds since its conversation's previous turn and until its next one
    (``None``: there is none)."""
    times = [float(t) for t in turns.time]
    previous: list[float | None] = []
    latest: dict[int, int] = {}
    following: list[float | None] = [None] * len(times)
    for i, user in enumerate(int(u) for u in turns.user):
        j = latest.get(user)
        previous.append(None if j is None else times[i] - times[j])
        if j is not None:
            following[j] = times[i] - times[j]
        latest[user] = i
    return previous, following


def pace_table(turns: Turns, back: Sequence[bool]) -> str:
    """Later turns by the seconds since their conversation's previous turn: the share with
    a later turn, and the median seconds until it."""
    previous, following = gaps(turns)
    later = [i for i, gap in enumerate(previous) if gap is not None]
    seconds = [int(previous[i] or 0) for i in later]
    rows = shares(seconds, [back[i] for i in later], PREVIOUS_GAP)
    nexts: list[list[float]] = [[] for _ in PREVIOUS_GAP]
    for i, s in zip(later, seconds, strict=True):
        gap = following[i]
        if gap is not None:
            nexts[bisect.bisect_right(PREVIOUS_GAP, s) - 1].append(gap)
    cells = []
    for (edge, n, k), after in zip(rows, nexts, strict=True):
        if n:
            median = f", next after {sorted(after)[len(after) // 2]:.0f} s" if after else ""
            cells.append(f">={edge} s: {k / n:.2f} of {n}{median}")
    return "seconds since the previous turn, a later turn\n  " + "  ".join(cells)


def shares(
    values: Sequence[int], back: Sequence[bool], edges: Sequence[int]
) -> list[tuple[int, int, int]]:
    """Per bucket of ``values`` (``[edges[j], edges[j + 1])``, the last one open), its low
    edge, the turns in it, and how many of them have a later turn."""
    out = [[edge, 0, 0] for edge in edges]
    for value, came_back in zip(values, back, strict=True):
        j = bisect.bisect_right(edges, value) - 1  # (as the policies bucket answers)
        if j < 0:
            raise ValueError(f"{value} is below the first bucket's edge, {edges[0]}")
        out[j][1] += 1
        out[j][2] += came_back
    return [(edge, n, k) for edge, n, k in out]


def table(
    name: str,
    feature: Callable[[int], int],
    edges: Sequence[int],
    turns: Turns,
    back: Sequence[bool],
    only: Callable[[int], bool] = lambda i: True,
) -> str:
    """One line per bucket: its low edge, the turns in it, the share with a later turn."""
    picked = [i for i in range(len(back)) if only(i)]
    rows = shares([feature(i) for i in picked], [back[i] for i in picked], edges)
    cells = "  ".join(f">={edge}: {k / n:.2f} of {n}" for edge, n, k in rows if n)
    return f"{name}\n  {cells}"


def report(turns: Turns) -> str:
    back = returns(turns)
    first = int((turns.round_index == 0).sum())
    lines = [
        f"{len(back):,} turns in {first:,} conversations; {sum(back):,} "
        f"({sum(back) / len(back):.2f}) are followed by another turn of theirs",
        table("turns so far", lambda i: int(turns.round_index[i]) + 1, TURNS_SO_FAR, turns, back),
        table("answer tokens", lambda i: int(turns.answer[i]), ANSWER_TOKENS, turns, back),
        table(
            "query tokens, a conversation's first turn",
            lambda i: int(turns.query[i]),
            QUERY_TOKENS,
            turns,
            back,
            only=lambda i: turns.round_index[i] == 0,
        ),
        table(
            "query tokens, a later turn",
            lambda i: int(turns.query[i]),
            QUERY_TOKENS,
            turns,
            back,
            only=lambda i: turns.round_index[i] > 0,
        ),
        pace_table(turns, back),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake conversation trace")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"no trace at {args.trace}: name one with --trace")
    print(report(read_mooncake(args.trace)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
