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

    .venv/bin/python benchmarks/bench_load_overlap.py [--reps 30] [--mib 8] [--turns 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

import bench_api as api
from _measure import cold
from tieredkv.backends.ssd import reader, stream

MODES = ("held", "overlapped", "raw")


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--mib", type=int, default=8, help="turn size")
    p.add_argument("--turns", type=int, default=16)
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--depth", type=int, default=8, help="raw reads in flight")
    p.add_argument("--dir", type=Path, default=None, help="a directory on the SSD")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        took = anyio.run(run, args, Path(d))
    nbytes = args.turns * args.mib << 20
    print(
        f"{args.turns} turns x {args.tensors} tensors = {args.mib} MiB turns, "
        f"{nbytes / 1e6:.0f} MB; {args.reps} reps, one process, order rotating"
    )
    print(f"{'':12} {'median ms':>10} {'GB/s':>6}")
    for mode in MODES:
        ms = statistics.median(took[mode]) * 1e3
        print(f"{mode:12} {ms:10.1f} {nbytes / ms / 1e6:6.2f}")

    def paired(a: str, b: str) -> tuple[float, int]:
        ratios = [x / y for x, y in zip(took[a], took[b], strict=True)]
        return statistics.median(ratios), sum(r > 1 for r in ratios)

    for a, b, what in (
        ("held", "overlapped", "held / overlapped, time"),
        ("raw", "overlapped", "overlapped load / raw, GB/s"),
        ("raw", "held", "held load / raw, GB/s"),
    ):
        r, wins = paired(a, b)
        print(f"{what:30} median of the reps' ratios {r:.3f} (above 1 in {wins} of {args.reps})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
