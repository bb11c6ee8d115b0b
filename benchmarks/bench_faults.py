"""What new host memory costs: faulting in an anonymous mapping, each kind in a process of
its own, against the private mapping that ``tieredkv.backends._buffers.anonymous`` makes.

A load into new tensors, a new cache's staging buffers and a host tier's arena all start as
new memory, and on a small VM its page faults cost more than the copy into it. Kinds:

- ``shared``: Python's default ``mmap.mmap(-1, n)``, a *shared* anonymous mapping (shmem);
- ``private``: ``MAP_PRIVATE | MAP_ANONYMOUS`` (what the library uses), touched page by page;
- ``private populated``: the same, faulted in by one ``madvise(MADV_POPULATE_WRITE)``
  (``prefaulted``);
- ``huge pages``: private with ``madvise(MADV_HUGEPAGE)``, touched: 2 MiB faults where the
  kernel gives huge pages (``/sys/kernel/mm/transparent_hugepage/enabled``);
- ``huge pages reused``: the same, mapped a second time in the same process right after the
  first was unmapped (the huge pages the kernel just got back);
- ``huge pages, idle 3 s``: the same after 3 s in which the machine maps nothing (a server
  between bursts): with free page reporting, the host has taken back every free 2 MiB
  block by then, and each huge page faults on the host as well.

Each kind runs in a new process (``--reps`` times, order rotating), maps ``--mib`` MiB,
touches one byte per 4 KiB page and reports the median wall ms, CPU ms and minor faults,
and GB/s; ratios are against ``private``. Also prints the machine's THP setting and
whether the balloon device reports free pages to the host (``page_reporting``), which makes
every fresh huge page fault on the host as well::

    .venv/bin/python benchmarks/bench_faults.py [--mib 128] [--reps 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from _measure import measured
from tieredkv.backends._buffers import anonymous

KINDS = (
    "shared",
    "private",
    "private populated",
    "huge pages",
    "huge pages reused",
    "huge pages, idle 3 s",
)

MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)


def touch(buf: mmap.mmap) -> None:
    np.frombuffer(buf, dtype=np.uint8)[:: mmap.PAGESIZE] = 1


def huge(size: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(MADV_HUGEPAGE)
    return buf


def one(kind: str, size: int) -> dict[str, float]:
    """Map and fault in ``size`` bytes of ``kind`` in this (new) process."""
    if kind == "huge pages reused":
        first = huge(size)
        touch(first)
        first.close()
    if kind == "huge pages, idle 3 s":
        time.sleep(3.0)
    with measured() as took:
        if kind == "shared":
            buf = mmap.mmap(-1, size)
        elif kind == "private":
            buf = anonymous(size)
        elif kind == "private populated":
            buf = anonymous(size, populate=True)
        else:
            buf = huge(size)
        if kind != "private populated":
            touch(buf)
    buf.close()
    return {"wall": took.wall, "cpu": took.cpu, "minflt": float(took.minflt)}


def read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="MiB per mapping")
    parser.add_argument("--reps", type=int, default=5, help="processes per kind")
    args = parser.parse_args(argv)
    if args.mib < 1 or args.reps < 1:
        parser.error("--mib and --reps must be at least 1")
    size = args.mib << 20
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "tieredkv.backends._buffers"])
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, max_tasks_per_child=1) as pool:
        for r in range(args.reps):
            order = KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]
            for kind in order:
                rows[kind].append(pool.submit(one, kind, size).result())

    def med(kind: str, what: str) -> float:
        return statistics.median(m[what] for m in rows[kind])

    thp = read("/sys/kernel/mm/transparent_hugepage/enabled")
    reporting = read("/sys/module/page_reporting/parameters/page_reporting_order")
    print(
        f"{args.mib} MiB per mapping, median of {args.reps} processes per kind; THP: {thp}; "
        f"free page reporting order: {reporting}"
    )
    print(f"{'kind':<20}{'wall ms':>9}{'CPU ms':>9}{'faults':>9}{'GB/s':>7}   wall ms per process")
    for kind in KINDS:
        per = " ".join(f"{m['wall'] * 1e3:6.1f}" for m in rows[kind])
        wall = med(kind, "wall")
        print(
            f"{kind:<20}{wall * 1e3:>9.1f}{med(kind, 'cpu') * 1e3:>9.1f}"
            f"{med(kind, 'minflt'):>9.0f}{size / wall / 1e9:>7.2f}   {per}"
        )
    base = med("private", "wall")
    for kind in KINDS:
        if kind != "private":
            print(f"ratio {kind} / private (wall): {med(kind, 'wall') / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
