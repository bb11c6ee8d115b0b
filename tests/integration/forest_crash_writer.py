"""The child process of test_forest_crash: forks, appends and drops until killed.

Run as ``python forest_crash_writer.py DIR SEED``. It opens an SSD-only cache on ``DIR``
(an operation is durable when it returns) and runs the operations :func:`script` draws
from ``SEED``, printing ``acked N`` after operation ``N`` returns. Everything an operation
stores depends on ``(SEED, N)`` only, so the parent recomputes every byte (:func:`model`).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import anyio
import torch

from tieredkv import SSDTier, TieredKVCache

CAPACITY = 1 << 30

Parts = list[dict[str, torch.Tensor]]


def turn(seed: int, n: int) -> dict[str, torch.Tensor]:
    """Operation ``n``'s turn: 3 to 300 tokens of 1 KiB."""
    g = torch.Generator().manual_seed(seed * 100_003 + n)
    tokens = int(torch.randint(3, 301, (1,), generator=g))
    return {
        name: torch.randint(-(2**15), 2**15, (tokens, 4, 64), dtype=torch.int16, generator=g)
        for name in ("k", "v")
    }


def script(seed: int, count: int) -> list[tuple[str, str, str | None, int]]:
    """``count`` operations: ``(kind, key, parent, parent_tokens)``, kind ``append``,
    ``fork`` or ``drop``, each valid after those before it."""
    rng = random.Random(seed)
    live: dict[str, int] = {}  # key -> tokens
    out: list[tuple[str, str, str | None, int]] = []
    for n in range(count):
        kind = rng.choice(["append", "append", "fork", "fork", "drop"]) if len(live) > 1 else ""
        tokens = int(turn(seed, n)["k"].shape[0])
        if kind == "drop":
            key = rng.choice(sorted(live))
            del live[key]
            out.append(("drop", key, None, 0))
        elif kind == "fork":
            parent = rng.choice(sorted(live))
            at = rng.randint(1, live[parent])
            key = f"c{n}"
            live[key] = at + tokens
            out.append(("fork", key, parent, at))
        elif kind == "append":
            key = rng.choice(sorted(live))
            live[key] += tokens
            out.append(("append", key, None, 0))
        else:
            key = f"c{n}"
            live[key] = tokens
            out.append(("append", key, None, 0))
    return out


def model(seed: int, ops: list[tuple[str, str, str | None, int]]) -> dict[str, Parts]:
    """What is stored after ``ops``: each live conversation's history, as parts."""
    live: dict[str, Parts] = {}
    for n, (kind, key, parent, at) in enumerate(ops):
        if kind == "drop":
            del live[key]
        elif kind == "fork":
            assert parent is not None
            live[key] = [*_prefix(live[parent], at), turn(seed, n)]
        else:
            live.setdefault(key, []).append(turn(seed, n))
    return live


def _prefix(parts: Parts, n: int) -> Parts:
    out: Parts = []
    for p in parts:
        if n <= 0:
            break
        size = p["k"].shape[0]
        out.append(p if size <= n else {k: v[:n] for k, v in p.items()})
        n -= size
    return out


async def run(directory: Path, seed: int) -> None:
    async with TieredKVCache([SSDTier(directory, CAPACITY)]) as cache:
        print("ready", flush=True)
        for n, (kind, key, parent, at) in enumerate(script(seed, 10_000)):
            if kind == "drop":
                await cache.drop(key)
            elif kind == "fork":
                await cache.append(
                    key, turn(seed, n), answer_tokens=1, parent=parent, parent_tokens=at
                )
            else:
                await cache.append(key, turn(seed, n), answer_tokens=1)
            print(f"acked {n}", flush=True)


if __name__ == "__main__":
    anyio.run(run, Path(sys.argv[1]), int(sys.argv[2]))
