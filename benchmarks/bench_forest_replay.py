"""Host hit ratio at a fixed host size, with and without sharing, through the real cache,
next to the simulator's prediction for the same workload and host size.

Run: ``.venv/bin/python benchmarks/bench_forest_replay.py [--users 200] [--gb 8]
[--bytes-per-token 128] [--mooncake PATH] [--mooncake-limit 2000] [--mooncake-gb 128]
[--mooncake-bytes-per-token 32] [--policies bidaw,lru]``.

Two workloads whose conversations share history (:mod:`tieredkv.sim.forest`):

- ``--users`` synthetic conversations sharing a 2,048-token system prompt, 5% of turns
  forking (an edited message or a regenerated answer): :class:`SharedPromptWorkload`;
- the first ``--mooncake-limit`` requests of the Mooncake FAST'25 conversation trace,
  whose requests share 512-token prefix blocks by ``hash_ids`` (every request starts with
  block 0, a common system prompt): :func:`read_mooncake_forest` (skipped if the file is
  absent).

Each is replayed, per policy and host size, through a real :class:`TieredKVCache` (a
:class:`HostMemoryTier` of the host size over an :class:`SSDTier` in a temporary
directory large enough for everything; the cache's clock is the trace's time) in two
modes, and through :func:`~tieredkv.sim.forest.replay_forest` with the same host bytes
and bytes per token:

- *sharing*: the shared prompt (``prompt``, or Mooncake's block 0) is stored first as a
  conversation of its own, and a conversation's first turn is a fork
  (``append(..., parent=, parent_tokens=)``) of the stored conversation whose history
  starts with the longest run of the ranges this turn's history starts with (the prompt;
  a parent's turns up to an edited message; Mooncake blocks with equal ``hash_ids``),
  preferring one served from host memory; only the rest is appended. A fork whose parent
  is served from SSD is stored there with it (the cache's rule), then prefetched into host
  memory, as a turn just computed would be: the simulator admits a first turn to host
  memory likewise;
- *no sharing*: every conversation appends its whole history itself;
- for Mooncake, also *sharing the prompt only*: every conversation forks block 0's
  conversation and nothing else. A fork of another conversation at more blocks lists that
  conversation's whole first turn, which its load reads and which stays in host memory
  while the fork is there: with 8-12k-token first turns, that can hold more than sharing
  saves.

Every turn after a conversation's first loads its history first: a *host hit* when
``cache.where()`` named the host tier before the load (checked against the cache's own
``stats().hits``), and every load is compared byte for byte with what was appended (each
token's bytes are a function of the range it belongs to and its place there, so a load
that came back spliced, short or from another conversation does not match). Then the
turn's new tokens are appended. A first turn counts as neither hit nor miss, as in the
simulator.

Printed per workload: host hit ratio without and with sharing, real and simulated; the
bytes every tier holds at the end against the unique bytes (each distinct range once); and
the bytes the turns take in a tier per raw KV byte (*pages*: a tier keeps each turn in
whole 4 KiB pages, with its header, while the simulator counts raw bytes, so with the
shared-prompt workload's turns of tens of tokens at few bytes per token the real host
holds fewer tokens than the simulated one of the same size), and the simulator's hit
ratio at the host size divided by that factor (*paged*: the simulator holding the tokens
the real host holds).
Host sizes are given as GiB of Llama-3-8B-sized KV (128 KiB per token), scaled to the run's
bytes per token, so ``--gb 8`` holds the tokens that ``bench_forest_sim.py --gb 8`` holds.

Differences from the simulator by design: the real cache shares history only through a
fork made at a conversation's first turn (a later turn of a Mooncake conversation whose
blocks another conversation also lists is stored again; in this trace's first requests
that case does not occur), and a fork point inside a stored turn keeps that whole turn
stored for the fork (the simulator counts the shared tokens only).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import sys
import tempfile
import time
from collections.abc import Hashable, Sequence

import msgspec
import numpy as np
import numpy.typing as npt
import torch

from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.errors import CapacityError
from tieredkv.policies import make_eviction
from tieredkv.sim.forest import (
    Forest,
    Ranges,
    SharedPromptWorkload,
    read_mooncake_forest,
    replay_forest,
)
from tieredkv.sim.synthetic import SyntheticWorkload

MOONCAKE = "/work/shared/traces/mooncake_fast25/conversation_trace.jsonl"
LLAMA3_8B = 128 * 1024
"""KV bytes per token the host sizes (``--gb``) are given in."""
GIB = 1 << 30
HOST = "host"

Piece = tuple[int, int, int]
"""Tokens ``[start, start + n)`` of one content source: ``(source, start, n)``."""

_MIX = np.array([0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB], dtype=np.uint64)


@functools.lru_cache(maxsize=64)
def _source(src: int, tokens: int, lanes: int) -> npt.NDArray[np.uint16]:
    """The content of a source's first ``tokens`` tokens, ``lanes`` 16-bit values each:
    a mix of (source, token, lane), so that no two places share their bytes."""
    pos = np.arange(tokens, dtype=np.uint64)[:, None]
    lane = np.arange(lanes, dtype=np.uint64)[None, :]
    x = np.full((tokens, lanes), src, dtype=np.uint64) * _MIX[0] + pos * _MIX[1] + lane * _MIX[2]
    x ^= x >> np.uint64(31)
    x *= _MIX[1]
    x ^= x >> np.uint64(29)
    out: npt.NDArray[np.uint16] = x.astype(np.uint16)
    out.flags.writeable = False
    return out


class Content:
    """Token bytes of the ranges of a forest: a range key is a source; a source's tokens
    are the same wherever the key is listed (that is what sharing it means)."""

    def __init__(self, bytes_per_token: int) -> None:
        if bytes_per_token < 2 or bytes_per_token % 2:
            raise ValueError(f"bytes per token must be even and >= 2 (got {bytes_per_token})")
        self.lanes = bytes_per_token // 2
        self._ids: dict[Hashable, int] = {}
        self._size: dict[int, int] = {}

    def source(self, key: Hashable, tokens: int) -> int:
        src = self._ids.setdefault(key, len(self._ids))
        self._size[src] = max(self._size.get(src, 0), tokens)
        return src

    def array(self, piece: Piece) -> npt.NDArray[np.uint16]:
        src, start, n = piece
        return _source(src, self._size[src], self.lanes)[start : start + n]

    def tensor(self, pieces: Sequence[Piece]) -> dict[str, torch.Tensor]:
        """The pieces' tokens, joined, as one float16 tensor (its bits are what count)."""
        data = np.concatenate([self.array(p) for p in pieces])
        return {"kv": torch.from_numpy(data.view(np.int16)).view(torch.float16)}

    def matches(self, got: dict[str, torch.Tensor], pieces: Sequence[Piece]) -> bool:
        """Whether ``got`` holds exactly the pieces' tokens, in order."""
        if set(got) != {"kv"}:
            return False
        bits = got["kv"].contiguous().view(torch.int16).numpy().view(np.uint16)
        at = 0
        for p in pieces:
            if not np.array_equal(bits[at : at + p[2]], self.array(p)):
                return False
            at += p[2]
        return bool(bits.shape[0] == at)


def tokens_of(pieces: Sequence[Piece]) -> int:
    return sum(p[2] for p in pieces)


def cut(pieces: Sequence[Piece], n: int) -> list[Piece]:
    """The first ``n`` tokens of a history."""
    out: list[Piece] = []
    for src, start, size in pieces:
        if n <= 0:
            break
        out.append((src, start, min(size, n)))
        n -= size
    return out


def _chain(ranges: Ranges) -> list[int]:
    """One hash per prefix of a range list (its keys only)."""
    out: list[int] = []
    h = 0
    for key, _ in ranges:
        h = hash((h, key))
        out.append(h)
    return out


class RealResult(msgspec.Struct, frozen=True, kw_only=True):
    """One replay through the real cache.

    :param hits: turns after a conversation's first whose history host memory served
    :param misses: the others (served from SSD)
    :param wrong: loads whose bytes differed from what was appended
    :param disagreed: loads where ``where()`` and the cache's hit counter disagreed
    :param held_bytes: bytes every tier held at the end
    :param host_used: bytes host memory held at the end
    :param forks: forks made (sharing)
    :param lifted: forks stored with their parent on SSD, then prefetched
    :param refused: forks the parent's tier could not make room for, stored whole instead
    :param pages: the bytes the turns take in a tier (whole pages, with a header) over
        their raw KV bytes (a fork's first turn not counted)
    :param seconds: the replay's wall time
    """

    hits: int
    misses: int
    wrong: int
    disagreed: int
    held_bytes: int
    host_used: int
    forks: int
    lifted: int
    refused: int
    pages: float
    seconds: float

    @property
    def hit_ratio(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


async def replay_real(
    forest: Forest,
    *,
    policy: str,
    host_bytes: int,
    sharing: bool,
    bytes_per_token: int,
    roots: Sequence[Ranges] = (),
    roots_only: bool = False,
    directory: str,
) -> RealResult:
    """Replay ``forest`` through a real cache (host memory of ``host_bytes`` over SSD in
    ``directory``), forking where a first turn's history starts with a stored one's
    (``sharing``; ``roots`` are stored first as conversations of their own; with
    ``roots_only``, only they are forked) or storing every history whole."""
    content = Content(bytes_per_token)
    turns = forest.turns
    users = turns.user.tolist()
    times = turns.time.tolist()
    rounds = turns.round_index.tolist()
    answers = turns.answer.tolist()
    now = [times[0] if times else 0.0]
    history: dict[str, list[Piece]] = {}  # conversation -> the pieces it holds
    listed: dict[str, Ranges] = {}  # conversation -> the ranges its history starts with
    holders: dict[int, list[str]] = {}  # chained range prefix -> conversations holding it
    rooted = {f"root{i}" for i in range(len(roots))}
    hits = misses = wrong = disagreed = forks = lifted = refused = 0
    stored: dict[str, int] = {}  # conversation -> the bytes its history takes in a tier
    footprint = raw_bytes = 0  # of the turns stored whole (not a fork's first)

    def pieces(ranges: Ranges) -> list[Piece]:
        return [(content.source(k, t), 0, t) for k, t in ranges]

    def hold(key: str, ranges: Ranges, start: int) -> None:
        """``key``'s history now starts with ``ranges``; index its prefixes from ``start``."""
        listed[key] = ranges
        if roots_only and key not in rooted:
            return
        for h in _chain(ranges)[start:]:
            holders.setdefault(h, []).append(key)

    def parent_of(ranges: Ranges, cache: TieredKVCache) -> tuple[str, int] | None:
        """The stored conversation holding the longest prefix of ``ranges``, and that
        prefix's range count: of those, one served from host memory if any, and the
        shortest (the parent stays in its tier while the fork is stored: the fewer bytes
        it holds there, the more room can be made for the fork)."""
        chain = _chain(ranges)
        for k in range(len(chain), 0, -1):
            who = holders.get(chain[k - 1])
            if who:
                best = min(who, key=lambda w: (cache.where(w) != HOST, cache.channel[w].nbytes))
                return best, k
        return None

    t0 = time.perf_counter()
    tiers = [HostMemoryTier(host_bytes), SSDTier(directory, 1 << 40, fsync=False)]
    async with TieredKVCache(
        tiers, eviction=policy, clock=lambda: now[0], output_reuse_bytes=0
    ) as cache:
        if sharing:
            for i, root in enumerate(roots):
                key = f"root{i}"
                history[key] = pieces(root)
                await cache.append(key, content.tensor(history[key]), answer_tokens=0)
                hold(key, root, 0)
        for i, user in enumerate(users):
            now[0] = times[i]
            key = f"u{user}"
            ranges = forest.ranges[i]
            after = sum(t for _, t in ranges)
            if rounds[i]:
                where = cache.where(key)
                before = cache.stats().hits
                got = await cache.load(key)
                hit = where == HOST
                hits += hit
                misses += not hit
                disagreed += (cache.stats().hits - before) != hit
                wrong += not content.matches(got, history[key])
                del got
                old = listed[key]
                have = tokens_of(history[key])
                if ranges[: len(old)] == old and sum(t for _, t in old) == have:
                    new = pieces(ranges[len(old) :])  # the history grows by whole ranges
                    hold(key, ranges, len(old))
                else:  # its ranges are re-cut (Mooncake's blocks): new tokens of its own
                    new = [(content.source(("own", key, rounds[i]), after - have), 0, after - have)]
                history[key].extend(new)
                meta = await cache.append(key, content.tensor(new), answer_tokens=answers[i])
                footprint += meta.nbytes - stored[key]  # this turn's bytes in its tier
                raw_bytes += tokens_of(new) * bytes_per_token
                stored[key] = meta.nbytes
                continue
            whole = pieces(ranges)
            found = parent_of(ranges[:-1], cache) if sharing else None
            history[key] = whole
            if found is not None:
                parent, k = found
                try:
                    meta = await cache.append(
                        key,
                        content.tensor(whole[k:]),
                        answer_tokens=answers[i],
                        parent=parent,
                        parent_tokens=sum(t for _, t in ranges[:k]),
                    )
                except CapacityError:  # the parent's tier cannot make room for it
                    refused += 1
                    found = None
                else:
                    forks += 1
                    if cache.where(key) != HOST:
                        lifted += 1
                        await cache.prefetch(key)
            if found is None:
                meta = await cache.append(key, content.tensor(whole), answer_tokens=answers[i])
                footprint += meta.nbytes
                raw_bytes += tokens_of(whole) * bytes_per_token
            stored[key] = meta.nbytes
            hold(key, ranges, 0)
        stats = cache.stats()
        return RealResult(
            hits=hits,
            misses=misses,
            wrong=wrong,
            disagreed=disagreed,
            held_bytes=sum(t.used for t in stats.tiers),
            host_used=stats.tiers[0].used,
            forks=forks,
            lifted=lifted,
            refused=refused,
            pages=footprint / max(1, raw_bytes),
            seconds=time.perf_counter() - t0,
        )


async def report(
    name: str,
    forest: Forest,
    *,
    roots: Sequence[Ranges],
    sizes: Sequence[float],
    policies: Sequence[str],
    bytes_per_token: int,
    where: str | None,
    prompt_only: bool = False,
) -> int:
    """Print the comparison for one workload (``prompt_only``: also with forks of the
    roots only); the number of wrong or disagreeing loads."""
    turns = forest.turns
    unique = forest.unique_tokens() * bytes_per_token
    total = forest.total_tokens() * bytes_per_token
    print(
        f"\n== {name}: {len(turns):,} turns, {turns.users():,} conversations, "
        f"{int((turns.round_index > 0).sum()):,} returning; {bytes_per_token} B/token; unique "
        f"{unique / 2**20:,.1f} MiB, histories added up "
        f"{total / 2**20:,.1f} MiB"
    )
    print(
        f"{'host GiB*':>9} {'MiB':>7} {'policy':<6} {'real off':>8} {'real on':>8} "
        f"{'sim off':>8} {'sim on':>8} {'paged off':>9} {'paged on':>8} "
        f"{'held/unique off':>15} {'on':>6} {'pages off':>9} {'on':>6} "
        f"{'forks':>6} {'lifted':>6} {'refused':>7} {'on, prompt':>10} {'s':>6}"
    )
    modes = {"off": (False, False), "on": (True, False)}
    if prompt_only:
        modes["prompt"] = (True, True)
    bad = 0
    for gb in sizes:
        host = int(gb * GIB / LLAMA3_8B * bytes_per_token)
        for policy in policies:
            real: dict[str, RealResult] = {}
            sim: dict[bool, float] = {}
            paged: dict[bool, float] = {}
            for mode, (sharing, only) in modes.items():
                with tempfile.TemporaryDirectory(prefix="bench-forest-replay-", dir=where) as d:
                    r = real[mode] = await replay_real(
                        forest,
                        policy=policy,
                        host_bytes=host,
                        sharing=sharing,
                        bytes_per_token=bytes_per_token,
                        roots=roots,
                        roots_only=only,
                        directory=d,
                    )
                if not only:
                    s = replay_forest(forest, make_eviction(policy), host_bytes=host,
                                      sharing=sharing, bytes_per_token=bytes_per_token)  # fmt: skip
                    sim[sharing] = s.replay.hit_ratio
                    assert r.hits + r.misses == s.replay.accesses, (r, s.replay)
                    s = replay_forest(forest, make_eviction(policy),
                                      host_bytes=int(host / r.pages), sharing=sharing,
                                      bytes_per_token=bytes_per_token)  # fmt: skip
                    paged[sharing] = s.replay.hit_ratio
                bad += r.wrong + r.disagreed
                if r.wrong or r.disagreed:
                    print(f"  {mode}: {r.wrong} loads WRONG, {r.disagreed} hit counts differ")
            off, on = real["off"], real["on"]
            prompt = f"{real['prompt'].hit_ratio:>10.4f}" if prompt_only else f"{'-':>10}"
            print(
                f"{gb:>9g} {host / 2**20:>7.1f} {policy:<6} {off.hit_ratio:>8.4f} "
                f"{on.hit_ratio:>8.4f} {sim[False]:>8.4f} {sim[True]:>8.4f} "
                f"{paged[False]:>9.4f} {paged[True]:>8.4f} "
                f"{off.held_bytes / unique:>15.3f} {on.held_bytes / unique:>6.3f} "
                f"{off.pages:>9.3f} {on.pages:>6.3f} {on.forks:>6} {on.lifted:>6} {on.refused:>7} "
                f"{prompt} {sum(r.seconds for r in real.values()):>6.1f}"
            )
    return bad


async def main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    policies = args.policies.split(",")
    prompt = SharedPromptWorkload(
        base=SyntheticWorkload(users=args.users, arrival_rate=0.2, seed=args.seed),
        prompt_tokens=2048,
        fork_fraction=0.05,
    )
    print(
        "host GiB*: GiB of Llama-3-8B-sized KV (128 KiB/token) at the host size, scaled to "
        "the run's bytes per token (MiB: the real host tier's size); real/sim off/on: host hit "
        "ratio of the turns after a conversation's first, without/with sharing; held/unique: "
        "bytes all tiers hold at the end over the unique bytes; pages off/on: the bytes the "
        "turns take in a tier over their raw KV bytes (whole 4 KiB pages with a header; the "
        "simulator counts raw bytes); paged off/on: the simulator with the host size divided "
        "by pages (so that it holds the tokens the real host holds); lifted: forks "
        "stored on SSD with their parent, then prefetched; refused: forks the parent's tier "
        "could not make room for, stored whole; on, prompt: real host hit ratio with forks "
        "of the shared prompt only (Mooncake)"
    )
    bad = await report(
        f"shared prompt ({args.users} conversations, 2,048-token prompt, 5% of turns fork)",
        prompt.generate(),
        roots=[(("prompt", prompt.prompt_tokens),)],
        sizes=[float(g) for g in args.gb.split(",")],
        policies=policies,
        bytes_per_token=args.bytes_per_token,
        where=args.dir,
    )
    if await asyncio.to_thread(os.path.exists, args.mooncake):
        bad += await report(
            f"Mooncake conversation trace, first {args.mooncake_limit:,} requests",
            read_mooncake_forest(args.mooncake, limit=args.mooncake_limit),
            roots=[((("block", 0), 512),)],
            prompt_only=True,
            sizes=[float(g) for g in args.mooncake_gb.split(",")],
            policies=policies,
            bytes_per_token=args.mooncake_bytes_per_token,
            where=args.dir,
        )
    else:
        print(f"\n(no Mooncake trace at {args.mooncake}: skipped)")
    print(f"\nloads byte-checked: {'all equal' if not bad else f'{bad} WRONG or miscounted'}")
    print(f"took {time.perf_counter() - t0:.1f} s")
    return 1 if bad else 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--users", type=int, default=200, help="shared-prompt conversations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gb", default="8", help="host sizes for the shared prompt, GiB*")
    p.add_argument("--bytes-per-token", type=int, default=128)
    p.add_argument("--mooncake", default=MOONCAKE, help="conversation_trace.jsonl")
    p.add_argument("--mooncake-limit", type=int, default=2000, help="requests replayed")
    p.add_argument("--mooncake-gb", default="128", help="host sizes for Mooncake, GiB*")
    p.add_argument("--mooncake-bytes-per-token", type=int, default=32)
    p.add_argument("--policies", default="bidaw,lru")
    p.add_argument(
        "--dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="where the SSD tier's temporary directory goes (default: /dev/shm, a tmpfs)",
    )
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
