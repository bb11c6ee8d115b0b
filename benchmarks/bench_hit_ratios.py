"""Host-memory hit ratios of every eviction policy on the synthetic interactive workload.

Run: ``.venv/bin/python benchmarks/bench_hit_ratios.py [--users N] [--rate R] [--seeds 0,1]
[--gb 200,240]``. Prints, per seed and host-memory size, each policy's hit ratio (and byte
hit ratio), and the paper's Bidaw (``bidaw-paper``) miss-ratio reduction against
queue-enhanced and LRU/FIFO, the paper's comparison. ``bidaw`` is the default eviction (the
paper's estimator over finer buckets: on this human workload it decides as the paper's);
``benchmarks/bench_retention.py`` compares them on agentic workloads.
"""

from __future__ import annotations

import argparse
import time

from tieredkv.policies import BidawEviction, make_eviction
from tieredkv.sim.replay import replay
from tieredkv.sim.synthetic import SyntheticWorkload, describe

POLICIES = ["fifo", "lru", "lfu", "queue-enhanced", "belady", "bidaw-paper", "bidaw"]
ABLATIONS: list[tuple[str, dict[str, object]]] = [
    ("one answer bucket", {"answer_edges": ()}),
    ("not size-aware", {"size_aware": False}),
    ("neither", {"answer_edges": (), "size_aware": False}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=0.5, help="new users per second")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--gb", default="240", help="host memory sizes, GB (10^9 bytes)")
    parser.add_argument(
        "--ablation", action="store_true", help="also run Bidaw without answer buckets / sizes"
    )
    args = parser.parse_args()
    for seed in (int(s) for s in args.seeds.split(",")):
        turns = SyntheticWorkload(users=args.users, arrival_rate=args.rate, seed=seed).generate()
        shape = describe(turns)
        print(
            f"seed {seed}: {len(turns):,} turns, {int(shape['users']):,} users, "
            f"gap P10/50/90 {shape['gap_p10']:.0f}/{shape['gap_median']:.0f}/"
            f"{shape['gap_p90']:.0f} s"
        )
        for gb in (float(g) for g in args.gb.split(",")):
            hits: dict[str, float] = {}
            misses: dict[str, float] = {}
            cells = []
            for name in POLICIES:
                start = time.perf_counter()
                r = replay(
                    turns,
                    make_eviction(name),
                    host_bytes=int(gb * 1e9),
                    warmup=len(turns) // 10,
                )
                rate = len(turns) / (time.perf_counter() - start)
                hits[name], misses[name] = r.hit_ratio, r.miss_ratio
                cells.append(
                    f"{name:15} hit {r.hit_ratio:.3f}  byte-hit {r.byte_hit_ratio:.3f}  "
                    f"({rate / 1e3:.0f}k turns/s)"
                )
            print(f"  {gb:.0f} GB:")
            for cell in cells:
                print(f"    {cell}")
            change = {
                b: misses["bidaw-paper"] / misses[b] - 1 for b in ("queue-enhanced", "lru", "fifo")
            }
            if args.ablation:
                for label, kwargs in ABLATIONS:
                    r = replay(
                        turns,
                        BidawEviction(**kwargs),  # type: ignore[arg-type]
                        host_bytes=int(gb * 1e9),
                        warmup=len(turns) // 10,
                    )
                    print(
                        f"    bidaw, {label:28} hit {r.hit_ratio:.3f}  byte-hit "
                        f"{r.byte_hit_ratio:.3f}  miss vs queue-enhanced "
                        f"{r.miss_ratio / misses['queue-enhanced'] - 1:+.1%}"
                    )
            print(
                f"    Bidaw (paper) miss ratio vs queue-enhanced {change['queue-enhanced']:+.1%} "
                f"(paper -57.6%); vs LRU {change['lru']:+.1%}, vs FIFO {change['fifo']:+.1%} "
                f"(paper -69.9% vs FIFO/LRU/LFU)"
            )


if __name__ == "__main__":
    main()
