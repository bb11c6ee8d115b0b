"""What a cache keeps of each conversation it has lost: a diagnostic for a long-running
server whose last tier evicts (every conversation it evicts from there is lost).

A cache with one host tier that holds a few turns appends ``--conversations`` new
conversations of one small turn each; each new one evicts an older one, which is lost.
It prints how many entries the metadata channel, the cache's index of sessions and its
record of losses not yet reported (``HistoryLostError``) hold afterwards, and the Python
memory (``tracemalloc``) the run left allocated per lost conversation, by file.

The records are kept on purpose: the channel's record (``tier`` None) tells a caller the
history is gone, and the record of an unreported loss makes the next append raise
``HistoryLostError`` instead of storing a turn as a history without its start. The index
entry of a lost conversation goes once nothing uses it (``Core.discard_lost``, 6 December
2026: 1,892 bytes per lost conversation before, 484 after). What this measures is their
cost when nobody asks about those conversations again, and with ``--max-lost-records N``
(the cache's ``max_lost_records``) what the bound leaves::

    PYTHONPATH=src .venv/bin/python benchmarks/_lost_records.py [--conversations 10000]
        [--max-lost-records N]
"""

from __future__ import annotations

import argparse
import gc
import tracemalloc

import anyio
import torch

from tieredkv import HostMemoryTier, TieredKVCache


async def run(conversations: int, max_lost_records: int | None) -> None:
    turn = {"k": torch.zeros(16, 64)}
    tiers = [HostMemoryTier(64 << 10)]
    async with TieredKVCache(tiers, max_lost_records=max_lost_records) as cache:
        for i in range(1000):  # the cache's own structures grown first
            await cache.append(f"warm-{i}", turn, answer_tokens=3)
        gc.collect()
        tracemalloc.start(1)
        before = tracemalloc.take_snapshot()
        for i in range(conversations):
            await cache.append(f"conversation-{i:08d}", turn, answer_tokens=3)
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        core = cache._core
        stats = cache.stats()
        print(
            f"{conversations:,} conversations appended, {stats.lost:,} lost in all: the "
            f"channel holds {len(cache.channel):,} records, the index {len(core.sessions):,} "
            f"sessions, the unreported losses {len(core.unreported):,} (max_lost_records "
            f"{max_lost_records}: {stats.lost_records_forgotten:,} records let go)"
        )
        diffs = after.compare_to(before, "filename")
        total = sum(s.size_diff for s in diffs)
        print(f"Python memory left allocated: {total / conversations:,.0f} bytes per conversation")
        for s in diffs[:6]:
            if s.size_diff > 0:
                print(f"  {s.size_diff / conversations:8,.0f} B  {s.traceback[0].filename}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=10_000)
    ap.add_argument("--max-lost-records", type=int, default=None)
    args = ap.parse_args(argv)
    anyio.run(run, args.conversations, args.max_lost_records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
