"""A short demonstration: a two-tier cache taking and serving a few conversations.

Run it with ``tieredkv demo``. Each turn of each conversation loads the history (promoting
it from SSD when it was demoted), checks it byte for byte against what was appended, and
appends the turn's new KV. The host tier is deliberately small, so conversations move
between host memory and SSD as they take turns.
"""

from __future__ import annotations

import contextlib
import functools
import math
import shutil
import tempfile
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import numpy as np
import torch

from .backends.base import Tier
from .backends.memory import HostMemoryTier
from .backends.ssd import SSDTier
from .cache import TieredKVCache
from .sim.progress import ProgressBar

__all__ = ["LONG_STEPS", "WIDE", "run_demo"]

WIDE = 20
"""Above this many conversations a row names where its own conversation is, not every
conversation's place, and a count per tier ends the run."""
LONG_STEPS = 100
"""Turns (conversations x turns) from which the demo shows its progress and time left."""

_LAYERS, _HEADS, _HEAD_DIM = 4, 8, 64  # a small model's KV: 4 KiB per token in fp16


def _turn_kv(rng: np.random.Generator, tokens: int) -> dict[str, torch.Tensor]:
    shape = (_LAYERS, 2, _HEADS, tokens, _HEAD_DIM)
    kv = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(torch.float16)
    return {"kv": kv}


async def run_demo(
    conversations: int = 5,
    turns: int = 4,
    host_bytes: int = 6 << 20,
    directory: Path | None = None,
    seed: int = 0,
    keep: bool = False,
    echo: bool = True,
    metrics_port: int | None = None,
    linger: float = 0.0,
    progress: bool = True,
) -> dict[str, int]:
    """Run the demo; return the cache's hit/miss counters.

    :param conversations: concurrent conversations
    :param turns: turns per conversation
    :param host_bytes: the host tier's budget (small, to force demotions)
    :param directory: the SSD tier's directory (new or empty); ``None``: a temporary
        directory, removed at the end
    :param keep: say at the end that ``directory`` keeps the SSD tier's files (for
        ``tieredkv fsck`` or ``inspect``)
    :param seed: seed of the synthetic KV and turn lengths
    :param echo: print the tables
    :param metrics_port: serve the cache's Prometheus metrics on this port (``0``: any free
        one) during the demo (needs ``tieredkv[metrics]``); the URL is printed
    :param progress: with ``echo``, draw a progress bar with the time left on standard error
        for a demo of :data:`LONG_STEPS` turns or more
    :param linger: seconds to keep the cache open and its metrics served after the run
        (``math.inf``: until cancelled, e.g. by Ctrl-C)
    """
    say = print if echo else (lambda *a, **k: None)
    rng = np.random.default_rng(seed)
    history: dict[str, list[torch.Tensor]] = {}
    steps = conversations * turns
    # a long demo: the time left, on standard error
    bar = ProgressBar("tieredkv demo", enabled=echo and progress and steps >= LONG_STEPS)
    async with _ssd_directory(directory) as where:
        ssd = SSDTier(where, 256 << 20)
        tiers: list[Tier] = [HostMemoryTier(host_bytes), ssd]
        async with (
            TieredKVCache(tiers, token_dim=3) as cache,
            _metrics(cache, metrics_port) as url,
        ):
            if url is not None:
                say(f"Prometheus metrics: {url}")
            say(
                f"host tier {host_bytes:,} B ({cache.stats().tiers[0].notes[0]}), SSD tier "
                f"at {where} (O_DIRECT: {ssd.direct_io})\n"
            )
            say(f"{'turn':>4}  {'conversation':<12} {'tokens':>6}  {'history from':<12}  where now")
            # conversations take turns in a random order, like users who think between turns
            order = [c for _ in range(turns) for c in range(conversations)]
            rng.shuffle(order)
            done = dict.fromkeys(range(conversations), 0)
            for step, c in enumerate(order, 1):
                turn = done[c]
                done[c] += 1
                session = f"conversation-{c}"
                came_from = cache.where(session) or "-"
                if session in cache:
                    loaded = await cache.load(session)
                    expected = torch.cat(history[session], dim=3)
                    if not torch.equal(loaded["kv"], expected):  # pragma: no cover
                        raise AssertionError(f"{session}: history differs from what was stored")
                query, answer = int(rng.integers(20, 60)), int(rng.integers(20, 80))
                kv = _turn_kv(rng, query + answer)
                stored = history.setdefault(session, [])
                before = sum(t.shape[3] for t in stored)  # the history this turn extends
                stored.append(kv["kv"])
                meta = await cache.append(session, kv, answer_tokens=answer, expected_tokens=before)
                if conversations <= WIDE:
                    placement = "  ".join(
                        f"c{i}:{(cache.where(f'conversation-{i}') or '-')[:4]}"
                        for i in range(conversations)
                    )
                else:  # a cell per conversation would make each row thousands wide
                    placement = cache.where(session) or "-"
                say(f"{turn:>4}  {session:<12} {meta.tokens:>6}  {came_from:<12}  {placement}")
                bar(step / steps)
            bar.close()
            if conversations > WIDE:
                count = Counter(
                    cache.where(f"conversation-{i}") or "evicted" for i in range(conversations)
                )
                say(
                    f"\nwhere the {conversations:,} conversations are: "
                    + ", ".join(f"{name} {n:,}" for name, n in sorted(count.items()))
                )
            stats = cache.stats()
            say(
                f"\nloads: {stats.loads}  host hits: {stats.hits}  misses (served from SSD): "
                f"{stats.misses}  hit ratio: {stats.hit_ratio:.0%}"
            )
            say(
                f"promotions: {stats.promotions}  demotions: {stats.demotions}  "
                f"evictions: {stats.evictions}  lost: {stats.lost}"
            )
            for t in stats.tiers:
                say(
                    f"  {t.name:<5} used {t.used:>10,} / {t.capacity:>11,} B  "
                    f"segments {t.segments:>3}  "
                    f"read {t.bytes_read:>11,} B  written {t.bytes_written:>11,} B"
                )
            say("\nevery load matched what was appended, byte for byte")
            if url is not None and linger > 0:
                until = "until Ctrl-C" if math.isinf(linger) else f"for {linger:g} s"
                say(f"serving the metrics at {url} {until}", flush=True)
                await anyio.sleep(linger)
        if keep:  # after the close, which wrote host memory's conversations down
            closed = cache.stats()
            unsaved = f"; {closed.unsaved:,} did not fit and are lost" if closed.unsaved else ""
            say(
                f"the SSD tier's files are kept in {where}: closing the cache wrote the "
                f"{closed.written_down:,} conversation(s) only host memory held down to the "
                f"SSD tier{unsaved} (a crash instead of a close loses those); check them: "
                f"tieredkv fsck {where}"
            )
        return {"hits": stats.hits, "misses": stats.misses, "loads": stats.loads}


@contextlib.asynccontextmanager
async def _ssd_directory(directory: Path | None) -> AsyncIterator[Path]:
    """``directory``, or a temporary one removed afterwards (made and removed in a worker
    thread: the event loop never waits for the file system)."""
    if directory is not None:
        yield directory
        return
    tmp = await anyio.to_thread.run_sync(
        functools.partial(tempfile.mkdtemp, prefix="tieredkv-demo-")
    )
    try:
        yield Path(tmp) / "ssd"
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(
                functools.partial(shutil.rmtree, tmp, ignore_errors=True)
            )


@contextlib.asynccontextmanager
async def _metrics(cache: TieredKVCache, port: int | None) -> AsyncIterator[str | None]:
    """Serve the cache's metrics on ``port`` while the block runs; yields the URL."""
    if port is None:
        yield None
        return
    from .metrics import serve

    async with serve(cache, port) as server:
        yield server.url


def main() -> None:
    """Entry point of ``tieredkv demo``."""
    anyio.run(run_demo)
