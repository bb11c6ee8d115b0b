"""How much background SSD loads slow the model's turns on this machine, measured.

Bidaw hides a history's SSD load behind other requests' compute: the load runs while the
model serves someone else. On a GPU server the two hardly meet (the GPU computes from HBM,
the load goes SSD -> host DRAM). On a CPU the "GPU" computes from the same DRAM the load
writes into and the checksum reads from, so a hidden load is not free: it slows the turn
it hides behind. This benchmark measures by how much, with the serving benchmark's model
and the library's real code paths:

* foreground: ``TransformersAdapter.chat_turn`` (restore a ~1,000-1,700-token history from
  the host tier, prefill a 70-token query, decode 6 tokens, store the turn; K/V codec, one
  torch thread), rotating over 8 conversations in a ``TieredKVCache`` of a host tier over
  an O_DIRECT ``SSDTier`` (inclusive, as in the serving benchmark);
* background: ``SSDTier.read`` of a stored 1,000-token history (about 62 MiB:
  O_DIRECT reads checked by their xxh3 checksum, the promotion path), over and over, idle
  between loads so that the SSD is busy ``duty`` of the time.

Blocks of 4 turns alternate background off / on (the first turn of a block is not
counted, so a load that straddles a switch does not blur it), 12 blocks of each per duty
cycle. It prints, per duty cycle, the median turn time without and with background loads
and their ratio (the slowdown a hidden load inflicts), and the SSD throughput the loads
got. Then, the same way, turns over a host-only cache against turns over the host + SSD
inclusive cache (each turn's segment written through to the SSD, fsync'd, in the
background): what write-through costs a turn.

With ``--python-bound``, it also measures what the loads cost a model that spends its
steps in Python rather than in kernels, as a small model on a GPU does (there, launching
kernels is the work, under the GIL): turns of a 4-layer, 2-head model of head dim 16 on a
host-only cache, with and without background loads of a history stored the way the
serving benchmark stores them (one segment per turn, about 4.5 MiB each), read two ways:
the tier's default (a segment of one chunk or less in one read, hashed in the same
thread) and every segment through the pipelined path (reader and hasher threads), as all
segments were read before. Every hand-off between threads takes the GIL, and the model's
thread waits for each. It is a measurement, with no target: it exits non-zero only on an
error.

    .venv/bin/python benchmarks/bench_interference.py                  # about 2 minutes
    .venv/bin/python benchmarks/bench_interference.py --python-bound   # 1 more minute
"""

from __future__ import annotations

import argparse
import mmap
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import numpy as np
import torch

from bench_serve import build_model  # the serving benchmark's model
from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.backends.base import SegmentKey
from tieredkv.backends.ssd.reader import SegmentReader
from tieredkv.backends.ssd.stream import SpanStream
from tieredkv.integrations.transformers import TransformersAdapter


async def start_sessions(
    adapter: TransformersAdapter, cache: TieredKVCache, names: list[str], rng: np.random.Generator
) -> dict[str, list[int]]:
    """An 800-token first turn for each session; returns their token histories."""
    history: dict[str, list[int]] = {}
    for s in names:
        prompt = rng.integers(0, adapter.model.config.vocab_size, 800).tolist()
        turn = await adapter.chat_turn(cache, s, prompt, max_new_tokens=2, history=[])
        history[s] = prompt + list(turn.answer)
    return history


Hist = dict[str, list[int]]
"""Each session's token history."""


async def timed_turn(
    adapter: TransformersAdapter,
    cache: TieredKVCache,
    session: str,
    history: dict[str, list[int]],
    rng: np.random.Generator,
) -> float:
    """One turn (70-token query, 6-token answer) of ``session``; its seconds."""
    query = rng.integers(0, adapter.model.config.vocab_size, 70).tolist()
    began = time.perf_counter()
    turn = await adapter.chat_turn(
        cache, session, query, max_new_tokens=6, history=history[session]
    )
    took = time.perf_counter() - began
    history[session] += query + list(turn.answer)
    return took


async def alternate(blocks: int, turn: Callable[[int], Awaitable[float]]) -> tuple[float, float]:
    """``blocks`` blocks of 4 turns of each side, alternating side 0 and side 1
    (``turn(side)`` runs one and returns its seconds); the first turn of a block is not
    counted, so whatever straddles a switch does not blur it. Median seconds per side."""
    times: tuple[list[float], list[float]] = ([], [])
    for block in range(2 * blocks):
        side = block % 2
        for j in range(4):
            took = await turn(side)
            if j > 0:
                times[side].append(took)
    return statistics.median(times[0]), statistics.median(times[1])


def two_tier_cache(adapter: TransformersAdapter, ssd: SSDTier) -> TieredKVCache:
    return TieredKVCache(
        [HostMemoryTier(2 << 30, prefault=False), ssd],
        eviction="lru",
        token_dim=adapter.token_dim,
        mode="inclusive",
    )


async def measure_loads(
    adapter: TransformersAdapter, directory: Path, duty: float, blocks: int, seed: int
) -> tuple[float, float, float]:
    """Median turn seconds without and with background loads, and the loads' GB/s."""
    rng = np.random.default_rng(seed)
    ssd = SSDTier(directory, 16 << 30)
    async with two_tier_cache(adapter, ssd) as cache:
        sessions = [f"user{i}" for i in range(8)]
        history = await start_sessions(adapter, cache, [*sessions, "background"], rng)
        await cache.flush()  # every history is on the SSD too (write-through)
        stored = ssd.keys()
        keys = sorted(k for k in stored if k[0] == "background")
        return await alternate_loads(
            ssd,
            keys,
            duty,
            blocks,
            lambda n: timed_turn(adapter, cache, sessions[n % len(sessions)], history, rng),
        )


async def alternate_loads(
    ssd: SSDTier,
    keys: list[SegmentKey],
    duty: float,
    blocks: int,
    turn: Callable[[int], Awaitable[float]],
) -> tuple[float, float, float]:
    """:func:`alternate` turns (``turn(n)`` runs the n-th) without and with a background
    task that reads the segments ``keys`` (one ``read`` of them all, the promotion path) over and
    over, idle between reads so that the SSD is busy ``duty`` of the time. Median turn
    seconds without and with the loads, and the loads' GB/s."""
    buffers = [mmap.mmap(-1, ssd.length(k)) for k in keys]
    views = [memoryview(b) for b in buffers]
    on = False
    loaded = 0
    load_time = 0.0

    async def background() -> None:
        nonlocal loaded, load_time
        while True:
            if not on:
                await anyio.sleep(0.005)
                continue
            began = time.perf_counter()
            await ssd.read(keys, views)
            took = time.perf_counter() - began
            loaded += sum(len(v) for v in views)
            load_time += took
            await anyio.sleep(took * (1 / duty - 1))

    n = 0

    async def side_turn(side: int) -> float:  # side 1: with background loads
        nonlocal on, n
        on = side == 1
        n += 1
        return await turn(n)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(background)
            off, with_loads = await alternate(blocks, side_turn)
            on = False
            tg.cancel_scope.cancel()
    finally:
        for v in views:
            v.release()
        for b in buffers:
            b.close()
    gbps = loaded / load_time / 1e9 if load_time else 0.0
    return off, with_loads, gbps


async def measure_write_through(
    adapter: TransformersAdapter, directory: Path, blocks: int, seed: int
) -> tuple[float, float]:
    """Median turn seconds over a host-only cache and over host + SSD (inclusive: every
    turn's segment written through to the SSD in the background, with fsync)."""
    rng = np.random.default_rng(seed)
    host_only = TieredKVCache(
        [HostMemoryTier(2 << 30, prefault=False)], token_dim=adapter.token_dim
    )
    async with host_only, two_tier_cache(adapter, SSDTier(directory, 16 << 30)) as both:
        caches = (host_only, both)
        names = [[f"m{i}" for i in range(8)], [f"s{i}" for i in range(8)]]
        history = await start_sessions(adapter, host_only, names[0], rng)
        history |= await start_sessions(adapter, both, names[1], rng)
        await both.flush()
        n = [0, 0]

        async def turn(side: int) -> float:  # side 0: host only, side 1: host + SSD
            session = names[side][n[side] % 8]
            n[side] += 1
            return await timed_turn(adapter, caches[side], session, history, rng)

        return await alternate(blocks, turn)


class PipelinedReader(SegmentReader):
    """Reads every segment through the pipelined path (reader and hasher threads), small
    ones too: how every segment was read before."""

    def _read_verify(self, fd: int, key: SegmentKey, out: memoryview, rel: str) -> None:
        self._read_verify_pipelined(fd, key, out, rel)


class PipelinedSSDTier(SSDTier):
    """An SSD tier whose reader is a :class:`PipelinedReader`."""

    def __init__(self, directory: Path, capacity: int) -> None:
        super().__init__(directory, capacity)
        old = self._reader
        self._reader = PipelinedReader(self._dir, self._index, self._workers, old.key, old.chunk)
        self._stream = SpanStream(self._reader, self._index, self._workers)


async def measure_python_bound(
    big: TransformersAdapter, directory: Path, duties: list[float], blocks: int, seed: int
) -> list[tuple[str, float, float, float, float]]:
    """Turns of a Python-bound model without and with background loads of a 12-segment
    history (of ``big``'s K/V), for each read path and duty: (path, duty, median seconds
    without, with, the loads' GB/s)."""
    rng = np.random.default_rng(seed)
    device = big.device.type
    small = TransformersAdapter(
        build_model(seed, layers=4, heads=2, head_dim=16, device=device), codec="kv"
    )
    rows = []
    sessions = [f"user{i}" for i in range(8)]
    for name, tier in (
        ("one read per segment", SSDTier(directory / "one", 16 << 30)),
        ("pipelined threads", PipelinedSSDTier(directory / "pipelined", 16 << 30)),
    ):
        fore = TieredKVCache([HostMemoryTier(256 << 20, prefault=False)], token_dim=1)
        async with two_tier_cache(big, tier) as stored, fore:
            hist: list[int] = []
            for _ in range(12):  # one segment per turn, as in serving
                query = rng.integers(0, big.model.config.vocab_size, 70).tolist()
                turn = await big.chat_turn(stored, "bg", query, max_new_tokens=2, history=hist)
                hist += query + list(turn.answer)
            await stored.flush()
            history = await start_sessions(small, fore, sessions, rng)
            on_disk = tier.keys()
            keys = sorted(k for k in on_disk if k[0] == "bg")

            async def fore_turn(
                n: int, fore: TieredKVCache = fore, history: Hist = history
            ) -> float:
                return await timed_turn(small, fore, sessions[n % len(sessions)], history, rng)

            for duty in duties:
                off, on, gbps = await alternate_loads(tier, keys, duty, blocks, fore_turn)
                rows.append((name, duty, off, on, gbps))
    return rows


async def main(args: argparse.Namespace) -> int:
    duties = [float(d) for d in args.duty.split(",")]
    if any(not 0 < d <= 1 for d in duties):
        raise SystemExit(f"--duty takes fractions in (0, 1], not {args.duty!r}")
    if args.blocks < 1:
        raise SystemExit(f"--blocks must be at least 1, not {args.blocks}")
    torch.set_num_threads(1)  # one core computes, the other moves data (as bench_serve)
    adapter = TransformersAdapter(build_model(args.seed, device=args.device), codec="kv")
    root = Path(tempfile.mkdtemp(prefix="tieredkv-interference-", dir=args.dir))
    print(
        "turn = restore + 70-token prefill + 6 decode steps over a 1,000-1,700-token history "
        f"(64 KiB/token), medians; model on {args.device}"
    )
    print(f"{'SSD duty':>8} {'no loads ms':>11} {'loads ms':>9} {'slowdown':>8} {'load GB/s':>9}")
    try:
        for i, duty in enumerate(duties):
            off, on, gbps = await measure_loads(
                adapter, root / str(i), duty, args.blocks, args.seed
            )
            print(f"{duty:>8.2f} {off * 1e3:>11.1f} {on * 1e3:>9.1f} {on / off:>8.2f} {gbps:>9.2f}")
        host, both = await measure_write_through(adapter, root / "wt", args.blocks, args.seed)
        print(
            f"write-through: host tier only {host * 1e3:.1f} ms, host + SSD (inclusive) "
            f"{both * 1e3:.1f} ms, slowdown {both / host:.2f}"
        )
        if args.python_bound:
            print(
                f"\nPython-bound model (4 layers, 2 heads of dim 16) on {args.device}, turns on a "
                "host-only cache; "
                "background loads of a 12-segment history (about 4.5 MiB a segment), medians"
            )
            print(
                f"{'read path':<22} {'SSD duty':>8} {'no loads ms':>11} {'loads ms':>9} "
                f"{'slowdown':>8} {'load GB/s':>9}"
            )
            rows = await measure_python_bound(
                adapter, root / "python-bound", duties, args.blocks, args.seed
            )
            for name, duty, off, on, gbps in rows:
                print(
                    f"{name:<22} {duty:>8.2f} {off * 1e3:>11.1f} {on * 1e3:>9.1f} "
                    f"{on / off:>8.2f} {gbps:>9.2f}"
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duty", default="0.1,0.3,1.0", help="SSD busy fractions, comma-separated")
    parser.add_argument("--blocks", type=int, default=12, help="blocks of each kind per duty")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="where the SSD tier's files go")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the models run",
    )
    parser.add_argument(
        "--python-bound",
        action="store_true",
        help="also measure what the loads cost a Python-bound model, per read path",
    )
    sys.exit(anyio.run(main, parser.parse_args()))
