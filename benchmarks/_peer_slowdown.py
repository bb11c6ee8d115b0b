"""Why ``safetensors`` ran 2-3x slower inside the one-process API benchmark than alone: the
same ``st_write`` / ``st_read`` (bench_api's) in a fresh process per condition, with what
that benchmark's process also held added one at a time:

- ``alone``: nothing else;
- ``buffers``: the old benchmark's own buffers, prefaulted (the aligned raw blobs, the
  expected history and two ``load_into`` outputs: 4x the history's bytes);
- ``open cache``: a cache open in a portal thread (an event loop and its tier's worker
  threads), after one append and load of the same turns;
- ``both``: the two together (the old benchmark's process);
- ``both, 1 thread``: the same with ``torch.set_num_threads(1)``.

Conditions alternate in order over ``--reps``; every read is cold (fadvise + drop_caches
where permitted) and checked byte for byte. Prints wall GB/s, CPU-s/GB and faults/GB of
each (medians)::

    .venv/bin/python benchmarks/_peer_slowdown.py [--mib 64] [--turns 8] [--reps 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import torch

from _measure import cold, measured
from bench_api import (
    aligned_buffer,
    append_turns,
    history,
    make_turns,
    new_cache,
    same,
    st_read,
    st_write,
    turn_blobs,
)

CONDITIONS = ("alone", "buffers", "open cache", "both", "both, 1 thread")


def condition(name: str, root: Path, mib: int, turns_n: int) -> dict[str, Any]:
    turns = make_turns(turns_n, 64, mib)
    want = history(turns)
    held: list[Any] = []
    if name in ("buffers", "both", "both, 1 thread"):
        blobs = turn_blobs(turns)
        outs = [{k: torch.zeros_like(v) for k, v in want.items()} for _ in range(2)]
        held += [blobs, outs, [aligned_buffer(1)]]
    portal_cm = None
    if name in ("open cache", "both", "both, 1 thread"):
        (root / "cache").mkdir()
        portal_cm = anyio.from_thread.start_blocking_portal()
        portal = portal_cm.__enter__()
        cache = new_cache(root / "cache")
        portal.call(cache.open)
        portal.call(append_turns, cache, "warm", turns)
        portal.call(cache.load, "warm")
    if name == "both, 1 thread":
        torch.set_num_threads(1)
    out: dict[str, Any] = {}
    files = root / "st"
    files.mkdir()
    with measured() as w:
        st_write(files, turns)
    cold(files, True)
    with measured() as r:
        got = st_read(files, turns_n)
    out["ok"] = same(got, want)
    if portal_cm is not None:
        portal.call(cache.aclose)
        portal_cm.__exit__(None, None, None)
    out["write"], out["read"] = w.as_dict(), r.as_dict()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--mib", type=int, default=64, help="turn size")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args(argv)
    gb = args.turns * args.mib * (1 << 20) / 1e9
    got: dict[str, list[dict[str, Any]]] = {c: [] for c in CONDITIONS}
    ctx = multiprocessing.get_context("spawn")
    base = Path(tempfile.mkdtemp(prefix="peer-", dir=args.dir))
    try:
        for rep in range(args.reps):
            order = CONDITIONS if rep % 2 == 0 else CONDITIONS[::-1]
            for c in order:
                d = Path(tempfile.mkdtemp(dir=base))
                with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
                    res = pool.submit(condition, c, d, args.mib, args.turns).result()
                shutil.rmtree(d)
                if not res["ok"]:
                    print(f"{c}: safetensors read other bytes", file=sys.stderr)
                    return 1
                got[c].append(res)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"safetensors, {args.turns} turns of {args.mib} MiB, median of {args.reps}")
    print(f"{'condition':<16}{'write GB/s':>11}{'CPU-s/GB':>9}{'faults/GB':>10}", end="")
    print(f"{'read GB/s':>11}{'CPU-s/GB':>9}{'faults/GB':>10}")
    for c, rs in got.items():
        line = f"{c:<16}"
        for op in ("write", "read"):
            wall = statistics.median(x[op]["wall"] for x in rs)
            cpu = statistics.median(x[op]["cpu"] for x in rs)
            flt = statistics.median(x[op]["minflt"] for x in rs)
            line += f"{gb / wall:>11.2f}{cpu / gb:>9.3f}{flt / gb:>10.0f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
