"""What users call, against what they would use instead, in one run: durable writes and
cold reads of a conversation's KV.

One conversation of ``--turns`` turns, each ``--tensors`` named fp16 tensors of
``--tensor-mib`` MiB (a Llama-3-8B-shaped turn is 64 tensors: 32 layers x K and V). Written
durably, then read back cold (the page cache dropped before every read where permitted;
``tieredkv`` reads with O_DIRECT either way):

- ``tieredkv``: ``TieredKVCache([SSDTier(dir)])`` ``append`` per turn (durable when it
  returns), then ``load`` (new tensors) and ``load_into`` (preallocated, prefaulted
  tensors), in a cache that stays open across rounds, as a serving process's does (it made
  one untimed append and load first: its staging buffers exist, and a load's outputs
  reuse the memory of the previous load's once dropped); the ``new cache`` rows open a
  cache for the call instead (every buffer and output is new memory, faulted in on first
  touch);
- ``raw O_DIRECT``: the same bytes, one file per turn, prepared in aligned buffers before
  the clock starts, one ``pwrite`` + ``fsync`` each; reads with ``--depth`` reads of 8 MiB
  in flight (threads) into an aligned buffer: the device's ceiling as this machine sees it
  (tieredkv must also serialize, checksum and copy);
- ``safetensors``: ``save_file`` + ``fsync`` per turn; ``load_file`` per turn + ``torch.cat``;
- ``torch.save``: ``torch.save`` + ``fsync`` per turn; ``torch.load`` + ``torch.cat``.

Rounds alternate the systems; each figure is the median of ``--rounds``. Needs the
``bench`` extra (``safetensors``). Prints GB/s and
the ratios of issue 17 (targets: load >= 0.9x raw, >= 1.2x safetensors; durable append >=
0.8x raw, >= 1.5x safetensors)::

    .venv/bin/python benchmarks/bench_api.py [--dir DIR] [--turns 8] [--tensors 64]
        [--tensor-mib 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.from_thread
import torch

from tieredkv import SSDTier, TieredKVCache

MB = 1 << 20
ALIGN = 4096
Turn = dict[str, torch.Tensor]


def make_turns(turns: int, tensors: int, tensor_mib: int) -> list[Turn]:
    """Deterministic fp16 turns, ``[tokens, 1024]`` per tensor (2 KiB per token)."""
    tokens = tensor_mib * MB // 2048
    g = torch.Generator().manual_seed(0)
    return [
        {
            f"layer{i // 2}.{'kv'[i % 2]}": torch.randn(tokens, 1024, generator=g).half()
            for i in range(tensors)
        }
        for _ in range(turns)
    ]


def drop_page_cache() -> bool:
    """Drop clean pages (root only); ``False`` where not permitted."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- tieredkv ---------------------------------------------------------------------------
class Steady:
    """One cache, open for the whole benchmark (in a portal's event loop thread)."""

    def __init__(self, root: Path, warm: list[Turn]) -> None:
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        self.cache = TieredKVCache([SSDTier(root, 64 << 30)])
        self.portal.call(self.cache.open)
        self.write("warm-up", warm)
        self.portal.call(self.cache.load, "warm-up")  # dropped: its memory is kept
        self.portal.call(self.cache.drop, "warm-up")

    def write(self, session: str, turns: list[Turn]) -> None:
        self.portal.call(append_turns, self.cache, session, turns)

    def close(self) -> None:
        self.portal.call(self.cache.aclose)
        self._portal_cm.__exit__(None, None, None)


async def append_turns(cache: TieredKVCache, session: str, turns: list[Turn]) -> None:
    """Each turn appended in order (durable as each append returns)."""
    for i, t in enumerate(turns):
        await cache.append(session, t, answer_tokens=i)


async def tkv_write(root: Path, turns: list[Turn]) -> None:
    async with TieredKVCache([SSDTier(root, 64 << 30)]) as cache:
        await append_turns(cache, "user", turns)


async def tkv_load(root: Path) -> dict[str, torch.Tensor]:
    async with TieredKVCache([SSDTier(root, 64 << 30)]) as cache:
        return await cache.load("user")


async def tkv_load_into(root: Path, out: dict[str, torch.Tensor]) -> None:
    async with TieredKVCache([SSDTier(root, 64 << 30)]) as cache:
        await cache.load_into("user", out)


# -- raw O_DIRECT -------------------------------------------------------------------------
def turn_bytes(turn: Turn) -> bytes:
    return b"".join(t.numpy().tobytes() for t in turn.values())


def aligned_blobs(blobs: list[bytes]) -> list[mmap.mmap]:
    """Each turn's bytes in a page-aligned buffer (O_DIRECT needs one), made before timing."""
    out = []
    for blob in blobs:
        buf = mmap.mmap(-1, -(-len(blob) // ALIGN) * ALIGN)
        buf[: len(blob)] = blob
        out.append(buf)
    return out


def raw_write(root: Path, bufs: list[mmap.mmap]) -> None:
    """The device's durable write speed: each turn's prepared aligned bytes written with one
    O_DIRECT ``pwrite`` and ``fsync``-ed (no serialization, no copy: a ceiling, not a
    competitor)."""
    for i, buf in enumerate(bufs):
        path = root / f"turn{i}.raw"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            os.pwrite(fd, buf, 0)
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(root)


def raw_read(root: Path, turns: int, depth: int) -> None:
    """Read every turn file with ``depth`` reads of 8 MiB in flight."""
    jobs = []
    for i in range(turns):
        path = root / f"turn{i}.raw"
        size = path.stat().st_size
        jobs += [(path, off, min(8 * MB, size - off)) for off in range(0, size, 8 * MB)]
    buf = mmap.mmap(-1, 8 * MB * depth)

    def read(k: int, job: tuple[Path, int, int]) -> None:
        path, off, n = job
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            view = memoryview(buf)[(k % depth) * 8 * MB : (k % depth) * 8 * MB + n]
            os.preadv(fd, [view], off)
            view.release()
        finally:
            os.close(fd)

    with concurrent.futures.ThreadPoolExecutor(depth) as pool:
        list(pool.map(read, range(len(jobs)), jobs))
    buf.close()


# -- safetensors / torch.save ---------------------------------------------------------------
def st_write(root: Path, turns: list[Turn]) -> None:
    from safetensors.torch import save_file

    for i, t in enumerate(turns):
        path = root / f"turn{i}.safetensors"
        save_file(t, str(path))
        fsync_path(path)
    fsync_dir(root)


def st_read(root: Path, turns: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    parts = [load_file(str(root / f"turn{i}.safetensors")) for i in range(turns)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def pt_write(root: Path, turns: list[Turn]) -> None:
    for i, t in enumerate(turns):
        path = root / f"turn{i}.pt"
        torch.save(t, path)
        fsync_path(path)
    fsync_dir(root)


def pt_read(root: Path, turns: int) -> dict[str, torch.Tensor]:
    parts = [torch.load(root / f"turn{i}.pt") for i in range(turns)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def settle() -> None:
    """Let the device finish what came before (writeback, and the discards of deleted files
    on a ``discard``-mounted file system) so it does not slow the next system measured."""
    os.sync()
    time.sleep(0.3)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


reads_got: dict[str, dict[str, torch.Tensor]] = {}
"""What each cold read returned in the current round (checked against the data)."""


def one_round(
    r: int,
    steady: Steady,
    dirs: dict[str, Path],
    turns: list[Turn],
    blobs: list[mmap.mmap],
    out: dict[str, torch.Tensor],
    out2: dict[str, torch.Tensor],
    writes: dict[str, list[float]],
    reads: dict[str, list[float]],
    depth: int,
) -> None:
    """Each system writes once, then reads once cold."""
    session = f"user{r}"
    writers: list[tuple[str, Callable[[], object]]] = [
        ("tieredkv", lambda: steady.write(session, turns)),
        ("tieredkv, new cache", lambda: anyio.run(tkv_write, dirs["tieredkv"], turns)),
        ("raw", lambda: raw_write(dirs["raw"], blobs)),
        ("safetensors", lambda: st_write(dirs["safetensors"], turns)),
        ("torch", lambda: pt_write(dirs["torch"], turns)),
    ]
    # each round starts with another system: the one after a cleanup meets its discards
    for name, fn in writers[r % len(writers) :] + writers[: r % len(writers)]:
        settle()
        writes[name].append(timed(fn))
    n = len(turns)
    systems: list[tuple[str, Callable[[], object]]] = [
        ("tieredkv load", lambda: steady.portal.call(steady.cache.load, session)),
        ("tieredkv load_into", lambda: steady.portal.call(steady.cache.load_into, session, out)),
        ("load, new cache", lambda: anyio.run(tkv_load, dirs["tieredkv"])),
        ("load_into, new cache", lambda: anyio.run(tkv_load_into, dirs["tieredkv"], out2)),
        ("raw", lambda: raw_read(dirs["raw"], n, depth)),
        ("safetensors", lambda: st_read(dirs["safetensors"], n)),
        ("torch", lambda: pt_read(dirs["torch"], n)),
    ]
    for name, fn in systems[r % len(systems) :] + systems[: r % len(systems)]:
        settle()
        drop_page_cache()
        start = time.perf_counter()
        result = fn()
        reads[name].append(time.perf_counter() - start)
        if isinstance(result, dict):
            reads_got[name] = result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, help="a directory on the SSD (default: a temp dir)")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--tensor-mib", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth", type=int, default=4, help="raw reads in flight")
    args = parser.parse_args(argv)
    for name in ("turns", "tensors", "tensor_mib", "rounds", "depth"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        parser.error("this benchmark compares against safetensors: pip install -e '.[bench]'")
    base = Path(tempfile.mkdtemp(prefix="bench-api-", dir=args.dir))
    turns = make_turns(args.turns, args.tensors, args.tensor_mib)
    nbytes = sum(t.numel() * t.element_size() for turn in turns for t in turn.values())
    blobs = aligned_blobs([turn_bytes(t) for t in turns])
    want = {k: torch.cat([t[k] for t in turns]) for k in turns[0]}
    out = {k: torch.empty_like(v) for k, v in want.items()}
    out2 = {k: torch.empty_like(v) for k, v in want.items()}
    for v in [*out.values(), *out2.values()]:
        v.zero_()  # prefaulted
    cold = drop_page_cache()
    writes: dict[str, list[float]] = {
        n: [] for n in ("tieredkv", "tieredkv, new cache", "raw", "safetensors", "torch")
    }
    reads: dict[str, list[float]] = {
        n: []
        for n in (
            "tieredkv load",
            "tieredkv load_into",
            "load, new cache",
            "load_into, new cache",
            "raw",
            "safetensors",
            "torch",
        )
    }
    (base / "steady").mkdir()
    steady = Steady(base / "steady", turns)
    try:
        for r in range(args.rounds):
            dirs = {n: base / f"{n}-{r}" for n in ("tieredkv", "raw", "safetensors", "torch")}
            for d in dirs.values():
                d.mkdir()
            one_round(r, steady, dirs, turns, blobs, out, out2, writes, reads, args.depth)
            got = [*reads_got.items(), ("tieredkv load_into", out), ("new cache", out2)]
            for name, tensors in got:
                if any(not torch.equal(tensors[k], v) for k, v in want.items()):
                    print(f"{name} returned different bytes", file=sys.stderr)
                    return 1
            for v in [*out.values(), *out2.values()]:
                v.zero_()  # so that the next round's load_into must write every byte
            reads_got.clear()  # the steady cache's outputs go back to it for reuse
            steady.portal.call(steady.cache.drop, f"user{r}")
            for d in dirs.values():
                shutil.rmtree(d)
    finally:
        steady.close()
        shutil.rmtree(base, ignore_errors=True)

    def gbps(seconds: list[float]) -> float:
        return nbytes / statistics.median(seconds) / 1e9

    print(
        f"{args.turns} turns x {args.tensors} tensors x {args.tensor_mib} MiB = "
        f"{nbytes / 1e6:.0f} MB; median of {args.rounds} rounds; page cache "
        f"{'dropped before each read' if cold else 'NOT dropped (not permitted)'}"
    )
    print(f"{'durable write':<22}{'GB/s':>7}   {'cold read':<22}{'GB/s':>7}")
    wrows = list(writes.items())
    rrows = list(reads.items())
    for i in range(max(len(wrows), len(rrows))):
        left = f"{wrows[i][0]:<22}{gbps(wrows[i][1]):>7.2f}" if i < len(wrows) else " " * 29
        right = f"{rrows[i][0]:<22}{gbps(rrows[i][1]):>7.2f}" if i < len(rrows) else ""
        print(f"{left}   {right}")
    print("GB/s per round (the disk is shared: rounds vary):")
    for kind, rows in (("write", writes), ("read", reads)):
        for name, seconds in rows.items():
            print(f"  {kind} {name:<22}" + " ".join(f"{nbytes / x / 1e9:5.2f}" for x in seconds))
    w, rd = {k: gbps(v) for k, v in writes.items()}, {k: gbps(v) for k, v in reads.items()}
    for label, value, target in [
        ("load / raw O_DIRECT read", rd["tieredkv load"] / rd["raw"], 0.9),
        ("load_into / raw O_DIRECT read", rd["tieredkv load_into"] / rd["raw"], 0.9),
        ("load / safetensors load_file", rd["tieredkv load"] / rd["safetensors"], 1.2),
        ("append / raw O_DIRECT write+fsync", w["tieredkv"] / w["raw"], 0.8),
        ("append / safetensors save_file+fsync", w["tieredkv"] / w["safetensors"], 1.5),
        ("new cache: load / raw read", rd["load, new cache"] / rd["raw"], 0.9),
        ("new cache: load / safetensors", rd["load, new cache"] / rd["safetensors"], 1.2),
        ("new cache: append / raw write", w["tieredkv, new cache"] / w["raw"], 0.8),
        ("new cache: append / safetensors", w["tieredkv, new cache"] / w["safetensors"], 1.5),
    ]:
        verdict = "met" if value >= target else "missed"
        print(f"ratio {label:<38}{value:6.2f}  (target >= {target}: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
