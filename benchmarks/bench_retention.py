"""Host hit ratios relative to Belady's, in one run, for human and agentic workloads.

Run: ``.venv/bin/python benchmarks/bench_retention.py [--users N] [--rate R] [--seed S]
[--human-gb 120,240] [--agentic-gb 100,200,400] [--mooncake PATH]``.

Every ratio is a policy's host hit ratio over Belady's on the same turns and host size
(eviction-only replay, :func:`tieredkv.sim.replay.replay`, 10% warm-up):

- *human*: the synthetic trace-shaped workload (:class:`~tieredkv.sim.synthetic.
  SyntheticWorkload`), and the Mooncake conversation trace: by default the head shipped
  with the tests (1,500 requests, 322 returning turns), or the whole trace given with
  ``--mooncake`` (``conversation_trace.jsonl`` of the Mooncake repository's
  ``FAST25-release/traces``: 12,031 requests, 3,975 returning);
- *agentic*: the human + agent mix (:class:`~tieredkv.sim.agentic.AgenticWorkload`: tool
  calls of 20-80 tokens, 25% of tools running 1-10 minutes, the rest seconds), three times:
  no caller hints, every agent's caller hinting correctly, every one hinting wrongly.

Policies: ``lru``, ``bidaw-paper`` (the paper's eviction), ``bidaw`` (the default: it
learns the gap per answer length, tool call and hint class, and duels LRU),
``bidaw-density`` (the default's ``ranking="density"``: gaps learned in seconds, ranked by
best-horizon hit density) and ``belady``.
With ``--bound``, instruments too (``benchmarks/_density.py``): ``learned-density``
(hit density in time, gaps learned online) on every workload, ``known-distribution``
(hit density under the synthetic generator's exact model) on the synthetic human one, and
``trace-statistics`` (hit density under the whole trace's statistics, in hindsight) on
the Mooncake one: what an online policy reaches there, and ``trace-query-statistics``
(the same, its chance of another turn split by each turn's query length too: what a
policy that also knew the query's length could reach).
``--bidaw-kwargs '{"samples": 4096}'`` passes keyword arguments to the ``bidaw`` row's
:class:`~tieredkv.policies.AdaptiveBidaw` (to try a setting against the default in the
same run, name it beside a default row: ``--policies bidaw,bidaw-density``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import msgspec

from _bidaw_kwargs import add_bidaw_kwargs, parse_bidaw_kwargs
from _density import KnownDistribution, LearnedDensity, TraceQueryStatistics, TraceStatistics
from tieredkv.policies import AdaptiveBidaw, Eviction, make_eviction
from tieredkv.sim.agentic import AgenticWorkload, replay_agentic
from tieredkv.sim.replay import replay
from tieredkv.sim.synthetic import SyntheticWorkload
from tieredkv.sim.workloads import read_mooncake

MOONCAKE = (
    Path(__file__).resolve().parents[1]
    / "tests"
    / "data"
    / "mooncake"
    / "conversation_trace_head1500.jsonl"
)

DENSITY = "bidaw-density"
POLICIES = ("lru", "bidaw-paper", "bidaw", DENSITY, "belady")
LEARNED, KNOWN, TRACE = "learned-density", "known-distribution", "trace-statistics"
TRACE_QUERY = "trace-query-statistics"
TRACE_INSTRUMENTS = {TRACE: TraceStatistics, TRACE_QUERY: TraceQueryStatistics}
"""The ``--bound`` instruments built from the replayed trace itself."""


BIDAW_KWARGS: dict[str, Any] = {}
"""``--bidaw-kwargs``: the ``bidaw`` row's constructor arguments."""


def build(name: str, workload: SyntheticWorkload | None = None) -> Eviction:
    """A registered policy, or one of the ``--bound`` instruments."""
    if name == LEARNED:
        return LearnedDensity()
    if name == KNOWN:
        assert workload is not None
        return KnownDistribution(workload)
    if name == DENSITY:
        return AdaptiveBidaw(ranking="density")
    return make_eviction(name, **(BIDAW_KWARGS if name == "bidaw" else {}))


HINTS = {"no hints": (0.0, 0.0), "correct hints": (1.0, 0.0), "wrong hints": (1.0, 1.0)}


class Row(msgspec.Struct, frozen=True):
    """Hit ratios of every policy on one workload at one host size."""

    workload: str
    gb: float
    hits: dict[str, float]

    def ratio(self, policy: str) -> float:
        """``policy``'s hit ratio over Belady's."""
        return self.hits[policy] / self.hits["belady"]


def measure_human(
    users: int, rate: float, seed: int, gbs: list[float], extra: tuple[str, ...] = ()
) -> list[Row]:
    workload = SyntheticWorkload(users=users, arrival_rate=rate, seed=seed)
    turns = workload.generate()
    rows = []
    for gb in gbs:
        hits = {
            name: replay(
                turns, build(name, workload), host_bytes=int(gb * 1e9), warmup=len(turns) // 10
            ).hit_ratio
            for name in POLICIES + extra
        }
        rows.append(Row("human", gb, hits))
    return rows


def measure_mooncake(
    gbs: list[float], path: Path = MOONCAKE, extra: tuple[str, ...] = ()
) -> list[Row]:
    turns = read_mooncake(path)
    label = "human, mooncake head" if path == MOONCAKE else "human, mooncake"
    rows = []
    for gb in gbs:
        hits = {
            name: replay(
                turns,
                TRACE_INSTRUMENTS[name](turns) if name in TRACE_INSTRUMENTS else build(name),
                host_bytes=int(gb * 1e9),
                warmup=len(turns) // 10,
            ).hit_ratio
            for name in POLICIES + extra
        }
        rows.append(Row(label, gb, hits))
    return rows


def measure_agentic(
    users: int, rate: float, seed: int, gbs: list[float], extra: tuple[str, ...] = ()
) -> list[Row]:
    rows = []
    for label, (hinted, wrong) in HINTS.items():
        load = AgenticWorkload(
            users=users, arrival_rate=rate, hinted=hinted, wrong=wrong, seed=seed
        ).generate()
        for gb in gbs:
            hits = {
                name: replay_agentic(
                    load, build(name), host_bytes=int(gb * 1e9), warmup=len(load) // 10
                ).hit_ratio
                for name in POLICIES + extra
            }
            rows.append(Row(f"agentic, {label}", gb, hits))
    return rows


def render(rows: list[Row]) -> list[str]:
    lines = []
    for row in rows:
        cells = "  ".join(
            f"{name} {row.hits[name]:.3f} ({row.ratio(name):.3f}x)" for name in row.hits
        )
        lines.append(f"{row.workload:24} {row.gb:5.0f} GB  {cells}")
    return lines


def main() -> None:
    global POLICIES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=3000, help="human workload's users")
    parser.add_argument("--rate", type=float, default=0.5, help="new users per second")
    parser.add_argument("--agentic-users", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--human-gb", default="120,240")
    parser.add_argument("--agentic-gb", default="100,200,400")
    parser.add_argument("--mooncake-gb", default="50,100,200")
    parser.add_argument(
        "--mooncake", type=Path, default=MOONCAKE, help="a Mooncake conversation trace"
    )
    parser.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="registered policies to compare (belady is always run: ratios are to it)",
    )
    parser.add_argument(
        "--skip",
        default="",
        help="workloads to leave out, comma-separated: human, mooncake, agentic",
    )
    parser.add_argument(
        "--bound", action="store_true", help="also the hit-density instruments (_density.py)"
    )
    add_bidaw_kwargs(parser)
    args = parser.parse_args()
    BIDAW_KWARGS.update(parse_bidaw_kwargs(parser, args.bidaw_kwargs))
    start = time.perf_counter()
    POLICIES = tuple(dict.fromkeys([*args.policies.split(","), "belady"]))
    skip = set(filter(None, args.skip.split(",")))
    learned: tuple[str, ...] = (LEARNED,) if args.bound else ()
    human = (
        []
        if "human" in skip
        else measure_human(
            args.users,
            args.rate,
            args.seed,
            [float(g) for g in args.human_gb.split(",")],
            (LEARNED, KNOWN) if args.bound else (),
        )
    )
    if "mooncake" not in skip:
        human += measure_mooncake(
            [float(g) for g in args.mooncake_gb.split(",")],
            args.mooncake,
            (*learned, TRACE, TRACE_QUERY) if args.bound else (),
        )
    agentic = (
        []
        if "agentic" in skip
        else measure_agentic(
            args.agentic_users,
            args.rate,
            args.seed,
            [float(g) for g in args.agentic_gb.split(",")],
            learned,
        )
    )
    print("host hit ratio (ratio to Belady's on the same turns and host size)")
    for line in render(human + agentic):
        print(line)
    by = {(r.workload, r.gb): r for r in agentic}
    print("wrong hints vs no hints, bidaw:")
    for (workload, gb), row in by.items():
        if workload.endswith("wrong hints"):
            if "bidaw" not in row.hits:
                continue
            base = by["agentic, no hints", gb].hits["bidaw"]
            print(f"  {gb:5.0f} GB  {row.hits['bidaw'] / base - 1:+.1%}")
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
