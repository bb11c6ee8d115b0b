"""Host-tier defragmentation: what moving segments aside buys over evicting to join gaps.

A segment takes one contiguous slot of the host tier's arena, so free space splits into gaps
as sessions of different sizes come and go. Before ``ArenaTier.defragment``, a reservation
that failed with enough bytes free made the cache evict sessions, in policy order, until
some gap grew large enough: sessions were lost from host memory merely to join gaps, and
the tier ran well below capacity. Now the cache first moves idle sessions' segments into
other gaps (a memory copy) and evicts only when bytes, not a gap, are short.

This benchmark measures both behaviours in the same run, on the same requests:

* "first fit": a ``HostMemoryTier`` subclass with ``defragment = None``, so the cache
  falls back to eviction exactly as it did before the feature (the baseline);
* "defragmenting": the plain ``HostMemoryTier``;

each under three eviction policies: LRU, Bidaw's eviction in the paper's order (lowest hit
potential first) and Bidaw's per-byte order (the library's default), Bidaw's answer-length
buckets scaled like the answers, as in the serving benchmark.

The request stream is benchmarks/bench_serve.py's (40 users arriving at 1/s, conversations
capped at 2,000 tokens, 400 requests, answers scaled by 1/8 and queries by 2), and the real
``TieredKVCache`` is driven in the serving engine's call order for each request: prefetch
(when the history is stored below the host), load, append of the turn's K/V, drop after
the last turn. The payloads are real bytes at the serving benchmark model's 64 KiB per
token (one ``n x 16384`` float32 tensor per turn), the host tier is 320 MiB and the cache
is inclusive, over a real lower tier: an ``SSDTier`` (O_DIRECT where the filesystem allows
it, fsync) in a temporary directory. There is no model, no queueing and no sleeping: the
cache's clock is the request's offset in the trace, the running turn is protected as the
engine protects it, and each request waits for the background write-through to finish (as
the user's think time lets it in the engine), so every decision, and every figure but the
wall time, is deterministic.

For each run it prints the host hit ratio as the serving engine counts it (at each
non-first turn, whether the session's history is in the host tier), the mean host
occupancy (used / capacity at each request, over the whole run and from the first request
at which the host had to make room), the sessions evicted from the host
(``cache.stats()``: demotions, which in inclusive mode hand a session to its lower copy,
plus evictions), the relocations and bytes relocated (``stats().tiers[0]``) and the wall
time; then, per policy, defragmenting / first fit for the hit ratio and the occupancies,
and what the lower tier wrote: inclusive caching writes every appended byte through to it,
about 1.8 GiB a run (11 GB over the six; an ``MmapTier`` lower tier, tried instead, wrote
about 8 GB to its file and changed no figure but the wall time, so the SSD tier stays). It
is a measurement, with no target: it exits non-zero only on an error.

    .venv/bin/python benchmarks/bench_fragmentation.py     # about 80 seconds on 2 cores
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import torch

from bench_serve import bidaw_eviction  # the same scaled buckets as the serving run
from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.meta import Demoted, Event, Evicted
from tieredkv.policies import LRU, Eviction
from tieredkv.serve import TurnRequest
from tieredkv.serve.load import timed_requests
from tieredkv.sim.synthetic import SyntheticWorkload

MiB = 1 << 20
TOKEN_WIDTH = 16384  # float32 per token: 4 layers x 16 heads x 128 head dim x (K, V) = 64 KiB
ANSWER_SCALE = 0.125
LOWER_BYTES = 32 << 30  # a budget, not an allocation: only live sessions' files exist


class FirstFitHostTier(HostMemoryTier):
    """The host tier as before defragmentation: first fit, and no ``defragment``, so the
    cache evicts until some gap is large enough."""

    defragment = None  # type: ignore[assignment]


POLICIES: list[tuple[str, Callable[[], Eviction]]] = [
    ("LRU", LRU),
    ("Bidaw (paper order)", lambda: bidaw_eviction(ANSWER_SCALE, size_aware=False)),
    ("Bidaw (per-byte)", lambda: bidaw_eviction(ANSWER_SCALE, size_aware=True)),
]
ALLOCATORS: list[tuple[str, type[HostMemoryTier]]] = [
    ("first fit", FirstFitHostTier),
    ("defragmenting", HostMemoryTier),
]


@dataclass
class Result:
    policy: str
    allocator: str
    hits: int
    revisits: int
    occupancy: float
    occupancy_full: float
    evictions: int
    relocations: int
    relocated_bytes: int
    lower_written: int
    direct_io: bool | None
    seconds: float

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.revisits if self.revisits else float("nan")


async def run_one(
    policy: str,
    make_policy: Callable[[], Eviction],
    allocator: str,
    tier_type: type[HostMemoryTier],
    requests: list[tuple[float, TurnRequest]],
    host_bytes: int,
    directory: Path,
) -> Result:
    host = tier_type(host_bytes, prefault=False)
    lower = SSDTier(directory, LOWER_BYTES)
    now = 0.0
    serving: set[str] = set()
    history: set[str] = set()  # conversations with an earlier turn, as the engine keeps
    hits = revisits = 0
    occupancy: list[float] = []
    full_from: int | None = None  # first request at which the host had made room
    evicted = 0  # sessions out of the host, counted from events to cross-check the stats

    def on_event(event: Event) -> None:
        nonlocal evicted
        if (isinstance(event, Demoted) and event.src == host.name) or (
            isinstance(event, Evicted) and event.tier == host.name
        ):
            evicted += 1

    start = time.perf_counter()
    async with TieredKVCache(
        [host, lower],
        eviction=make_policy(),
        token_dim=0,
        mode="inclusive",
        clock=lambda: now,
    ) as cache:
        cache.channel.subscribe(on_event)
        cache.set_protected(lambda: serving)
        for i, (offset, request) in enumerate(requests):
            now = offset
            session = request.session
            if full_from is None and (evicted or host.stats().relocations):
                full_from = i
            occupancy.append(host.used / host.capacity)
            where = cache.where(session)
            if where is not None or session in history:
                revisits += 1
                hits += where == host.name
            serving.add(session)
            if where is not None and where != host.name:
                await cache.prefetch(session)
            if session in cache:
                await cache.load(session)
            tokens = len(request.query) + request.answer_tokens
            await cache.append(
                session,
                {"kv": torch.zeros(tokens, TOKEN_WIDTH)},
                answer_tokens=request.answer_tokens,
                token_dim=0,
            )
            history.add(session)
            if request.last:
                await cache.drop(session)
                history.discard(session)
            serving.discard(session)
            await cache.flush()  # the write-through finishes in the user's think time
        stats = cache.stats()
    seconds = time.perf_counter() - start
    if stats.tiers[1].relocations or stats.demotions + stats.evictions != evicted:
        raise RuntimeError(f"the lower tier evicted or relocated: {stats}")
    full = occupancy[full_from:] if full_from is not None else []
    return Result(
        policy=policy,
        allocator=allocator,
        hits=hits,
        revisits=revisits,
        occupancy=sum(occupancy) / len(occupancy),
        occupancy_full=sum(full) / len(full) if full else float("nan"),
        evictions=stats.demotions + stats.evictions,
        relocations=stats.tiers[0].relocations,
        relocated_bytes=stats.tiers[0].relocated_bytes,
        lower_written=stats.tiers[1].bytes_written,
        direct_io=stats.tiers[1].direct_io,
        seconds=seconds,
    )


def ratio(new: float, base: float) -> str:
    """``new / base`` as ``1.234x``, or ``-`` where it is undefined (never full, no hits)."""
    if base != base or new != new or base == 0:  # NaN or zero
        return "-"
    return f"{new / base:.3f}x"


def row(cells: list[str]) -> str:
    widths = [20, 14, 15, 10, 10, 10, 12, 14, 8]
    return "  ".join(
        c.ljust(w) if k < 2 else c.rjust(w)
        for k, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


async def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # one core copies payloads, the other does the tier's I/O
    turns = SyntheticWorkload(users=40, arrival_rate=1.0, seed=args.seed)
    requests = timed_requests(
        turns.generate(),
        vocab_size=1024,
        max_context=2000,
        max_turns=args.requests,
        answer_scale=ANSWER_SCALE,
        query_scale=2.0,
        seed=args.seed,
    )
    host_bytes = int(args.host_mb * MiB)
    sessions = len({r.session for _, r in requests})
    tokens = sum(len(r.query) + r.answer_tokens for _, r in requests)
    root = Path(tempfile.mkdtemp(prefix="tieredkv-frag-", dir=args.dir))
    print(
        f"tieredkv host-tier defragmentation benchmark: {len(requests)} requests from "
        f"{sessions} conversations ({tokens * TOKEN_WIDTH * 4 / MiB:,.0f} MiB of K/V "
        f"appended); host tier {args.host_mb:.0f} MiB (HostMemoryTier), lower tier "
        f"SSDTier in {root}, inclusive; seed {args.seed}",
        flush=True,
    )
    print(
        row(
            [
                "policy",
                "host tier",
                "host hit",
                "occupancy",
                "once full",
                "evictions",
                "relocations",
                "relocated MiB",
                "wall s",
            ]
        ),
        flush=True,
    )
    results: dict[tuple[str, str], Result] = {}
    try:
        for policy, make_policy in POLICIES:
            for allocator, tier_type in ALLOCATORS:
                directory = root / f"{len(results)}"
                r = await run_one(
                    policy, make_policy, allocator, tier_type, requests, host_bytes, directory
                )
                shutil.rmtree(directory, ignore_errors=True)
                results[policy, allocator] = r
                print(
                    row(
                        [
                            policy,
                            allocator,
                            f"{r.hit_ratio:.3f} ({r.hits}/{r.revisits})",
                            f"{r.occupancy:.3f}",
                            f"{r.occupancy_full:.3f}",
                            f"{r.evictions}",
                            f"{r.relocations}",
                            f"{r.relocated_bytes / MiB:,.0f}",
                            f"{r.seconds:.1f}",
                        ]
                    ),
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\ndefragmenting / first fit:")
    for policy, _ in POLICIES:
        base, new = results[policy, "first fit"], results[policy, "defragmenting"]
        print(
            f"  {policy:20s} host hit {ratio(new.hit_ratio, base.hit_ratio)}   "
            f"occupancy {ratio(new.occupancy, base.occupancy)}   "
            f"once full {ratio(new.occupancy_full, base.occupancy_full)}   "
            f"host evictions {new.evictions} vs {base.evictions}"
        )
    written = max(r.lower_written for r in results.values())
    direct = {r.direct_io for r in results.values()}
    print(
        f"\nlower tier: SSDTier, O_DIRECT {'/'.join(str(d) for d in sorted(direct, key=str))}, "
        f"up to {written / MiB:,.0f} MiB written per run "
        f"({sum(r.lower_written for r in results.values()) / MiB:,.0f} MiB in all); "
        f"wall time in all {sum(r.seconds for r in results.values()):.0f} s"
    )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="workload and token seed")
    parser.add_argument("--host-mb", type=float, default=320.0, help="host tier size (MiB)")
    parser.add_argument("--requests", type=int, default=400, help="the earliest N requests")
    parser.add_argument("--dir", default=None, help="where the SSD tier's files go")
    sys.exit(anyio.run(main, parser.parse_args()))
