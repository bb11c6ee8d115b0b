"""An open cache's cold load beside raw O_DIRECT reads of the same bytes, in one process:
whether verifying a segment read whole holds the next reads back.

A segment streamed in one span is read and then hashed by the same reader thread. Before
4 December 2026 (evening) the stream counted that job as a read in flight until its hash
was done, so when the device returned a wave of eight reads at once, their eight hashes on
two cores held the next wave back (3-7 ms in ``preadv`` timelines of a 134 MB load). Now a
read's slot is free when the read returns (``tieredkv.backends.ssd.reader.VERIFYING``
jobs beyond the reads may be verifying meanwhile). Setting ``VERIFYING`` to 0 restores the
earlier behaviour exactly, so both run here in one process, on one open cache, alternating:

- ``held``: ``VERIFYING = 0`` (the earlier stream);
- ``overlapped``: the default;
- ``raw``: bench_api's raw reader (``--depth`` 8 MiB O_DIRECT reads in flight from threads
  started before the clock, into a preallocated buffer) on the same bytes, one file per
  turn.

Each rep runs the three in a rotating order; before each, its bytes are written afresh
(the cache: ``drop`` and 16 durable appends; raw: one ``pwrite`` + ``fsync`` per turn), so
every read meets the same freshly written state of the virtual disk, then made cold
(``fsync``, ``fadvise``, ``drop_caches`` as root). One process and one cache keep out what
``bench_api.py``'s process per system per round lets in: each child's start and the
device's drift between children, which moved its load / raw ratio between 0.64 and 1.19
with the code unchanged. Every load is checked byte for byte.

With ``--same-files`` nothing is written between reps: the cache's history is appended
once, and each rep makes its files cold and reads them six ways, in a rotating order:

- ``overlapped``: the cache's load, as above;
- ``unverified``: the same load with the segments' checksums not computed (the hash and
  its check made no-ops, for this measurement only; every load is still compared byte for
  byte);
- ``into places``: ``load_into`` the outputs of one earlier load, kept (the memory ``raw
  places`` reads into);
- ``raw``: the raw reader on the cache's own segment files, one ``preadv`` of each whole
  file into a preallocated aligned buffer, ``--depth`` in flight, in the order the cache
  appended them (each read compared with the file's bytes);
- ``raw pieces``: the same reads into the same contiguous buffers, each cut into as many
  views as ``raw places`` reads into (one per tensor and one per gap, of the same lengths,
  back to back): how many views a read takes, apart from where they are;
- ``raw places``: the raw reader on the same files, each with one ``preadv`` into the very
  destinations the cache's load gives it: every tensor's bytes at their place in the
  load's 64 outputs (a turn's 8 MiB scattered over 64 tensors of its history), the bytes
  between them (the header, padding) into a scratch buffer. The destinations are taken
  from one load whose outputs are kept (its ``preadv`` calls recorded); every read is
  compared byte for byte. This is the device's time for the load's own memory layout,
  without the cache's work.

It also prints how scattered the physical pages under the load's outputs, the kept
outputs and the raw reader's buffers are (contiguous runs per 2 MiB, from
``/proc/self/pagemap``; root only): on this VM a read into scattered pages is split into
more requests (the virtual disk takes at most 254 segments a request), and the load's
time followed that count.

Every read then meets the same blocks of the virtual disk, so what is left between the
load and raw is the cache's own work: planning and outputs, verification, handing each
segment over. (Raw reads of files written at different times differ by more than that
on this VM: the host serves recently written data from its own cache.)

    .venv/bin/python benchmarks/bench_load_overlap.py [--reps 30] [--mib 8] [--turns 16]
    .venv/bin/python benchmarks/bench_load_overlap.py --same-files [--reps 30]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import math
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np
import torch

import bench_api as api
from _measure import cold
from tieredkv import TieredKVCache
from tieredkv.backends._buffers import address
from tieredkv.backends.ssd import reader, stream
from tieredkv.backends.ssd.layout import preadv_full

MODES = ("held", "overlapped", "raw")
SAME_FILES_MODES = ("overlapped", "unverified", "into places", "raw", "raw pieces", "raw places")


async def run(args: argparse.Namespace, root: Path) -> dict[str, list[float]]:
    turns = api.make_turns(args.turns, args.tensors, args.mib)
    want = api.history(turns)
    blobs = api.turn_blobs(turns)
    bufs = api.raw_outputs(blobs)
    default = reader.VERIFYING
    took: dict[str, list[float]] = {m: [] for m in MODES}
    (root / "cache").mkdir()
    (root / "raw").mkdir()
    with api.raw_readers(args.depth) as pool:
        async with api.new_cache(root / "cache") as cache:
            await api.append_turns(cache, "user", turns)
            await cache.load("user")  # its buffers and outputs exist, as in bench_api
            for rep in range(args.reps):
                k = rep % len(MODES)
                for mode in MODES[k:] + MODES[:k]:
                    if mode == "raw":
                        api.raw_write(root / "raw", blobs)
                        cold(root / "raw", True)
                        t0 = time.perf_counter()
                        api.raw_read(root / "raw", bufs, pool)
                        took[mode].append(time.perf_counter() - t0)
                        if not api.raw_read_back(blobs, bufs):
                            raise AssertionError("raw read back other bytes")
                        continue
                    setattr(stream, "VERIFYING", 0 if mode == "held" else default)  # noqa: B010
                    try:
                        await cache.drop("user")
                        await api.append_turns(cache, "user", turns)
                        cold(root / "cache", True)
                        t0 = time.perf_counter()
                        got = await cache.load("user")
                        took[mode].append(time.perf_counter() - t0)
                    finally:
                        setattr(stream, "VERIFYING", default)  # noqa: B010
                    if not api.same(got, want):
                        raise AssertionError("the cache loaded other bytes")
                    del got
    return took


def raw_read_files(
    files: list[Path], bufs: list[memoryview], pool: concurrent.futures.ThreadPoolExecutor
) -> None:
    """Each whole file into its buffer with one O_DIRECT ``preadv`` (:func:`read_into`), as
    many in flight as ``pool`` has threads."""
    views = [memoryview(buf) for buf in bufs]
    try:
        list(pool.map(read_into, zip(files, [[v] for v in views], strict=True)))
    finally:
        for v in views:
            v.release()


def segment_files(root: Path, turns: int) -> tuple[list[Path], list[bytes]]:
    """The cache's segment files (their real paths) in the order they were written (the
    order a load reads them), and their bytes."""
    files = sorted(
        (f.resolve() for f in root.glob("segments/*/*")), key=lambda f: f.stat().st_mtime_ns
    )
    if len(files) != turns:
        raise AssertionError(f"{len(files)} segment files for {turns} turns")
    return files, [f.read_bytes() for f in files]


def read_into(job: tuple[Path, list[memoryview]]) -> None:
    """One O_DIRECT ``preadv`` of a whole file into ``pieces``."""
    path, pieces = job
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        if os.preadv(fd, pieces, 0) != sum(len(v) for v in pieces):
            raise AssertionError(f"{path.name}: short read")
    finally:
        os.close(fd)


async def load_places(
    cache: TieredKVCache, files: list[Path]
) -> tuple[dict[str, torch.Tensor], list[list[memoryview]]]:
    """One load of ``user``, kept, and the destinations its ``preadv`` of each of ``files``
    read into (views of its outputs; the pieces in the cache's own scratch memory replaced
    by views of new buffers of the same size, so the cache's buffers are not held)."""
    recorded: dict[str, list[memoryview]] = {}
    real = preadv_full

    def record(fd: int, views: list[memoryview], offset: int) -> int:
        if offset != 0:
            raise AssertionError("a segment not read whole in one call")
        recorded[os.path.realpath(f"/proc/self/fd/{fd}")] = list(views)
        return real(fd, views, offset)

    setattr(stream, "preadv_full", record)  # noqa: B010
    try:
        places = await cache.load("user")
    finally:
        setattr(stream, "preadv_full", real)  # noqa: B010
    outputs = regions(places)
    pieces: list[list[memoryview]] = []
    landed = 0
    for f in files:
        views = []
        for v in recorded.pop(str(f)):
            if address_in(v, outputs):
                views.append(v)
                landed += len(v)
            else:
                views.append(memoryview(api.aligned_buffer(len(v)))[: len(v)])
                v.release()
        pieces.append(views)
    if landed != sum(n for _, n in outputs):
        raise SystemExit(
            "--same-files: the load did not read straight into its outputs (outputs under "
            "1 MiB come from torch.empty, not aligned for O_DIRECT); use larger turns"
        )
    return places, pieces


def adjacent(buf: memoryview, views: list[memoryview]) -> list[memoryview]:
    """``buf`` cut into views of the lengths of ``views``, back to back from its start."""
    out, at = [], 0
    for v in views:
        out.append(buf[at : at + len(v)])
        at += len(v)
    return out


def address_in(view: memoryview, regions: list[tuple[int, int]]) -> bool:
    """Whether ``view`` lies within one of ``regions`` (address, bytes)."""
    at = address(view)
    return any(lo <= at and at + len(view) <= lo + n for lo, n in regions)


async def run_same_files(args: argparse.Namespace, root: Path) -> dict[str, list[float]]:
    """``--same-files``: the cache's files, written once, read six ways (see the doc)."""
    turns = api.make_turns(args.turns, args.tensors, args.mib)
    want = api.history(turns)
    took: dict[str, list[float]] = {
        m: [] for m in (*SAME_FILES_MODES, RUNS_LOAD, RUNS_PLACES, RUNS_RAW)
    }
    hash_here, check = stream._SegmentRead.hash_here, stream._SegmentRead.check
    with api.raw_readers(args.depth) as pool:
        async with api.new_cache(root) as cache:
            await api.append_turns(cache, "user", turns)
            await cache.load("user")  # its buffers and outputs exist, as in bench_api
            files, expect = segment_files(root, args.turns)
            # prefaulted and on huge pages where the kernel can, as the cache's reused
            # outputs are once it has collapsed them
            bufs = [api.huge_buffer(len(b)) for b in expect]
            places, pieces = await load_places(cache, files)
            places_want = {k: v.clone() for k, v in places.items()}
            cut = [adjacent(buf, views) for buf, views in zip(bufs, pieces, strict=True)]
            for rep in range(args.reps):
                k = rep % len(SAME_FILES_MODES)
                for mode in SAME_FILES_MODES[k:] + SAME_FILES_MODES[:k]:
                    cold(root, True)
                    if mode in ("raw places", "into places"):
                        raw = mode == "raw places"
                        t0, t1 = await read_places(
                            cache, places, places_want, files, pieces, pool, raw
                        )
                        took[mode].append(t1 - t0)
                        continue
                    if mode in ("raw", "raw pieces"):
                        for b in bufs:  # (so a read that lands nothing fails the check)
                            ctypes.memset(address(b), 0, len(b))
                        t0 = time.perf_counter()
                        if mode == "raw":
                            raw_read_files(files, bufs, pool)
                        else:
                            list(pool.map(read_into, zip(files, cut, strict=True)))
                        took[mode].append(time.perf_counter() - t0)
                        if any(b[: len(e)] != e for b, e in zip(bufs, expect, strict=True)):
                            raise AssertionError("raw read back other bytes")
                        continue
                    if mode == "unverified":
                        stream._SegmentRead.hash_here = lambda *a: None  # type: ignore[method-assign]
                        stream._SegmentRead.check = lambda *a: None  # type: ignore[method-assign]
                    try:
                        t0 = time.perf_counter()
                        got = await cache.load("user")
                        took[mode].append(time.perf_counter() - t0)
                    finally:
                        stream._SegmentRead.hash_here = hash_here  # type: ignore[method-assign]
                        stream._SegmentRead.check = check  # type: ignore[method-assign]
                    if not api.same(got, want):
                        raise AssertionError("the cache loaded other bytes")
                    if mode == "overlapped":
                        took[RUNS_LOAD].append(physical_runs(regions(got)))
                    del got
            took[RUNS_PLACES].append(physical_runs(regions(places)))
            took[RUNS_RAW].append(physical_runs([(address(memoryview(b)), len(b)) for b in bufs]))
    return took


async def read_places(
    cache: TieredKVCache,
    places: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    files: list[Path],
    pieces: list[list[memoryview]],
    pool: concurrent.futures.ThreadPoolExecutor,
    raw: bool,
) -> tuple[float, float]:
    """Zero a load's kept outputs (:func:`load_places`), then fill them again: with ``raw``,
    one O_DIRECT ``preadv`` of each of ``files`` into its ``pieces`` (``pool``'s threads),
    else the cache's ``load_into``; when it began and ended (``time.perf_counter``).

    :raises AssertionError: the outputs then hold other bytes than ``want``
    """
    for t in places.values():
        t.zero_()
    t0 = time.perf_counter()
    if raw:
        list(pool.map(read_into, zip(files, pieces, strict=True)))
    else:
        await cache.load_into("user", places)
    t1 = time.perf_counter()
    if not api.same(places, want):
        mode = "raw places" if raw else "into places"
        raise AssertionError(f"{mode}: other bytes in the kept outputs")
    return t0, t1


RUNS_LOAD = "runs: load's outputs"
RUNS_PLACES = "runs: the kept outputs"
RUNS_RAW = "runs: raw's buffers"


def regions(tensors: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """Each tensor's memory, as (address, bytes)."""
    return [(t.data_ptr(), t.nbytes) for t in tensors.values()]


def physical_runs(regions: list[tuple[int, int]]) -> float:
    """How scattered the physical pages under ``regions`` (address, bytes) are: physically
    contiguous runs per 2 MiB, on average (1: contiguous; 512: no two pages adjacent),
    from ``/proc/self/pagemap``; ``nan`` where it shows no page frames (not root)."""
    page = mmap.PAGESIZE
    counts = []
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        for at, nbytes in regions:
            first, n = at // page, -(-nbytes // page)
            entries = np.frombuffer(os.pread(fd, 8 * n, 8 * first), dtype=np.uint64)
            frames = (entries & np.uint64((1 << 55) - 1)).astype(np.int64)
            if not frames.any():
                return math.nan
            runs = 1 + int(np.count_nonzero(np.diff(frames) != 1))
            counts.append(runs * (2 << 20) / (n * page))
    finally:
        os.close(fd)
    return statistics.mean(counts)


def parser(doc: str, reps: int) -> argparse.ArgumentParser:
    """The options of a history's shape, the raw reads in flight and the directory (this
    benchmark's, ``_load_timeline.py``'s and ``_stream_ab.py``'s, which reads no raw files)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--mib", type=int, default=8, help="turn size")
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--depth", type=int, default=8, help="raw reads in flight")
    p.add_argument("--dir", type=Path, default=None, help="a directory on the SSD")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, reps=30)
    p.add_argument(
        "--same-files",
        action="store_true",
        help="read the cache's files, written once, six ways (see the doc)",
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        took = anyio.run(run_same_files if args.same_files else run, args, Path(d))
    nbytes = args.turns * args.mib << 20
    modes = SAME_FILES_MODES if args.same_files else MODES
    print(
        f"{args.turns} turns x {args.tensors} tensors = {args.mib} MiB turns, "
        f"{nbytes / 1e6:.0f} MB; {args.reps} reps, one process, order rotating"
        + ("; the cache's own files, written once" if args.same_files else "")
    )
    print(f"{'':12} {'median ms':>10} {'GB/s':>6}")
    for mode in modes:
        ms = statistics.median(took[mode]) * 1e3
        print(f"{mode:12} {ms:10.1f} {nbytes / ms / 1e6:6.2f}")
    for key in (RUNS_LOAD, RUNS_PLACES, RUNS_RAW) if args.same_files else ():
        runs = statistics.median(took[key])
        shown = "n/a (page frames are shown to root only)" if math.isnan(runs) else f"{runs:.0f}"
        print(f"physically contiguous {key[6:]}, runs per 2 MiB (median): {shown}")

    def paired(a: str, b: str) -> tuple[float, int]:
        ratios = [x / y for x, y in zip(took[a], took[b], strict=True)]
        return statistics.median(ratios), sum(r > 1 for r in ratios)

    pairs = (
        (
            ("raw", "overlapped", "load / raw, GB/s"),
            ("raw", "unverified", "unverified load / raw, GB/s"),
            ("unverified", "overlapped", "load / unverified, GB/s"),
            ("raw", "raw pieces", "raw pieces / raw, GB/s"),
            ("raw pieces", "raw places", "raw places / raw pieces, GB/s"),
            ("raw", "raw places", "raw places / raw, GB/s"),
            ("raw places", "into places", "into places / raw places, GB/s"),
            ("into places", "overlapped", "load / into places, GB/s"),
        )
        if args.same_files
        else (
            ("held", "overlapped", "held / overlapped, time"),
            ("raw", "overlapped", "overlapped load / raw, GB/s"),
            ("raw", "held", "held load / raw, GB/s"),
        )
    )
    for a, b, what in pairs:
        r, wins = paired(a, b)
        print(f"{what:30} median of the reps' ratios {r:.3f} (above 1 in {wins} of {args.reps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
