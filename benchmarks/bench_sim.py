"""Simulator speed: simulated turns per second, eviction-only replay and full serving
simulation, for LRU and for Bidaw.

Run: ``.venv/bin/python benchmarks/bench_sim.py [--users 22000] [--rate 30]``. The default
is the shape of the Bidaw trace the issue names: about 22k users and 500k turns
(synthetic, 15 users per minute, so about 24 hours of arrivals), OPT-13B on an A800 with
200 GB of host memory and a 1.5 GB/s SSD. Target: the full serving simulation of that
trace in under 3 minutes on 2 cores (printed as a ratio: below 1.0 meets it).
"""

from __future__ import annotations

import argparse
import time

from tieredkv.policies import make_eviction
from tieredkv.sim.engine import SimConfig, simulate
from tieredkv.sim.replay import replay
from tieredkv.sim.synthetic import SyntheticWorkload
from tieredkv.sim.systems import get_system

TARGET_S = 180.0  # the budget for the ~500k-turn trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=22000)
    parser.add_argument("--rate", type=float, default=15.0, help="users per minute")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    turns = SyntheticWorkload(
        users=args.users, arrival_rate=args.rate / 60, seed=args.seed
    ).generate()
    n = len(turns)
    print(f"workload: {n:,} turns of {args.users:,} users at {args.rate:g} users/min")
    cfg = SimConfig()
    rows: list[tuple[str, float, float | None]] = []
    for policy in ("lru", "bidaw"):
        start = time.perf_counter()
        replay(turns, make_eviction(policy), host_bytes=int(cfg.host_gb * 1e9))
        rows.append((f"replay, {policy}", n / (time.perf_counter() - start), None))
    for label, system in (
        ("serving, LRU (flashgen)", get_system("flashgen")),
        ("serving, Bidaw (bidaw)", get_system("bidaw")),
    ):
        start = time.perf_counter()
        result = simulate(turns, system, cfg)
        elapsed = time.perf_counter() - start
        rows.append((label, n / elapsed, elapsed))
        print(
            f"  {label}: mean latency {result.latency_mean:.1f} s, host hit ratio "
            f"{result.host_hit_ratio:.3f}"
        )
    print(f"\n{'what':28} {'turns/s':>10} {'wall s':>8} {'vs 3-min target':>16}")
    for label, rate, wall in rows:
        if wall is None:
            print(f"{label:28} {rate:10,.0f} {n / rate:8.1f} {'':>16}")
        else:
            # scale to 500k turns, the trace's size
            projected = 500_000 / rate
            print(f"{label:28} {rate:10,.0f} {wall:8.1f} {projected / TARGET_S:15.2f}x")
    print("(vs target: projected wall time for 500k turns / 180 s; below 1.0 meets it)")


if __name__ == "__main__":
    main()
