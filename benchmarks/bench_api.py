"""What users call, against what they would use instead: durable appends and cold loads of
a conversation's KV, each system in a process of its own.

One conversation of N turns, each ``--tensors`` named fp16 tensors (``[tokens, 1024]``),
at each turn size of ``--sizes`` (``MIB:TURNS`` pairs; default 16 turns of 8 MiB, a small
model's turn, and 8 turns of 64 MiB, a Llama-3-8B-shaped turn of 32 layers x K and V).
Every system runs in a child process of its own, started fresh for each system in each
round (forked from a server process that has imported torch, safetensors and tieredkv and
holds nothing else); the order of the systems rotates from round to round.
Before every timed read the child makes its own files cold: ``fsync`` +
``posix_fadvise(DONTNEED)`` on each, and ``drop_caches`` as well where permitted (root;
the header line says which ran). Every read is checked byte for byte against what was
written (a mismatch exits 1).

- ``tieredkv`` (an open cache): a child opens ``TieredKVCache([SSDTier(dir)])``, makes one
  untimed append, load and ``load_into`` of the same shapes (its staging and span buffers
  exist; the load's outputs, dropped, are memory the next load reuses), then times
  ``append`` of every turn (durable when each returns), ``load`` and ``load_into``
  (preallocated, prefaulted). Between its append and its load the device settles
  (:func:`settle`) as it does between every other system's write and read, which run in
  two children with a settle before each. Without it the load began right after the
  append's last ``fsync``, and measured lower: the open cache's load / raw O_DIRECT,
  paired, was 0.69-0.86 (median 0.75) in five runs, and 0.81-0.94 (median 0.87) in five
  that settle, four pairs of them alternating (``docs/explanation/api-performance.md``);
- ``new cache``: a child per call, timing the cache's ``open``, the call and ``aclose``
  inside a running event loop: what a restarted server meets (every buffer and output is
  new memory). Timing ``anyio.run`` as well, as an earlier version did, added the import
  of anyio's backend and, with it, a full garbage collection of the torch-sized heap
  (84 ms of a 377 ms load of 134 MB): costs of a process's first event loop, not of a
  cache;
- ``raw O_DIRECT``: the same bytes, one file per turn, prepared in aligned buffers before
  the clock (on huge pages where the kernel can, as the cache's staging buffers are:
  :func:`raw_sources`), one ``pwrite`` + ``fsync`` each; read with ``--depth`` 8 MiB reads in flight
  into a preallocated buffer: the device's ceiling (tieredkv must also serialize, checksum
  and copy);
- ``safetensors``: ``save_file`` + ``fsync`` per turn; ``load_file`` per turn + ``torch.cat``
  (``safetensors 1 thread``: the same with ``torch.set_num_threads(1)``).
  ``safetensors alone`` is the same child run first and last in the run, with nothing
  around it: its stand-alone figure, printed beside the in-round one.

Each figure is the median of ``--rounds`` (every round's figure is printed too), with the
child's CPU seconds per GB (user + system of every thread, ``getrusage(RUSAGE_SELF)``) and
minor page faults per GB beside the GB/s: CPU time is what the model shares on a 2-core
host, and it hardly moves with a busy disk. Each ratio is printed twice: the ratio of the
medians, and the median of the rounds' own ratios (``paired``: each system against the
other in the same round), which the verdict uses. The device's speed drifts between runs
minutes apart (raw O_DIRECT reads of the same files: 1.75 GB/s in one run, 2.35 in the next)
more than within a round; pairing by round keeps that drift out of the ratio. Targets:
load >= 1.5x safetensors for an open cache, >= 1.2x for a new one; the same for append;
load >= 0.9x, append >= 0.8x raw; at most 0.25 CPU-s per GB for load and append.

Why the peer ran 2-3x slower inside the previous version of this benchmark (every system
in one process) than alone: measured with ``benchmarks/_peer_slowdown.py`` (the same
``st_write``/``st_read``, a fresh process per condition, the old benchmark's process
rebuilt one part at a time), the old process's 4x-the-history buffers changed nothing
(read 0.16 GB/s alone and with them), its open cache's threads a little (0.14), both
together 0.11 GB/s (1.45x slower than alone; one run of 4 turns of 64 MiB, 2 reps, load
average 5-9); but the same process with
``torch.set_num_threads(1)`` read at 0.46 GB/s and 0.95 CPU-s/GB, against 3.3-5.0 CPU-s/GB
with torch's default two threads. ``load_file`` + ``torch.cat`` is dominated by torch's
OpenMP threads, which spin-wait for each other and, on 2 cores that other processes also
use, wait for one that is not running: the peer's speed follows the machine's CPU load
more than anything the benchmark does, which is why it ran at different speeds minutes
apart. So the peer is run both ways here (``safetensors`` with torch's default threads,
``safetensors 1 thread``), and the ratios take the faster of the two (``best``).

Needs the ``bench`` extra (``safetensors``)::

    .venv/bin/python benchmarks/bench_api.py [--dir DIR] [--sizes 8:16,64:8] [--tensors 64]
        [--rounds 5] [--depth 8] [--settle 0.3] [--quick]

``--settle`` is the pause after ``os.sync`` before each child and between the open cache's
append and its load (:func:`settle`). On 7 December 2026 a longer one changed nothing:
two runs each way alternating, the open cache's load / raw O_DIRECT (paired) was 0.83 and
0.76 with 0.3 s, 0.76 and 0.83 with 1.5 s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import mmap
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import torch

from _measure import Took, cold, measured
from tieredkv import SSDTier, TieredKVCache
from tieredkv.backends._hugepages import MADV_COLLAPSE, huge_aligned, huge_page_size
from tieredkv.backends.ssd.reader import READ_DEPTH

MB = 1 << 20
ALIGN = 4096
WIDTH = 1024  # fp16 elements per token per tensor: 2 KiB per token
Turn = dict[str, torch.Tensor]

SYSTEMS = ("tieredkv", "new cache", "raw", "safetensors", "safetensors 1 thread")
"""The systems of a round, in the order round 0 runs them."""


def make_turns(turns: int, tensors: int, turn_mib: int) -> list[Turn]:
    """Deterministic fp16 turns of ``turn_mib`` MiB, ``[tokens, 1024]`` per tensor."""
    tokens = turn_mib * MB // tensors // (2 * WIDTH)
    if tokens < 1:
        raise ValueError(f"a {turn_mib} MiB turn cannot hold {tensors} tensors of a token")
    g = torch.Generator().manual_seed(0)
    return [
        {
            f"layer{i // 2}.{'kv'[i % 2]}": torch.randn(tokens, WIDTH, generator=g).half()
            for i in range(tensors)
        }
        for _ in range(turns)
    ]


def history(turns: list[Turn]) -> Turn:
    return {k: torch.cat([t[k] for t in turns]) for k in turns[0]}


def same(got: Turn, want: Turn) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


def fsync_path(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- tieredkv ---------------------------------------------------------------------------
def new_cache(root: Path) -> TieredKVCache:
    return TieredKVCache([SSDTier(root, 64 << 30)])


async def append_turns(cache: TieredKVCache, session: str, turns: list[Turn]) -> None:
    """Each turn appended in order (durable as each append returns)."""
    for i, t in enumerate(turns):
        await cache.append(session, t, answer_tokens=i)


async def fresh_append(root: Path, turns: list[Turn]) -> Took:
    """Open a cache, append every turn, close it; timed inside a running event loop (a
    server's loop runs before its cache opens)."""
    with measured() as took:
        async with new_cache(root) as cache:
            await append_turns(cache, "user", turns)
    return took


async def fresh_load(root: Path) -> tuple[Took, Turn]:
    with measured() as took:
        async with new_cache(root) as cache:
            got = await cache.load("user")
    return took, got


async def fresh_load_into(root: Path, out: Turn) -> Took:
    with measured() as took:
        async with new_cache(root) as cache:
            await cache.load_into("user", out)
    return took


async def outputs_settled(cache: TieredKVCache, quiet: float = 0.2, most: float = 10.0) -> int:
    """Wait until the cache's background collapse of dropped outputs into huge pages
    (``output_huge_pages``) has stopped for ``quiet`` seconds (at most ``most``), as it has
    in a server that has been loading for a while; the huge pages made so far."""
    seen, since = -1, time.monotonic()
    deadline = since + most
    while time.monotonic() < deadline:
        stats = cache.stats()
        now = stats.outputs_collapsed + stats.output_collapse_failures
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
        await anyio.sleep(0.01)
    return cache.stats().outputs_collapsed


async def open_cache_child(
    root: Path, turns: list[Turn], drop: bool, pause: float
) -> dict[str, Any]:
    """An open cache's append, load and load_into (after one untimed append and load)."""
    want = history(turns)
    out = {k: torch.zeros_like(v) for k, v in want.items()}  # prefaulted
    res: dict[str, Any] = {}
    async with new_cache(root) as cache:
        await append_turns(cache, "warm-up", turns)
        await cache.load("warm-up")  # dropped: its memory is kept for the next load
        await cache.load_into("warm-up", out)  # its span buffers (a load lands in place)
        await cache.drop("warm-up")
        res["collapsed"] = await outputs_settled(cache)
        with measured() as res["append"]:
            await append_turns(cache, "user", turns)
        settle(pause)  # (as every other system's read follows its write: see ``settle``)
        res["cold"] = cold(root, drop)
        with measured() as res["load"]:
            got = await cache.load("user")
        res["ok"] = same(got, want)
        del got
        cold(root, drop)
        with measured() as res["load_into"]:
            await cache.load_into("user", out)
        res["ok"] = res["ok"] and same(out, want)
    return res


# -- raw O_DIRECT -------------------------------------------------------------------------
def aligned_buffer(n: int) -> mmap.mmap:
    return mmap.mmap(-1, -(-n // ALIGN) * ALIGN)


def turn_blobs(turns: list[Turn]) -> list[mmap.mmap]:
    """Each turn's bytes in a page-aligned buffer (O_DIRECT needs one), made before timing."""
    out = []
    for turn in turns:
        blob = b"".join(t.numpy().tobytes() for t in turn.values())
        buf = aligned_buffer(len(blob))
        buf[: len(blob)] = blob
        out.append(buf)
    return out


def huge_buffer(n: int) -> memoryview:
    """``n`` prefaulted bytes (rounded up to 4 KiB) from a huge-page boundary of a private
    mapping, collapsed into transparent huge pages where the kernel can
    (``madvise(MADV_COLLAPSE)``): physically contiguous memory, as an open cache's reused
    outputs are once it has collapsed them (:mod:`tieredkv._cache.outputs`). On this
    project's VM a read into 4 KiB pages faulted in one by one is cut into more device
    requests (a request carries at most 254 physically contiguous segments), so a raw
    reader on such pages would measure the memory, not the device. Elsewhere:
    page-aligned, prefaulted 4 KiB pages."""
    n = -(-n // ALIGN) * ALIGN
    huge = huge_page_size()
    mm, off = huge_aligned(n, huge)
    view = memoryview(mm)[off : off + n]
    view[:] = bytes(n)
    if huge and n >= huge:
        with contextlib.suppress(OSError):  # no MADV_COLLAPSE here: 4 KiB pages
            mm.madvise(MADV_COLLAPSE, off, n - n % huge)
    return view


def raw_sources(blobs: list[mmap.mmap]) -> list[memoryview]:
    """The raw writer's copy of ``blobs``: prefaulted and on huge pages where the kernel
    can (:func:`huge_buffer`), as an open cache's staging buffers are
    (``TieredKVCache(staging_huge_pages=True)``). An O_DIRECT write from 4 KiB pages is cut
    into more device requests (8 MiB: 5.60 against 3.99 ms on this project's VM), so a raw
    writer on such pages would measure the memory, not the device."""
    out = raw_outputs(blobs)
    for view, blob in zip(out, blobs, strict=True):
        view[: len(blob)] = blob
    return out


def raw_outputs(blobs: list[mmap.mmap]) -> list[memoryview]:
    """Buffers the raw reader reads ``blobs``' files into: prefaulted (as ``load_into``'s
    outputs are) and on huge pages where the kernel can (as an open cache's reused
    outputs are: :func:`huge_buffer`)."""
    return [huge_buffer(len(b)) for b in blobs]


def raw_read_back(blobs: list[mmap.mmap], bufs: list[memoryview]) -> bool:
    """Whether the raw reader read back exactly the bytes written."""
    return all(b[:] == g[:] for b, g in zip(blobs, bufs, strict=True))


def raw_write(root: Path, bufs: Sequence[mmap.mmap | memoryview]) -> None:
    """Each turn's prepared aligned bytes written with one O_DIRECT ``pwrite`` and
    ``fsync``-ed (no serialization, no copy: a ceiling, not a competitor)."""
    for i, buf in enumerate(bufs):
        path = root / f"turn{i}.raw"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.pwrite(fd, buf, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_path(root, os.O_RDONLY | os.O_DIRECTORY)


def raw_readers(depth: int) -> concurrent.futures.ThreadPoolExecutor:
    """``depth`` reader threads, started before the clock (as an open cache's readers are)."""
    pool = concurrent.futures.ThreadPoolExecutor(depth)
    for f in [pool.submit(time.sleep, 0.01) for _ in range(depth)]:
        f.result()
    return pool


def raw_read(
    root: Path, bufs: list[memoryview], pool: concurrent.futures.ThreadPoolExecutor
) -> None:
    """Read every turn file into ``bufs`` with 8 MiB reads, as many in flight as ``pool``
    has threads."""
    jobs = [
        (root / f"turn{i}.raw", buf, off, min(8 * MB, len(buf) - off))
        for i, buf in enumerate(bufs)
        for off in range(0, len(buf), 8 * MB)
    ]

    def read(job: tuple[Path, memoryview, int, int]) -> None:
        path, buf, off, n = job
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            with memoryview(buf) as whole, whole[off : off + n] as view:
                os.preadv(fd, [view], off)
        finally:
            os.close(fd)

    list(pool.map(read, jobs))


# -- safetensors ------------------------------------------------------------------------
def st_write(root: Path, turns: list[Turn]) -> None:
    from safetensors.torch import save_file

    for i, t in enumerate(turns):
        path = root / f"turn{i}.safetensors"
        save_file(t, str(path))
        fsync_path(path)
    fsync_path(root, os.O_RDONLY | os.O_DIRECTORY)


def st_read(root: Path, turns: int) -> Turn:
    from safetensors.torch import load_file

    parts = [load_file(str(root / f"turn{i}.safetensors")) for i in range(turns)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


# -- one child ------------------------------------------------------------------------------
def child(
    system: str, op: str, root: Path, turns: list[Turn], depth: int, drop: bool, pause: float
) -> Any:
    """Run one system's ``op`` (``write``, ``read``; the open cache: ``both``, which settles
    ``pause`` seconds between its append and its load) in this process; return what it
    measured, as JSON-able values."""
    res: dict[str, Any] = {}
    if system == "safetensors 1 thread":
        torch.set_num_threads(1)  # torch.cat on one thread: no OpenMP threads to wait for
    if system == "tieredkv":
        res = anyio.run(open_cache_child, root, turns, drop, pause)
    elif op == "write":
        if system == "raw":
            bufs = raw_sources(turn_blobs(turns))
            with measured() as res["append"]:
                raw_write(root, bufs)
        elif system == "new cache":
            res["append"] = anyio.run(fresh_append, root, turns)
        else:
            with measured() as res["append"]:
                st_write(root, turns)
        res["ok"] = True
    else:
        want = history(turns)
        res["cold"] = cold(root, drop)
        if system == "raw":
            blobs = turn_blobs(turns)
            outs = raw_outputs(blobs)
            with raw_readers(depth) as pool, measured() as res["load"]:
                raw_read(root, outs, pool)
            res["ok"] = raw_read_back(blobs, outs)
        elif system == "new cache" and op == "read_into":
            out = {k: torch.zeros_like(v) for k, v in want.items()}
            res["load_into"] = anyio.run(fresh_load_into, root, out)
            res["ok"] = same(out, want)
        elif system == "new cache":
            res["load"], got = anyio.run(fresh_load, root)
            res["ok"] = same(got, want)
        else:
            with measured() as res["load"]:
                got = st_read(root, len(turns))
            res["ok"] = same(got, want)
    return {k: v.as_dict() if isinstance(v, Took) else v for k, v in res.items()}


def child_main(system: str, op: str, root: Path, size: tuple[int, int], opts: Any) -> Any:
    """A child process's work: make the turns (untimed), then :func:`child`."""
    mib, n = size
    turns = make_turns(n, opts.tensors, mib)
    return child(system, op, root, turns, opts.depth, opts.drop, opts.settle)


def run_child(args: argparse.Namespace, system: str, op: str, root: Path, mib: int, n: int) -> Any:
    """``system``'s ``op`` in a new process, forked from a server that has imported torch,
    safetensors and tieredkv and nothing else (none of this process's memory or threads)."""
    settle(args.settle)
    opts = argparse.Namespace(
        tensors=args.tensors, depth=args.depth, drop=args.drop, settle=args.settle
    )
    return args.pool.submit(child_main, system, op, root, (mib, n), opts).result()


def process_per_task() -> concurrent.futures.ProcessPoolExecutor:
    """An executor that runs each task in a process of its own."""
    ctx = multiprocessing.get_context("forkserver")
    # anyio's asyncio backend too: anyio.run imports it, which is no cost of the cache's
    ctx.set_forkserver_preload(
        ["torch", "safetensors.torch", "tieredkv", "anyio._backends._asyncio"]
    )
    return concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx, max_tasks_per_child=1)


def settle(pause: float) -> None:
    """Let the device finish what came before (writeback, and the discards of deleted files
    on a ``discard``-mounted file system) so it does not slow the next system measured."""
    os.sync()
    time.sleep(pause)


def system_steps(system: str) -> list[str]:
    if system == "tieredkv":
        return ["both"]
    if system == "new cache":
        return ["write", "read", "read_into"]
    return ["write", "read"]


# -- the parent -----------------------------------------------------------------------------
def parse_sizes(text: str) -> list[tuple[int, int]]:
    sizes = []
    for part in text.split(","):
        mib, _, turns = part.partition(":")
        try:
            pair = int(mib), int(turns)
        except ValueError:
            raise ValueError(
                f"--sizes wants MIB:TURNS pairs like 8:16,64:8, not {part!r}"
            ) from None
        if min(pair) < 1:
            raise ValueError(f"--sizes: {part!r} needs at least 1 MiB and 1 turn")
        sizes.append(pair)
    return sizes


Row = dict[str, list[dict[str, float]]]
"""Per figure (``tieredkv append``, ...), each round's measurement."""


def bench_size(args: argparse.Namespace, base: Path, mib: int, n: int) -> Row:
    rows: Row = {}

    def record(system: str, got: Any) -> None:
        if not got.get("ok"):
            raise AssertionError(f"{system} read back other bytes than were written")
        for op in ("append", "load", "load_into"):
            if op in got:
                rows.setdefault(f"{system} {op}", []).append(got[op])
        if "cold" in got:
            args.cold_ran.add(got["cold"])
        if "collapsed" in got:
            args.collapsed.append(got["collapsed"])

    def alone() -> None:
        d = Path(tempfile.mkdtemp(prefix="alone-", dir=base))
        for op in ("write", "read"):
            record("safetensors alone", run_child(args, "safetensors", op, d, mib, n))
        shutil.rmtree(d)

    alone()
    for r in range(args.rounds):
        order = SYSTEMS[r % len(SYSTEMS) :] + SYSTEMS[: r % len(SYSTEMS)]
        for system in order:
            d = Path(tempfile.mkdtemp(prefix=f"{system.replace(' ', '-')}-", dir=base))
            for op in system_steps(system):
                record(system, run_child(args, system, op, d, mib, n))
            shutil.rmtree(d)
    if not args.quick:
        alone()
    return rows


def report(rows: Row, nbytes: int, args: argparse.Namespace) -> None:
    gb = nbytes / 1e9

    def med(name: str, what: str) -> float:
        return statistics.median(m[what] for m in rows[name])

    def gbps(name: str) -> float:
        return gb / med(name, "wall")

    print(f"{'':<26}{'GB/s':>7}{'CPU-s/GB':>10}{'faults/GB':>11}   GB/s per round")
    for name, ms in rows.items():
        per = " ".join(f"{gb / m['wall']:5.2f}" for m in ms)
        cpu, faults = med(name, "cpu") / gb, med(name, "minflt") / gb
        print(f"{name:<26}{gbps(name):>7.2f}{cpu:>10.3f}{faults:>11.0f}   {per}")

    def paired(name: str, *others: str) -> float:
        """The median over rounds of ``name``'s speed over the fastest of ``others`` in the
        same round: a round runs its systems within a minute or two, and the device's speed
        drifts more between rounds than within one."""
        return statistics.median(
            min(rows[o][r]["wall"] for o in others) / rows[name][r]["wall"]
            for r in range(len(rows[name]))
        )

    ratios: list[tuple[str, str, tuple[str, ...], float]] = []
    for label, cache in (("open cache", "tieredkv"), ("new cache", "new cache")):
        peer_target = 1.5 if cache == "tieredkv" else 1.2
        for op, raw_target in (("load", 0.9), ("append", 0.8)):
            peers = (f"safetensors {op}", f"safetensors 1 thread {op}")
            ratios.append(
                (f"{label}: {op} / safetensors (best)", f"{cache} {op}", peers, peer_target)
            )
            ratios.append(
                (f"{label}: {op} / raw O_DIRECT", f"{cache} {op}", (f"raw {op}",), raw_target)
            )
        ratios.append(
            (f"{label}: load_into / raw O_DIRECT", f"{cache} load_into", ("raw load",), 0.9)
        )
    print(f"{'':<46}{'medians':>7}{'paired':>8}")
    for label, mine, others, target in ratios:
        of_medians = gbps(mine) / max(gbps(o) for o in others)
        pair = paired(mine, *others)
        verdict = "met" if pair >= target else "missed"
        print(f"ratio {label:<40}{of_medians:6.2f}{pair:8.2f}  (target >= {target}: {verdict})")
    for name in ("tieredkv append", "tieredkv load", "new cache append", "new cache load"):
        cpu = med(name, "cpu") / gb
        verdict = "met" if cpu <= 0.25 else "missed"
        print(f"cpu   {name:<40}{cpu:6.3f}  CPU-s/GB (target <= 0.25: {verdict})")
    for op in ("append", "load"):
        print(
            f"peer  safetensors {op}: alone {gbps(f'safetensors alone {op}'):.2f} GB/s, "
            f"in the rounds {gbps(f'safetensors {op}'):.2f} GB/s"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="a directory on the SSD (default: a temp dir)")
    parser.add_argument("--sizes", default="8:16,64:8", help="MIB:TURNS pairs (turn size)")
    parser.add_argument("--tensors", type=int, default=64, help="tensors per turn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--depth",
        type=int,
        default=READ_DEPTH,
        help=f"raw reads in flight (default {READ_DEPTH}: as many as tieredkv's SSD tier keeps)",
    )
    parser.add_argument("--no-drop", dest="drop", action="store_false", help="no drop_caches")
    parser.add_argument(
        "--settle",
        type=float,
        default=None,
        help="seconds the device settles after os.sync before each child, and between the "
        "open cache's append and its load (default 0.3; --quick: 0)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 round of 2 turns of 1 MiB, no pauses (tests)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.tensors, args.rounds = "1:2", 4, 1
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as exc:
        parser.error(str(exc))
    for name in ("tensors", "rounds", "depth"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.settle is None:
        args.settle = 0.0 if args.quick else 0.3
    elif not args.settle >= 0:  # (NaN too)
        parser.error(f"--settle must be 0 or more seconds, not {args.settle}")
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        parser.error("this benchmark compares against safetensors: pip install -e '.[bench]'")
    base = Path(tempfile.mkdtemp(prefix="bench-api-", dir=args.dir))
    args.cold_ran = set()
    args.collapsed = []
    args.pool = process_per_task()
    try:
        for mib, n in sizes:
            try:
                rows = bench_size(args, base, mib, n)
            except AssertionError as exc:
                print(exc, file=sys.stderr)
                return 1
            nbytes = n * args.tensors * (mib * MB // args.tensors // (2 * WIDTH)) * 2 * WIDTH
            print(
                f"\n== {n} turns x {args.tensors} tensors = {mib} MiB turns, "
                f"{nbytes / 1e6:.0f} MB; median of {args.rounds} rounds, a process per system "
                f"per round; reads made cold by {' and '.join(sorted(args.cold_ran))}; every "
                f"read byte-checked; {args.settle:g} s settle before each child and the "
                f"open cache's load; load average {os.getloadavg()[0]:.2f}; the open cache "
                f"had made {'/'.join(map(str, args.collapsed))} huge pages of dropped outputs "
                "before its timed calls",
                flush=True,
            )
            args.collapsed.clear()
            report(rows, nbytes, args)
    finally:
        args.pool.shutdown()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
