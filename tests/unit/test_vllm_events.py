"""The connector's KV events below the engine: a turn's blocks announced in host memory
when stored, in a lower tier when the cache reports a copy there, removed from a tier it
leaves and from every tier when the conversation is gone. Builds vLLM's event objects
(imports vLLM: slow)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from tieredkv.integrations.vllm.events import KVEvents
from tieredkv.integrations.vllm.ops import WorkerReport
from tieredkv.meta import KVMeta

pytestmark = pytest.mark.slow


def meta(session: str, *copies: str) -> bytes:
    m = KVMeta(session=session, tier=copies[0], copies=copies, nbytes=1, tokens=8)
    return msgspec.msgpack.encode(m)


def summary(events: list[Any]) -> list[tuple[Any, ...]]:
    out = []
    for e in events:
        kind = type(e).__name__
        parent = getattr(e, "parent_block_hash", None)
        out.append((kind, e.medium, e.ownership, list(e.block_hashes), parent))
    return out


def test_events_follow_stores_copies_and_evictions() -> None:
    ev = KVEvents(block_size=2)
    ev.finishing("r1", [11, 12, 13], [1, 2, 3, 4, 5, 6, 7])
    ev.update(WorkerReport(stored=[("r1", "s", 2, True)], metas={"s": meta("s", "host")}))
    assert summary(ev.take()) == [("BlockStored", "CPU", "host", [11, 12], None)]
    ev.update(WorkerReport(metas={"s": meta("s", "host", "ssd")}))  # the SSD copy landed
    assert summary(ev.take()) == [("BlockStored", "STORAGE", "ssd", [11, 12], None)]
    # the next turn: its new block in host memory; the SSD copy is outdated, then redone
    ev.finishing("r2", [11, 12, 13, 14], list(range(9)))
    ev.update(WorkerReport(stored=[("r2", "s", 3, True)], metas={"s": meta("s", "host")}))
    assert summary(ev.take()) == [
        ("BlockStored", "CPU", "host", [13], 12),
        ("BlockRemoved", "STORAGE", "ssd", [11, 12], None),
    ]
    ev.update(WorkerReport(metas={"s": meta("s", "ssd")}))  # evicted from host memory
    assert summary(ev.take()) == [
        ("BlockRemoved", "CPU", "host", [11, 12, 13], None),
        ("BlockStored", "STORAGE", "ssd", [11, 12, 13], None),
    ]
    ev.update(WorkerReport(gone={"s"}))
    assert summary(ev.take()) == [("BlockRemoved", "STORAGE", "ssd", [11, 12, 13], None)]
    # a failed save, or another conversation's blocks, announce nothing
    ev.finishing("r3", [21, 22], [1, 2, 3, 4])
    ev.update(WorkerReport(stored=[("r3", "t", 2, False)]))
    assert ev.take() == []
    assert ev.take() == []
