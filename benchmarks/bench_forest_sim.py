"""Host bytes and host hit ratios with and without sharing, in the simulator.

Run: ``.venv/bin/python benchmarks/bench_forest_sim.py [--mooncake PATH] [--gb 8,16]
[--mooncake-gb 64,256] [--policies lru,bidaw] [--seed 0] [--bidaw-kwargs JSON]``. Two
workloads whose conversations share history (:mod:`tieredkv.sim.forest`):

- 200 synthetic conversations sharing a 2,048-token system prompt, 5% of turns forking
  (an edited message or a regenerated answer);
- the Mooncake FAST'25 conversation trace, its requests' 512-token prefix blocks shared by
  ``hash_ids`` (skipped if the file is absent).

For each it prints the workload's unique bytes (every distinct range once) against every
conversation's history added up; the most bytes an unbounded host memory held with and
without sharing (held / unique); and, at each fixed host size, each policy's hit ratio
without and with sharing, the most bytes held with sharing against the history bytes of
the conversations resident then (logical), and the admissions the policy could not make
room for (rejected) without and with sharing; and the part of the shared history of first
turns (a new conversation's prompt, a fork's inherited turns) that host memory held when
they came (prefix held; a first turn counts as neither hit nor miss in the hit ratios, and
without sharing nothing is held for it) (the eviction-only replay,
:func:`~tieredkv.sim.forest.replay_forest`). KV is Llama-3-8B-sized: 128 KiB per token.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import msgspec

from _bidaw_kwargs import add_bidaw_kwargs, parse_bidaw_kwargs
from tieredkv.policies import Eviction, make_eviction
from tieredkv.sim.forest import Forest, SharedPromptWorkload, read_mooncake_forest, replay_forest

BPT = 128 * 1024
GIB = 1 << 30
MOONCAKE = "/work/shared/traces/mooncake_fast25/conversation_trace.jsonl"
BIDAW_KWARGS: dict[str, Any] = {}
"""Keyword arguments for the ``bidaw`` rows' :class:`~tieredkv.policies.AdaptiveBidaw`."""


def build(name: str) -> Eviction:
    """A registered policy; the ``bidaw`` rows with :data:`BIDAW_KWARGS`."""
    return make_eviction(name, **(BIDAW_KWARGS if name == "bidaw" else {}))


def report(name: str, forest: Forest, sizes: list[float], policies: list[str]) -> None:
    turns = forest.turns
    unique = forest.unique_tokens() * BPT
    total = forest.total_tokens() * BPT
    print(
        f"\n== {name}: {len(turns):,} turns, {turns.users():,} conversations; unique "
        f"{unique / GIB:,.1f} GiB, histories added up {total / GIB:,.1f} GiB "
        f"({total / unique:.2f}x)"
    )
    for sharing in (False, True):
        r = replay_forest(forest, make_eviction("lru"), host_bytes=1 << 60, sharing=sharing,
                          bytes_per_token=BPT)  # fmt: skip
        print(
            f"unbounded host, sharing {'on ' if sharing else 'off'}: held "
            f"{r.peak_stored_bytes / GIB:,.1f} GiB = {r.peak_stored_bytes / unique:.3f}x unique"
        )
    print(
        f"{'host GiB':>8} {'policy':<8} {'hit off':>8} {'hit on':>8} "
        f"{'held on/logical':>16} {'rejected off/on':>16} {'prefix held':>11} {'s':>5}"
    )
    for gb in sizes:
        for policy in policies:
            t = time.perf_counter()
            host = int(gb * GIB)
            off = replay_forest(forest, build(policy), host_bytes=host, sharing=False,
                                bytes_per_token=BPT)  # fmt: skip
            on = replay_forest(forest, build(policy), host_bytes=host, sharing=True,
                               bytes_per_token=BPT)  # fmt: skip
            assert on.replay.accesses == off.replay.accesses
            print(
                f"{gb:>8g} {policy:<8} {off.replay.hit_ratio:>8.4f} {on.replay.hit_ratio:>8.4f} "
                f"{on.peak_stored_bytes / GIB:>7.1f}/{on.peak_logical_bytes / GIB:<8.1f}"
                f"{off.replay.rejected:>8}/{on.replay.rejected:<7}"
                f"{on.prefix_hit_bytes / max(on.prefix_bytes, 1):>11.4f}"
                f"{time.perf_counter() - t:>5.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", default="8,16", help="host sizes for the shared prompt, GiB")
    parser.add_argument("--mooncake", default=MOONCAKE, help="conversation_trace.jsonl")
    parser.add_argument("--mooncake-gb", default="64,256", help="host sizes for Mooncake, GiB")
    parser.add_argument("--policies", default="lru,bidaw")
    parser.add_argument("--seed", type=int, default=0, help="the shared-prompt workload's seed")
    add_bidaw_kwargs(parser)
    args = parser.parse_args()
    BIDAW_KWARGS.update(parse_bidaw_kwargs(parser, args.bidaw_kwargs))
    policies = args.policies.split(",")
    base = msgspec.structs.replace(SharedPromptWorkload().base, seed=args.seed)
    report(
        "shared prompt (200 conversations, 2,048-token prompt, 5% of turns fork)",
        SharedPromptWorkload(base=base).generate(),
        [float(g) for g in args.gb.split(",")],
        policies,
    )
    if os.path.exists(args.mooncake):
        report(
            "Mooncake conversation trace (hash_ids blocks shared)",
            read_mooncake_forest(args.mooncake),
            [float(g) for g in args.mooncake_gb.split(",")],
            policies,
        )
    else:
        print(f"\n(no Mooncake trace at {args.mooncake}: skipped)")


if __name__ == "__main__":
    main()
