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
* background: ``SSDTier.read_many_into`` of a stored 1,000-token history (about 62 MiB:
  O_DIRECT reads checked by their xxh3 checksum, the promotion path), over and over, idle
  between loads so that the SSD is busy ``duty`` of the time.

Blocks of 4 turns alternate background off / on (the first turn of a block is not
counted, so a load that straddles a switch does not blur it), 12 blocks of each per duty
cycle. It prints, per duty cycle, the median turn time without and with background loads
and their ratio (the slowdown a hidden load inflicts), and the SSD throughput the loads
got. It is a measurement, with no target: it exits non-zero only on an error.

    .venv/bin/python benchmarks/bench_interference.py   # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import mmap
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np
import torch

from bench_serve import build_model  # the serving benchmark's model
from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.integrations.transformers import TransformersAdapter

MiB = 1 << 20


async def measure(
    adapter: TransformersAdapter, directory: Path, duty: float, blocks: int, seed: int
) -> tuple[float, float, float]:
    """Median turn seconds without and with background loads, and the loads' GB/s."""
    rng = np.random.default_rng(seed)
    ssd = SSDTier(directory, 16 << 30)
    async with TieredKVCache(
        [HostMemoryTier(2 << 30, prefault=False), ssd],
        eviction="lru",
        token_dim=adapter.token_dim,
        mode="inclusive",
    ) as cache:
        sessions = [f"user{i}" for i in range(8)]
        history: dict[str, list[int]] = {}
        for s in [*sessions, "background"]:
            prompt = rng.integers(0, adapter.model.config.vocab_size, 800).tolist()
            turn = await adapter.chat_turn(cache, s, prompt, max_new_tokens=2, history=[])
            history[s] = prompt + list(turn.answer)
        await cache.flush()  # every history is on the SSD too (write-through)
        stored = ssd.keys()
        keys = sorted(k for k in stored if k[0] == "background")
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
                await ssd.read_many_into(list(zip(keys, views, strict=True)))
                took = time.perf_counter() - began
                loaded += sum(len(v) for v in views)
                load_time += took
                await anyio.sleep(took * (1 / duty - 1))

        times: dict[bool, list[float]] = {False: [], True: []}
        n = 0
        try:
            async with anyio.create_task_group() as tg:
                if duty > 0:
                    tg.start_soon(background)
                for block in range(2 * blocks):
                    on = duty > 0 and block % 2 == 1
                    for j in range(4):
                        s = sessions[n % len(sessions)]
                        n += 1
                        query = rng.integers(0, adapter.model.config.vocab_size, 70).tolist()
                        began = time.perf_counter()
                        turn = await adapter.chat_turn(
                            cache, s, query, max_new_tokens=6, history=history[s]
                        )
                        took = time.perf_counter() - began
                        history[s] += query + list(turn.answer)
                        if j > 0:
                            times[on].append(took)
                on = False
                tg.cancel_scope.cancel()
        finally:
            for v in views:
                v.release()
            for b in buffers:
                b.close()
    off = statistics.median(times[False])
    with_loads = statistics.median(times[True]) if times[True] else off
    return off, with_loads, (loaded / load_time / 1e9 if load_time else 0.0)


async def main(args: argparse.Namespace) -> int:
    duties = [float(d) for d in args.duty.split(",")]
    if any(not 0 < d <= 1 for d in duties):
        raise SystemExit(f"--duty takes fractions in (0, 1], not {args.duty!r}")
    torch.set_num_threads(1)  # one core computes, the other moves data (as bench_serve)
    adapter = TransformersAdapter(build_model(args.seed), codec="kv")
    root = Path(tempfile.mkdtemp(prefix="tieredkv-interference-", dir=args.dir))
    print(
        "turn = restore + 70-token prefill + 6 decode steps over a 1,000-1,700-token history "
        "(64 KiB/token), medians"
    )
    print(f"{'SSD duty':>8} {'no loads ms':>11} {'loads ms':>9} {'slowdown':>8} {'load GB/s':>9}")
    try:
        for i, duty in enumerate(duties):
            off, on, gbps = await measure(adapter, root / str(i), duty, args.blocks, args.seed)
            print(f"{duty:>8.2f} {off * 1e3:>11.1f} {on * 1e3:>9.1f} {on / off:>8.2f} {gbps:>9.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duty", default="0.1,0.3,1.0", help="SSD busy fractions, comma-separated")
    parser.add_argument("--blocks", type=int, default=12, help="blocks of each kind per duty")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="where the SSD tier's files go")
    sys.exit(anyio.run(main, parser.parse_args()))
