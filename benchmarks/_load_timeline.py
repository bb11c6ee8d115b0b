"""Where an open cache's ``load_into`` spends the time that raw reads of the same files into
the same places do not: a timeline of every ``preadv`` and ``os.open`` of both.

The cache's segment files are written once (16 turns of 64 x 128 KiB by default, as
``bench_api.py`` writes them); the destinations are one load's outputs, kept, and the raw
reader reads each whole file into the same places with one O_DIRECT ``preadv``
(``bench_load_overlap.py``'s ``raw places``; ``--depth`` threads). The two alternate, the
files made cold before each (``_measure.cold``). Per mode, the median over the reps of:
the whole call, when its first ``os.open`` and its first ``preadv`` began (ms after the
call), how long after the last ``preadv`` ended the call returned, the time with a read in
flight, and how many reads were in flight on average meanwhile::

    PYTHONPATH=src .venv/bin/python benchmarks/_load_timeline.py [--reps 20] [--dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_api as api
import bench_load_overlap as overlap
from _measure import cold

Span = tuple[float, float]

_reads: list[Span] = []
_opens: list[Span] = []
_lock = threading.Lock()


def timed(real: Callable[..., Any], into: list[Span]) -> Callable[..., Any]:
    """``real``, recording when each call began and ended in ``into`` (also
    ``_stream_ab.py``'s)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        out = real(*args, **kwargs)
        ended = time.perf_counter()
        with _lock:
            into.append((began, ended))
        return out

    return call


def summary(t0: float, t1: float, reads: list[Span], opens: list[Span]) -> dict[str, float]:
    """One call's figures (ms): see the module's doc."""
    reads = sorted(reads)
    edges = sorted([(s, 1) for s, _ in reads] + [(e, -1) for _, e in reads])
    flight, since, busy, area = 0, reads[0][0], 0.0, 0.0
    for at, step in edges:
        if flight:
            busy += at - since
            area += flight * (at - since)
        flight += step
        since = at
    return {
        "call": (t1 - t0) * 1e3,
        "first open": (min(s for s, _ in opens) - t0) * 1e3,
        "first read": (reads[0][0] - t0) * 1e3,
        "after last read": (t1 - max(e for _, e in reads)) * 1e3,
        "reads in flight": busy * 1e3,
        "mean in flight": area / busy,
    }


async def run(args: argparse.Namespace, root: Path) -> dict[str, list[dict[str, float]]]:
    turns = api.make_turns(args.turns, args.tensors, args.mib)
    out: dict[str, list[dict[str, float]]] = {"raw places": [], "load_into": []}
    with api.raw_readers(args.depth) as pool:
        async with api.new_cache(root) as cache:
            await api.append_turns(cache, "user", turns)
            await cache.load("user")  # its buffers and outputs exist, as in bench_api
            files, _ = overlap.segment_files(root, args.turns)
            places, pieces = await overlap.load_places(cache, files)
            want = {k: v.clone() for k, v in places.items()}
            real_preadv, real_open = os.preadv, os.open
            os.preadv = timed(real_preadv, _reads)
            os.open = timed(real_open, _opens)
            try:
                for rep in range(args.reps):
                    modes = list(out) if rep % 2 else list(out)[::-1]
                    for mode in modes:
                        cold(root, True)
                        _reads.clear()
                        _opens.clear()
                        raw = mode == "raw places"
                        t0, t1 = await overlap.read_places(
                            cache, places, want, files, pieces, pool, raw
                        )
                        out[mode].append(summary(t0, t1, list(_reads), list(_opens)))
            finally:
                os.preadv, os.open = real_preadv, real_open
    return out


def main(argv: list[str] | None = None) -> int:
    args = overlap.parser(__doc__, reps=20).parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="tieredkv-timeline-", dir=args.dir))
    try:
        out = asyncio.run(run(args, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    names = list(next(iter(out.values()))[0])
    print(f"{'median of ' + str(args.reps):<18}" + "".join(f"{n:>17}" for n in names))
    for mode, rows in out.items():
        cells = (statistics.median(r[n] for r in rows) for n in names)
        print(f"{mode:<18}" + "".join(f"{c:>17.2f}" for c in cells))
    print("(ms; 'mean in flight': reads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
