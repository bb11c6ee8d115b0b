"""The child process of test_crash_recovery: appends deterministic segments until killed.

Run as ``python crash_writer.py DIR MODE SEED [--wait]`` (``--wait``: once its imports are
done, it waits for a line on stdin before it touches ``DIR``, so that a test can start it
while it still checks what the previous writer left). It opens a cache on ``DIR`` (``ssd``: SSD
only, so an append is durable when it returns; ``inclusive``: host memory + SSD with
write-through), continues every session from the turns it recovered, and appends forever,
printing ``acked <session> <seq>`` (flushed) after each append returns. The segment for
``(session, seq)`` depends on nothing else, so the parent can recompute every byte.
"""

from __future__ import annotations

import math
import random
import sys
import zlib
from pathlib import Path

import anyio
import torch

from tieredkv import HostMemoryTier, SSDTier, Tier, TieredKVCache

SESSIONS = ("alpha", "beta/../gamma", "δέλτα")
SSD_CAPACITY = 1 << 30
HOST_CAPACITY = 6 << 20
TOKEN_BYTES = 2 * 4 * 64 * 2  # k and v, (tokens, 4, 64) int16


def tensors_for(session: str, seq: int) -> dict[str, torch.Tensor]:
    """The segment appended as turn ``seq`` of ``session``: 3 to 3000 tokens (4 KiB to 3 MB)."""
    seed = zlib.crc32(f"{session}\x00{seq}".encode())
    tokens = int(math.exp(random.Random(seed).uniform(math.log(3), math.log(3000))))
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randint(-(2**15), 2**15, (tokens, 4, 64), dtype=torch.int16, generator=gen)
        for name in ("k", "v")
    }


def make_cache(directory: Path, mode: str) -> TieredKVCache:
    """The cache both the child and the checking parent open on ``directory``."""
    ssd = SSDTier(directory, SSD_CAPACITY)
    if mode == "ssd":
        return TieredKVCache([ssd])
    tiers: list[Tier] = [HostMemoryTier(HOST_CAPACITY, pin=False), ssd]
    return TieredKVCache(tiers, mode="inclusive")


async def run(directory: Path, mode: str, seed: int) -> None:
    rng = random.Random(seed)
    async with make_cache(directory, mode) as cache:
        turns = {}
        for session in SESSIONS:
            meta = cache.channel.get(session)
            turns[session] = meta.turns if meta is not None else 0
        print("ready " + " ".join(str(turns[s]) for s in SESSIONS), flush=True)
        while True:
            session = rng.choice(SESSIONS)
            seq = turns[session]
            await cache.append(session, tensors_for(session, seq), answer_tokens=seq)
            turns[session] = seq + 1
            print(f"acked {SESSIONS.index(session)} {seq}", flush=True)


if __name__ == "__main__":
    if sys.argv[4:] == ["--wait"]:
        sys.stdin.readline()
    anyio.run(run, Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
