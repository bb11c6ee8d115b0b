"""RedisTier against the raw client on the same server, measured in one run.

Stores and loads a 64 MiB history (``--segments`` segments of equal size, one per turn)
through :class:`tieredkv.backends.redis.RedisTier` (values of ``--value-size``, manifest
published by a Lua step, checksums verified on read) and, as the baseline, through raw
``redis.asyncio``: a pipeline of ``SET`` (``GET``) of the same bytes in the same value
sizes, with nothing published or verified. The same turns also go through a
``TieredKVCache([RedisTier])`` (``append`` of each turn's tensors, ``load`` of the joined
history: what a user calls). The ratio is raw time / tier (cache) time (1.0: the tier costs
nothing over the client). Target (issue 25): >= 0.9 for load and store, both ways. Beside
each figure, this process's CPU seconds per GB (user + system, every thread; the server's
own CPU is not counted). The default history's segments are 8 MiB, a small model's turn.

Then the host tier: ``TieredKVCache([HostMemoryTier])``'s ``load_into`` of the same turns
against ``dst.copy_(src)`` of each turn into the same preallocated, prefaulted tensors.
Target: >= 0.8.

Runs rotate who goes first so a noisy machine penalizes all alike; each figure is the
median, and every load is checked byte for byte (a mismatch raises). ``--quick``: a
16 MiB history in 2 segments, one measured run (for the tests). ``--sweep`` also prints
the tier's throughput for several value sizes (how the default was chosen). Starts its
own ``redis-server`` (no persistence) on a free port unless ``--url`` names one. Exits
non-zero when a target is missed (``--no-check``: report only)::

    .venv/bin/python benchmarks/bench_redis.py [--url URL] [--reps 7] [--sweep] [--replicas]

``--replicas`` also serves 8 conversations of 6 turns on two replicas, turns alternating:
with a shared RedisTier each replica loads the history the other wrote; without one it
must recompute it. It prints the cache's own work per turn and the bytes recomputed (the
model time that recomputing costs is not measured here). Each turn there takes the
conversation over from the replica that served the one before, whose lease (0.05 s here)
then delays the turn's commit, which ``flush()`` waits for (see the Redis how-to).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator

import anyio
import redis.asyncio as aioredis
import torch

from _measure import Took, measured
from tieredkv import HostMemoryTier, TieredKVCache
from tieredkv.backends.base import Tier
from tieredkv.backends.redis import RedisTier, driver_options
from tieredkv.payload import plan_segment

MiB = 1 << 20
TARGET = 0.9
"""Tier (and cache) time over the raw client's, load and store."""
HOST_TARGET = 0.8
"""The host tier's ``load_into`` over a plain copy into preallocated tensors."""
WIDTH = 1024  # int16 elements per token per tensor


class History:
    """``segments`` real segments totalling ``total`` bytes, each in its own mmap buffer."""

    def __init__(self, total: int, segments: int) -> None:
        per = total // segments
        tokens = (per - 4096) // (2 * WIDTH * 2)
        self.keys: list[tuple[str, int]] = []
        self.bufs: list[mmap.mmap] = []
        self.turns: list[dict[str, torch.Tensor]] = []
        for seq in range(segments):
            gen = torch.Generator().manual_seed(seq)
            tensors = {
                n: torch.randint(-(2**15), 2**15, (tokens, WIDTH), dtype=torch.int16, generator=gen)
                for n in ("k", "v")
            }
            self.turns.append(tensors)
            plan = plan_segment("bench", seq, tensors, token_dim=0, answer_tokens=100)
            buf = mmap.mmap(-1, plan.length)
            plan.write_into(memoryview(buf))
            self.keys.append(("bench", seq))
            self.bufs.append(buf)
        self.outs = [mmap.mmap(-1, len(b)) for b in self.bufs]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.bufs)

    def check(self) -> None:
        for b, o in zip(self.bufs, self.outs, strict=True):
            if b[:] != o[:]:
                raise AssertionError("the tier returned other bytes than it was given")


@contextlib.contextmanager
def local_server() -> Iterator[str]:
    """A ``redis-server`` on a free port, without persistence; its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server is not on PATH: apt-get install -y redis-server, or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", d]
        proc = subprocess.Popen([*args, "--appendonly", "no"], stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                if time.monotonic() > deadline:
                    sys.exit("redis-server did not start")
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            proc.wait(10)


async def timed(fn: Callable[[], Awaitable[object]]) -> Took:
    with measured() as took:
        await fn()
    return took


def medians(times: dict[str, list[Took]]) -> dict[str, Took]:
    """Per figure, the median wall and the median CPU seconds of its runs."""
    return {
        k: Took(statistics.median(t.wall for t in v), statistics.median(t.cpu for t in v))
        for k, v in times.items()
        if v
    }


async def measure(url: str, h: History, value_size: int, reps: int, raw: bool) -> dict[str, Took]:
    """Median times of tier store/load (and, when ``raw``, of the raw client's set/get and
    of a ``TieredKVCache([RedisTier])``'s append/load) of the history; this process's CPU
    (the server's is not counted)."""
    options = await anyio.to_thread.run_sync(driver_options)
    client = aioredis.Redis.from_url(url, **options)
    times: dict[str, list[Took]] = {
        k: [] for k in ("store", "load", "set", "get", "append", "cache load")
    }
    want = {n: torch.cat([t[n] for t in h.turns]) for n in h.turns[0]}
    parts = [
        [f"raw:{seq}:{at}" for at in range(0, len(buf), value_size)]
        for seq, buf in enumerate(h.bufs)
    ]
    views = [memoryview(b) for b in h.bufs]
    outs = [memoryview(o) for o in h.outs]

    async def raw_set() -> None:
        for names, view in zip(parts, views, strict=True):
            async with client.pipeline(transaction=False) as pipe:
                for i, name in enumerate(names):
                    pipe.set(name, view[i * value_size : (i + 1) * value_size])
                await pipe.execute()

    async def raw_get() -> None:
        async with client.pipeline(transaction=False) as pipe:
            for name in (n for names in parts for n in names):
                pipe.get(name)
            await pipe.execute()

    def redis_tier(prefix: str) -> RedisTier:
        return RedisTier(url, 2 * h.nbytes, prefix=prefix, value_size=value_size, recover=False)

    try:
        async with (
            redis_tier(f"bench{value_size}") as tier,
            TieredKVCache([redis_tier(f"benchc{value_size}")]) as cache,
        ):

            async def store() -> None:
                for key, view in zip(h.keys, views, strict=True):
                    assert tier.reserve(key, len(view))
                    await tier.write(key, view)

            async def load() -> None:
                await tier.read(h.keys, outs)

            async def clear() -> None:  # (delete() only stops this tier counting a segment)
                await tier.discard(h.keys[0][0])
                for key in h.keys:
                    await tier.delete(key)

            async def through_tier() -> dict[str, Took]:
                await clear()
                took = {"store": await timed(store), "load": await timed(load)}
                h.check()
                return took

            async def through_client() -> dict[str, Took]:
                await client.delete(*(n for names in parts for n in names))
                return {"set": await timed(raw_set), "get": await timed(raw_get)}

            async def append() -> None:
                for i, turn in enumerate(h.turns):
                    await cache.append("bench", turn, answer_tokens=i)

            async def cache_load() -> None:
                got.append(await cache.load("bench"))

            got: list[dict[str, torch.Tensor]] = []

            async def through_cache() -> dict[str, Took]:
                if cache.contains("bench"):
                    await cache.drop("bench")
                took = {"append": await timed(append), "cache load": await timed(cache_load)}
                loaded = got.pop()
                if any(not torch.equal(loaded[n], v) for n, v in want.items()):
                    raise AssertionError("the cache loaded other bytes than were appended")
                return took

            for rep in range(reps + 1):  # the first round warms up and is not counted
                sides = [through_tier, through_client, through_cache] if raw else [through_tier]
                took: dict[str, Took] = {}
                for side in sides[rep % len(sides) :] + sides[: rep % len(sides)]:  # rotated
                    took.update(await side())
                if rep:
                    for what, seconds in took.items():
                        times[what].append(seconds)
            await clear()
    finally:
        for view in (*views, *outs):
            view.release()
        await client.aclose()
    return medians(times)


def host_tier(h: History, reps: int) -> dict[str, Took]:
    """The host tier's ``load_into`` of the history against ``dst.copy_(src)`` of the same
    turns into the same kind of preallocated (prefaulted) tensors; median times."""
    want = {n: torch.cat([t[n] for t in h.turns]) for n in h.turns[0]}
    into = {n: torch.zeros_like(v) for n, v in want.items()}
    dst = {n: torch.zeros_like(v) for n, v in want.items()}
    times: dict[str, list[Took]] = {"load_into": [], "copy": []}

    def copy() -> None:
        at = 0
        for turn in h.turns:
            rows = next(iter(turn.values())).shape[0]
            for n, t in turn.items():
                dst[n][at : at + rows].copy_(t)
            at += rows

    async def run() -> None:
        async with TieredKVCache([HostMemoryTier(2 * h.nbytes)]) as cache:
            for i, turn in enumerate(h.turns):
                await cache.append("bench", turn, answer_tokens=i)

            async def load_into() -> None:
                await cache.load_into("bench", into)

            async def plain() -> None:
                await anyio.to_thread.run_sync(copy)

            for rep in range(reps + 1):
                sides = [("load_into", load_into), ("copy", plain)]
                for name, fn in sides if rep % 2 else sides[::-1]:
                    took = await timed(fn)
                    if rep:
                        times[name].append(took)
                for out in (into, dst):
                    if any(not torch.equal(out[n], v) for n, v in want.items()):
                        raise AssertionError("the host tier or the copy filled other bytes")
                    for v in out.values():
                        v.zero_()  # the next round must write every byte again

    anyio.run(run)
    return medians(times)


def turn_kv(conv: int, i: int, tokens: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(conv * 1000 + i)
    return {
        n: torch.randint(-(2**15), 2**15, (tokens, WIDTH), dtype=torch.int16, generator=gen)
        for n in ("k", "v")
    }


async def replicas(
    url: str | None, conversations: int, turns: int, tokens: int
) -> tuple[float, int, int]:
    """Two replicas serve every conversation's turns alternately (turn i of conversation c
    on replica (c + i) % 2). With ``url``, both have a host tier over one RedisTier; without,
    only their own host tier, so a replica that did not serve the previous turn must
    recompute the history: it drops its stale copy and stores the recomputed history as one
    segment. Returns the mean seconds of a turn's cache work (load, append, write to the
    shared tier), bytes recomputed, and loads whose bytes differed (must be 0)."""
    host = 2 * conversations * turns * tokens * WIDTH * 2 * 2 + (64 << 20)

    def cache(prefix: str) -> TieredKVCache:
        tiers: list[Tier] = [HostMemoryTier(host)]
        if url is not None:
            # a short lease: each turn takes the conversation over from the replica that
            # served the one before, and its first commit waits until that one's lease ends
            tiers.append(RedisTier(url, host, prefix=prefix, recover=False, lease_ttl=0.05))
        return TieredKVCache(tiers, mode="inclusive")

    prefix = f"serve{time.time_ns()}"
    took: list[float] = []
    recomputed = wrong = 0
    async with cache(prefix) as a, cache(prefix) as b:
        for i in range(turns):
            for c in range(conversations):
                r, key = (a, b)[(c + i) % 2], f"conv-{c}"
                t0 = time.perf_counter()
                if i and url is not None:
                    got = await r.load(key)
                    want = [turn_kv(c, j, tokens) for j in range(i)]
                    wrong += not torch.equal(got["k"], torch.cat([w["k"] for w in want]))
                elif i:  # no shared tier: the history is recomputed (its cost not counted)
                    if r.contains(key):
                        await r.drop(key)
                    hist = [turn_kv(c, j, tokens) for j in range(i)]
                    joined = {n: torch.cat([h[n] for h in hist]) for n in ("k", "v")}
                    recomputed += sum(t.numel() * t.element_size() for t in joined.values())
                    await r.append(key, joined, answer_tokens=10)
                await r.append(key, turn_kv(c, i, tokens), answer_tokens=10)
                await r.flush()
                took.append(time.perf_counter() - t0)
    return statistics.mean(took), recomputed, wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--mib", type=int, default=64, help="history size (MiB)")
    parser.add_argument("--segments", type=int, default=8, help="segments in the history")
    parser.add_argument("--value-size", type=int, default=4, help="MiB per value")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--sweep", action="store_true", help="also try other value sizes")
    parser.add_argument("--no-check", action="store_true", help="do not fail on a miss")
    parser.add_argument(
        "--replicas",
        action="store_true",
        help="also serve conversations on two replicas, turns alternating: shared tier or not",
    )
    parser.add_argument("--quick", action="store_true", help="16 MiB in 2 segments, 1 rep")
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.segments, args.reps = 16, 2, 1
    h = History(args.mib * MiB, args.segments)
    gb = h.nbytes / 1e9
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_server())
        if args.sweep:
            print(f"value size sweep: history {h.nbytes / MiB:.0f} MiB in {args.segments} segments")
            for vs in (1, 2, 4, 8, 16):
                m = anyio.run(measure, url, h, vs * MiB, max(3, args.reps // 2), False)
                print(
                    f"  {vs:>2} MiB values: store {gb / m['store'].wall:.2f} GB/s, "
                    f"load {gb / m['load'].wall:.2f} GB/s"
                )
        m = anyio.run(measure, url, h, args.value_size * MiB, args.reps, True)
        if args.replicas:
            conv, turns, tokens = 8, 6, 512  # 4 MiB of K/V per turn
            shared = anyio.run(replicas, url, conv, turns, tokens)
            alone = anyio.run(replicas, None, conv, turns, tokens)
            print(f"two replicas, {conv} conversations x {turns} turns of 4 MiB, alternating:")
            for name, (mean, redone, wrong) in (("shared tier", shared), ("no shared", alone)):
                print(
                    f"  {name:<11}: cache work {mean * 1e3:6.1f} ms/turn, recomputed "
                    f"{redone / MiB:6.0f} MiB, wrong loads {wrong}"
                )
    host = host_tier(h, args.reps)
    print(
        f"history {h.nbytes / MiB:.0f} MiB in {args.segments} segments "
        f"({h.nbytes / args.segments / MiB:.0f} MiB each), {args.value_size} MiB values, "
        f"median of {args.reps}; every load byte-checked; CPU: this process (user + system)"
    )
    ratios: list[tuple[str, float, float]] = []
    for what, base, rows in (
        ("store", "set", (("RedisTier write", "store"), ("cache append", "append"))),
        ("load", "get", (("RedisTier read", "load"), ("cache load", "cache load"))),
    ):
        print(f"  {what}:")
        for label, key in (*rows, (f"raw {base.upper()} (pipelined)", base)):
            t = m[key]
            print(
                f"    {label:<24}{t.wall * 1e3:8.1f} ms {gb / t.wall:6.2f} GB/s "
                f"{t.cpu / gb:6.3f} CPU-s/GB"
            )
        for label, key in rows:
            ratios.append((f"{label} / raw {base.upper()}", m[base].wall / m[key].wall, TARGET))
    print("  host tier:")
    for label, key in (("cache.load_into", "load_into"), ("dst.copy_(src)", "copy")):
        t = host[key]
        print(
            f"    {label:<24}{t.wall * 1e3:8.1f} ms {gb / t.wall:6.2f} GB/s "
            f"{t.cpu / gb:6.3f} CPU-s/GB"
        )
    ratios.append(
        ("host load_into / copy", host["copy"].wall / host["load_into"].wall, HOST_TARGET)
    )
    missed = []
    for label, value, target in ratios:
        verdict = "met" if value >= target else "missed"
        print(f"ratio {label:<32}{value:6.2f}x  (target >= {target}: {verdict})")
        if value < target:
            missed.append(label)
    if missed and not args.no_check:
        print(f"missed the target: {', '.join(missed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
