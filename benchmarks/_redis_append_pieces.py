"""What the serialization copy cost a cache's append over Redis: the same
``TieredKVCache([RedisTier])`` appends ``bench_redis.py``'s history (``--segments`` turns
of 8 MiB, 4 MiB values) two ways on one local ``redis-server``, beside redis-py's raw
pipelined ``SET`` of the same bytes:

- ``pieces``: what the cache does, the segment's header and views of the tensors handed
  to the tier (``SegmentPlan.pieces``), no copy;
- ``staged``: the cache's staging path for plain tiers, the segment serialized into a
  staging buffer first (as every Redis append was before).

A diagnostic, not a benchmark of record: it switches the cache's bound write
(``TierIO.write_new``) between the two, which only this probe does. The three rotate which
goes first each round; after each round of the cache the history is loaded and compared
with the turns. Prints medians of wall time and this process's CPU time (user + system),
and the median of each round's raw ``SET`` time over the append's::

    .venv/bin/python benchmarks/_redis_append_pieces.py [--segments 8] [--reps 12]
"""

from __future__ import annotations

import argparse
import functools
import resource
import statistics
import time

import anyio
import redis.asyncio as aioredis
import torch

from bench_redis import History, MiB, local_server
from tieredkv import TieredKVCache
from tieredkv.backends.redis import RedisTier, driver_options

VALUE = 4 * MiB


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run(url: str, segments: int, reps: int) -> dict[str, list[tuple[float, float]]]:
    h = History(segments * 8 * MiB, segments)
    want = {n: torch.cat([t[n] for t in h.turns]) for n in h.turns[0]}
    options = await anyio.to_thread.run_sync(driver_options)
    client = aioredis.Redis.from_url(url, **options)
    views = [memoryview(b) for b in h.bufs]
    took: dict[str, list[tuple[float, float]]] = {"pieces": [], "staged": [], "raw SET": []}
    tier = RedisTier(url, 2 * h.nbytes, prefix="pieces", value_size=VALUE, recover=False)
    try:
        async with TieredKVCache([tier]) as cache:
            io = cache._core.io[0]
            pieces = io.write_new
            if not isinstance(pieces, functools.partial):
                raise SystemExit("this library's cache does not write Redis segments as pieces")
            n = 0
            for rep in range(reps + 1):  # the first round warms up and is not counted
                sides = ["pieces", "staged", "raw SET"]
                for side in sides[rep % 3 :] + sides[: rep % 3]:
                    n += 1
                    names = [
                        f"raw{n}:{seq}:{at}"
                        for seq, view in enumerate(views)
                        for at in range(0, len(view), VALUE)
                    ]
                    t0, c0 = time.perf_counter(), _cpu()
                    if side == "raw SET":
                        it = iter(names)
                        for view in views:
                            async with client.pipeline(transaction=False) as pipe:
                                for at in range(0, len(view), VALUE):
                                    pipe.set(next(it), view[at : at + VALUE])
                                await pipe.execute()
                    else:
                        io.write_new = pieces if side == "pieces" else io._write_staged
                        for i, turn in enumerate(h.turns):
                            await cache.append(f"s{n}", turn, answer_tokens=i)
                    seconds = (time.perf_counter() - t0, _cpu() - c0)
                    if side == "raw SET":
                        await client.delete(*names)
                    else:
                        got = await cache.load(f"s{n}")
                        if any(not torch.equal(got[k], v) for k, v in want.items()):
                            raise AssertionError("the cache loaded other bytes than were appended")
                        await cache.drop(f"s{n}")
                    if rep:
                        took[side].append(seconds)
    finally:
        for view in views:
            view.release()
        await client.aclose()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--reps", type=int, default=12)
    args = ap.parse_args()
    with local_server() as url:
        took = anyio.run(run, url, args.segments, args.reps)
    print(f"{args.segments} turns of 8 MiB, 4 MiB values, medians of {args.reps} rounds")
    for side, runs in took.items():
        wall = statistics.median(w for w, _ in runs) * 1e3
        cpu = statistics.median(c for _, c in runs) * 1e3
        print(f"  {side:8s} {wall:8.1f} ms wall {cpu:7.1f} ms CPU")
    for side in ("pieces", "staged"):
        ratio = statistics.median(
            r[0] / a[0] for r, a in zip(took["raw SET"], took[side], strict=True)
        )
        print(f"raw SET / append ({side}), median of the rounds' ratios: {ratio:.2f}")


if __name__ == "__main__":
    main()
