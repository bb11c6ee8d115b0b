"""An open cache's cold ``load`` with this tree's span stream and with another tree's, in one
process, alternating: whether a change to ``tieredkv/backends/ssd/stream.py`` moves the
load, measured without the drift between processes that ``bench_api.py``'s child per round
lets in (its load / raw O_DIRECT ratio moved between 0.82 and 0.92 in four runs of one
hour with the code unchanged).

``--other`` names another checkout (or its ``src``): its ``stream.py`` is loaded beside
this one, and each rep loads the same history twice, once with each tree's
``SpanStream.read`` (the other's with its own module: its ``_Flight``, its helpers; the
rest of the tier is this tree's), in alternating order, the files made cold before each
(``_measure.cold``). Every load is compared byte for byte. Per tree, the median over the
reps of: the whole call, when its first ``preadv`` began, how long after a read returned
the read ``READ_DEPTH`` later began (the median over the load's reads; ``-`` for a load of
no more reads than that), and how long after the last read ended the call returned; then
the median of the reps' paired speed ratios, this tree's against the other's::

    git worktree add /tmp/other <commit>
    PYTHONPATH=src .venv/bin/python benchmarks/_stream_ab.py --other /tmp/other [--reps 30]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import bench_api as api
import bench_load_overlap as overlap
from _load_timeline import Span, timed
from _measure import cold
from tieredkv.backends.ssd import reader, stream

FIGURES = ("call", "first read", "next read", "after last")

_reads: list[Span] = []


def other_stream(checkout: Path) -> ModuleType:
    """The other tree's ``stream.py``, as a module of this tree's package (its relative
    imports are this tree's modules)."""
    for src in (checkout / "src", checkout):
        path = src / "tieredkv" / "backends" / "ssd" / "stream.py"
        if path.is_file():
            break
    else:
        raise SystemExit(f"--other {checkout}: no src/tieredkv/backends/ssd/stream.py there")
    name = "tieredkv.backends.ssd._other_stream"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def summary(t0: float, t1: float, reads: list[Span]) -> dict[str, float]:
    """One load's figures (ms): see the module's doc."""
    starts = sorted(s for s, _ in reads)
    ends = sorted(e for _, e in reads)
    depth = reader.READ_DEPTH
    later = [starts[k + depth] - ends[k] for k in range(len(starts) - depth)]
    return {
        "call": (t1 - t0) * 1e3,
        "first read": (starts[0] - t0) * 1e3,
        "next read": statistics.median(later) * 1e3 if later else math.nan,
        "after last": (t1 - ends[-1]) * 1e3,
    }


async def run(args: argparse.Namespace, root: Path, other: ModuleType) -> dict[str, Any]:
    turns = api.make_turns(args.turns, args.tensors, args.mib)
    want = api.history(turns)
    reads = {"this": stream.SpanStream.read, "other": other.SpanStream.read}
    out: dict[str, list[dict[str, float]]] = {tree: [] for tree in reads}
    ratios: list[float] = []
    real = os.preadv
    async with api.new_cache(root) as cache:
        await api.append_turns(cache, "user", turns)
        await cache.load("user")  # its buffers and outputs exist, as in bench_api
        os.preadv = timed(real, _reads)
        try:
            for rep in range(args.reps):
                took: dict[str, float] = {}
                for tree in list(reads) if rep % 2 == 0 else list(reads)[::-1]:
                    stream.SpanStream.read = reads[tree]  # type: ignore[method-assign]
                    cold(root, True)
                    _reads.clear()
                    t0 = time.perf_counter()
                    got = await cache.load("user")
                    t1 = time.perf_counter()
                    if not api.same(got, want):
                        raise AssertionError(f"the load with {tree} stream loaded other bytes")
                    del got
                    out[tree].append(summary(t0, t1, list(_reads)))
                    took[tree] = t1 - t0
                ratios.append(took["other"] / took["this"])
        finally:
            os.preadv = real
            stream.SpanStream.read = reads["this"]  # type: ignore[method-assign]
    return {"rows": out, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = overlap.parser(__doc__, reps=30)
    parser.add_argument("--other", type=Path, required=True, help="another checkout")
    args = parser.parse_args(argv)
    other = other_stream(args.other)
    root = Path(tempfile.mkdtemp(prefix="tieredkv-stream-ab-", dir=args.dir))
    try:
        done = asyncio.run(run(args, root, other))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{args.turns} turns x {args.tensors} tensors = {args.mib} MiB turns; {args.reps} reps, "
        f"one process, alternating; this tree's stream and {args.other}'s"
    )
    print(f"{'median of ' + str(args.reps):<14}" + "".join(f"{n:>12}" for n in FIGURES))
    for tree, rows in done["rows"].items():
        cells = []
        for n in FIGURES:
            values = [r[n] for r in rows if not math.isnan(r[n])]
            cells.append(f"{statistics.median(values):>12.2f}" if values else f"{'-':>12}")
        print(f"{tree:<14}" + "".join(cells))
    ratios = done["ratios"]
    faster = sum(r > 1 for r in ratios)
    print(
        f"(ms) load speed, this / other: median of the reps' ratios "
        f"{statistics.median(ratios):.3f} (this faster in {faster} of {len(ratios)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
