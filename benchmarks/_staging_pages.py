"""What huge pages change for the SSD tier's appends: an O_DIRECT write of 8 MiB from 4 KiB
pages against the same bytes on huge pages, and the first write into a new buffer of each
kind (see docs/explanation/api-performance.md, "Staging buffers on huge pages").

1. In this process, ``--reps`` writes each way, alternating, into new files under
   ``--dir``: once as the SSD writer writes a turn (a header page, then parts of 1, 2, 4
   and 1 MiB from a thread pool), once as one ``pwrite``; each followed by ``fsync``.
2. ``--processes`` fresh processes per kind, each copying 8 MiB into four new buffers one
   after another (what a new cache's first appends meet): milliseconds per buffer.

Linux only (``MADV_COLLAPSE``, ``MADV_HUGEPAGE``)::

    .venv/bin/python benchmarks/_staging_pages.py [--dir DIR] [--reps 30] [--processes 5]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tieredkv.backends._hugepages import MADV_COLLAPSE, huge_aligned

MB = 1 << 20
HUGE = 2 * MB
LENGTH = 8 * MB + 4096  # an 8 MiB turn and its header's page
CUTS = [0, 4096, 1 * MB, 3 * MB, 7 * MB, LENGTH]  # the writer's parts for such a turn


def small_pages(data: bytes) -> memoryview:
    """``data`` in a private mapping on 4 KiB pages (transparent huge pages ``madvise``)."""
    mm = mmap.mmap(-1, len(data), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm[:] = data
    return memoryview(mm)


def huge_pages(data: bytes) -> memoryview:
    """``data`` from a huge-page boundary, collapsed into huge pages."""
    mm, off = huge_aligned(len(data), HUGE)
    view = memoryview(mm)[off : off + len(data)]
    view[:] = data
    mm.madvise(MADV_COLLAPSE, off, len(data) - len(data) % HUGE)
    return view


def write(
    root: Path, i: int, buf: memoryview, parts: bool, pool: concurrent.futures.Executor
) -> float:
    """Seconds to write ``buf`` to a new O_DIRECT file and ``fsync`` it."""
    path = root / f"w{i}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        os.posix_fallocate(fd, 0, len(buf))
        began = time.perf_counter()
        if parts:
            done = [
                pool.submit(os.pwrite, fd, buf[lo:hi], lo)
                for lo, hi in itertools.pairwise(CUTS[1:])
            ]
            os.pwrite(fd, buf[: CUTS[1]], 0)
            for f in done:
                f.result()
        else:
            os.pwrite(fd, buf, 0)
        os.fsync(fd)
        return time.perf_counter() - began
    finally:
        os.close(fd)
        path.unlink()


def first_writes(kind: str) -> list[float]:
    """(In a fresh process) milliseconds to copy 8 MiB into each of four new buffers."""
    src = os.urandom(8 * MB)
    kept, out = [], []
    for _ in range(4):
        if kind == "4k":
            mm = mmap.mmap(-1, len(src), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            view = memoryview(mm)
        else:
            mm, off = huge_aligned(len(src), HUGE)
            mm.madvise(mmap.MADV_HUGEPAGE, off, len(src))
            view = memoryview(mm)[off : off + len(src)]
        began = time.perf_counter()
        view[:] = src
        out.append(1e3 * (time.perf_counter() - began))
        kept.append((mm, view))  # mapped until the end, as a cache's buffers stay
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=None, help="where to write (an SSD)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--processes", type=int, default=5)
    ap.add_argument("--first", choices=["4k", "huge"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.first:
        print(" ".join(f"{ms:.2f}" for ms in first_writes(args.first)))
        return 0
    data = os.urandom(LENGTH)
    bufs = {"4 KiB pages": small_pages(data), "huge pages": huge_pages(data)}
    with (
        tempfile.TemporaryDirectory(dir=args.dir) as tmp,
        concurrent.futures.ThreadPoolExecutor(8) as pool,
    ):
        for parts in (True, False):
            took: dict[str, list[float]] = {k: [] for k in bufs}
            for r in range(args.reps):
                for kind in sorted(bufs, reverse=bool(r % 2)):
                    took[kind].append(write(Path(tmp), r, bufs[kind], parts, pool))
            how = "in the writer's parts" if parts else "as one pwrite"
            for kind, secs in took.items():
                print(
                    f"8 MiB O_DIRECT write + fsync {how:<22} from {kind:<12}: median "
                    f"{1e3 * statistics.median(secs):.2f} ms ({args.reps} writes)"
                )
    for kind in ("4k", "huge"):
        for _ in range(args.processes):
            got = subprocess.run(
                [sys.executable, __file__, "--first", kind],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            print(f"first copy of 8 MiB into each of four new buffers, {kind:>4} pages: {got} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
