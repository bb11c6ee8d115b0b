"""The rare long calls of the default eviction's ``on_access``, and what makes them: a
diagnostic for the policy's tail, not a benchmark.

``bench_policies.py`` measures medians and p99s, and some costs of the policy come far less
often than once in a hundred calls: some of its bookkeeping starts over on a new structure
once enough has changed, and Python's dicts resize as they grow. This drives
:class:`~tieredkv.policies.AdaptiveBidaw` with ``--sessions`` users accessed in a random order
(``--rounds`` accesses each, 1 MiB apiece), without hints, and again with every access
hinting a next turn far away (so that every hint stays outstanding, as with agents that all
announce their next call). It prints the quantiles of one ``on_access`` call, and every call
over ``--over-ms`` with its cause:

- ``tracker start``: the reuse tracker began a new tree, before its positions run out
  (once per about three times as many accesses as sessions); it fills a few positions per
  access, so this call only allocates it;
- ``tracker takeover``: the new tree took over from the old one;
- ``hints``: the heap of hint deadlines was set aside for a new one (once superseded hints
  make up half of it); its live deadlines move over a few per hint;
- ``tables``: the potential tables were refreshed (every ``refresh_every`` accesses);
- ``departures (n)``: n users were counted gone at once (``depart`` seconds without a turn);
- ``other``: none of these. On 6 December 2026 they came at the same accesses with and
  without hints, so they are the policy's own work, not a pause of the process: Python
  resizing its dicts of 100k sessions (the tracker's three and the policy's own grow
  together, so they resize in the same call).

Until 6 December 2026 the tracker rebuilt its whole tree in one call (62-300 ms at 100k
sessions) and the hint deadlines their whole heap (60-110 ms with 100k hints outstanding).

Run::

    PYTHONPATH=src .venv/bin/python benchmarks/_policy_stalls.py [--sessions 100000]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Sequence

import numpy as np

from tieredkv.meta import KVMeta
from tieredkv.policies import AdaptiveBidaw

MiB = 1 << 20


def stalls(
    sessions: int, rounds: int, *, hints: bool, over_ns: int, seed: int = 1
) -> tuple[list[int], list[tuple[int, int, str]]]:
    """Every ``on_access`` time (ns), and the calls over ``over_ns``: (access, ns, cause)."""
    policy = AdaptiveBidaw()
    rng = np.random.default_rng(seed)
    turns: dict[str, int] = {}
    times: list[int] = []
    slow: list[tuple[int, int, str]] = []
    tracker = policy._tracker  # (private: only to tell what a long call did)
    clock = time.perf_counter_ns
    now = 0.0
    for i, s in enumerate(rng.integers(0, sessions, size=rounds * sessions).tolist()):
        now += 0.01
        name = f"s{s}"
        turns[name] = turns.get(name, 0) + 1
        meta = KVMeta(
            session=name,
            tier="host",
            nbytes=MiB,
            turns=turns[name],
            prev_answer_tokens=40,
            last_access=now,
            next_turn=now + 1e6 if hints else None,
        )
        before = (tracker._rebuild, len(policy._deadlines), policy._tables, len(policy._waiting))
        t0 = clock()
        policy.on_access(name, meta, now)
        took = clock() - t0
        policy.on_admit(name, meta, now)
        times.append(took)
        if took > over_ns:
            if (tracker._rebuild is None) != (before[0] is None):
                cause = "tracker start" if before[0] is None else "tracker takeover"
            elif len(policy._deadlines) < before[1]:
                cause = "hints"
            elif policy._tables is not before[2]:
                cause = "tables"
            elif len(policy._waiting) < before[3] - 1:
                cause = f"departures ({before[3] - len(policy._waiting):,})"
            else:
                cause = "other"
            slow.append((i, took, cause))
    return times, slow


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=4, help="accesses per session")
    p.add_argument("--over-ms", type=float, default=1.0, help="list the calls longer than this")
    args = p.parse_args(argv)
    gc.disable()  # (collections would land on random calls)
    for hints in (False, True):
        times, slow = stalls(
            args.sessions, args.rounds, hints=hints, over_ns=int(args.over_ms * 1e6)
        )
        us = np.array(times) / 1e3
        print(
            f"{args.sessions:,} sessions, {len(times):,} accesses, "
            f"{'every access hints' if hints else 'no hints'}: on_access median "
            f"{np.median(us):.1f} us, p99 {np.percentile(us, 99):.1f} us, p99.99 "
            f"{np.percentile(us, 99.99):.1f} us, longest {us.max() / 1e3:.1f} ms"
        )
        for i, took, cause in slow:
            print(f"  access {i:>9,}: {took / 1e6:7.1f} ms  {cause}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
