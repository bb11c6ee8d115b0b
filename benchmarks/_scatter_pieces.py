"""What a read pays for the pieces its bytes land in: O_DIRECT reads of ``--files`` files of
8 MiB into one huge-page mapping as big as all of them, each file's bytes cut into pieces of
one size that land at separate places (see docs/explanation/api-performance.md, "How much
of the gap a layer-major layout would close").

- ``contig 8M``: each file into 8 MiB of its own (the raw reader's case);
- ``2M pieces``, ``512K pieces``, ``128K pieces``: each file cut into pieces of that size,
  every piece at a place of its own (the mapping cut into pieces of that size, dealt out in a
  seeded random order);
- ``128K strided``: the load's own layout for 8 MiB turns of 64 tensors: file ``k``'s piece
  ``j`` lands at offset ``k * 128 KiB`` of output ``j`` (64 outputs, each one turn's piece per
  file, in a random order in the mapping).

A layer-major segment (every turn of one tensor back to back) would give a load of 16 turns
pieces of 2 MiB: one per output. Each rep makes the files cold (``fsync``, ``fadvise``, and
``drop_caches`` as root) before each mode and runs the modes in a rotating order, with
``--depth`` reads in flight from threads started before the clock; every read is checked.
Speeds are the median of the reps' own ratios to ``contig 8M``. Linux only::

    .venv/bin/python benchmarks/_scatter_pieces.py [--reps 12] [--dir DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

MB = 1 << 20
FILE = 8 * MB


def pieces(
    view: memoryview, files: int, size: int, *, strided: bool, rng: random.Random
) -> list[list[memoryview]]:
    """Per file, the views its bytes are read into, in file order."""
    per = FILE // size
    if strided:  # file k's piece j at offset k * size of output order[j]
        order = list(range(per))
        rng.shuffle(order)
        out = files * size
        return [
            [view[order[j] * out + k * size :][:size] for j in range(per)] for k in range(files)
        ]
    order = list(range(files * per))
    rng.shuffle(order)
    return [[view[order[k * per + j] * size :][:size] for j in range(per)] for k in range(files)]


def cold(paths: list[Path]) -> None:
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if os.geteuid() == 0:
        Path("/proc/sys/vm/drop_caches").write_text("3")
    time.sleep(0.2)


def read(job: tuple[Path, list[memoryview]]) -> None:
    path, bufs = job
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        got = os.preadv(fd, bufs, 0)
    finally:
        os.close(fd)
    if got != FILE:
        raise OSError(f"short read of {path}: {got} of {FILE} bytes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--depth", type=int, default=8, help="reads in flight")
    parser.add_argument(
        "--dir", type=Path, default=None, help="where the files go (default: a temporary folder)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        src = mmap.mmap(-1, FILE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        paths = []
        for k in range(args.files):
            src[:] = bytes(range(256)) * (FILE // 256)
            src[: FILE // 2] = bytes([k + 1]) * (FILE // 2)
            path = Path(tmp) / f"f{k}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT)
            try:
                os.pwrite(fd, src, 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            paths.append(path)
        want = [
            bytes([k + 1]) * (FILE // 2) + bytes(range(256)) * (FILE // 512)
            for k in range(args.files)
        ]
        dst = mmap.mmap(-1, args.files * FILE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        dst.madvise(mmap.MADV_HUGEPAGE)
        for off in range(0, len(dst), 4096):
            dst[off] = 0
        view = memoryview(dst)
        rng = random.Random(1)
        modes = {
            "contig 8M": pieces(view, args.files, 8 * MB, strided=False, rng=rng),
            "2M pieces": pieces(view, args.files, 2 * MB, strided=False, rng=rng),
            "512K pieces": pieces(view, args.files, 512 << 10, strided=False, rng=rng),
            "128K pieces": pieces(view, args.files, 128 << 10, strided=False, rng=rng),
            "128K strided": pieces(view, args.files, 128 << 10, strided=True, rng=rng),
        }
        names = list(modes)
        took: dict[str, list[float]] = {name: [] for name in names}
        with concurrent.futures.ThreadPoolExecutor(args.depth) as pool:
            list(pool.map(time.sleep, [0.0] * args.depth))
            for rep in range(args.reps):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    cold(paths)
                    start = time.perf_counter()
                    list(pool.map(read, zip(paths, modes[name], strict=True)))
                    took[name].append(time.perf_counter() - start)
                    for k, bufs in enumerate(modes[name]):
                        if b"".join(bytes(b) for b in bufs) != want[k]:
                            raise AssertionError(f"{name}: file {k} read back other bytes")
        base = took["contig 8M"]
        load = os.getloadavg()[0]
        print(
            f"{args.files} files of 8 MiB, {args.depth} reads in flight, {args.reps} reps;"
            f" load average {load:.2f}"
        )
        for name in names:
            speed = statistics.median(b / t for b, t in zip(base, took[name], strict=True))
            ms = statistics.median(took[name]) * 1e3
            gbps = args.files * FILE / statistics.median(took[name]) / 1e9
            print(
                f"{name:14s} {ms:6.1f} ms  {gbps:5.2f} GB/s"
                f"  speed / contig 8M (paired median) {speed:.3f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
