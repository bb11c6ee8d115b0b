"""A parent's retirement on a replica while a fork's load there records the parent as
retired and writes its marker meanwhile (:func:`tieredkv._cache.forest.retire`), against a
real redis-server and a real SSD tier.

Retirement writes its markers tier by tier, top down. The record a fork's load makes
meanwhile (the fork lists a turn of the parent this replica never listed) gets its marker
only through the fork's copy into a local tier; so the interleaving needs a local tier
below the tier whose marker the retirement is writing: here Redis above SSD. The
retirement waits for the marker the fork's copy is writing (or has written) in SSD and
takes it over; it used to write a second one there, which failed with a ``ValueError``
(``already holds or reserves``) and failed the drop.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.integration.test_redis_forks import (
    CAPACITY,
    FORK,
    P0,
    P1,
    SMALL_VALUES,
    _cache,
    _cat,
    _cut,
    _forked_on_b_then_extended_on_a,
    _kv,
    _MarkerGate,
    _same,
)
from tests.invariants import unowned
from tests.redis_server import RedisServer, new_prefix, redis_server
from tieredkv import TieredKVCache
from tieredkv.backends.base import SegmentKey
from tieredkv.backends.redis import RedisTier
from tieredkv.backends.ssd import segment_file_name
from tieredkv.payload import RETIRED_SEQ

__all__ = ["redis_server"]  # fixtures used below

MARKER: SegmentKey = ("p", RETIRED_SEQ)


class _GatedMarkers(RedisTier):
    """A Redis tier whose writes of retirement markers wait for :attr:`go` once
    :attr:`hold` is set (:attr:`waiting` says one does)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold = False
        self.waiting = anyio.Event()
        self.go = anyio.Event()

    async def _gate(self, key: SegmentKey) -> None:
        if self.hold and key[1] == RETIRED_SEQ:
            self.waiting.set()
            await self.go.wait()

    async def write(self, key: SegmentKey, data: memoryview) -> None:
        await self._gate(key)
        await super().write(key, data)

    async def write_pieces(
        self, key: SegmentKey, pieces: Sequence[memoryview], *args: Any, **kwargs: Any
    ) -> None:
        await self._gate(key)
        await super().write_pieces(key, pieces, *args, **kwargs)


def _markers_on_disk(root: Path) -> list[Path]:
    """Every file of the SSD tier at ``root`` that is (or would become) a retirement
    marker: committed, or still being written."""
    return sorted(p for p in root.rglob("*") if p.is_file() and f".{RETIRED_SEQ}." in p.name)


@pytest.mark.parametrize("meanwhile", ["written", "writing"])
async def test_a_retirement_takes_over_the_marker_a_forks_load_wrote_meanwhile(
    redis_server: RedisServer, tmp_path: Path, meanwhile: str
) -> None:
    """B (Redis, then SSD) took in A's ``p`` and forked ``g`` from it (``p``'s turn is in
    SSD too); A then extended ``p`` and forked ``c`` from its second turn. B drops ``p``
    (``g`` lists its turn): the retirement writes ``p``'s marker into Redis, held there.
    Meanwhile B loads ``c``, which lists ``p``'s second turn, never listed by B: B records
    ``p`` as retired (a second record), and ``c``'s copy into SSD writes ``p``'s marker
    there for that record; the copy's marker is written (``written``) or still being
    written (``writing``) when the retirement goes on to SSD. The retirement waits for it
    and takes it over: the drop succeeds, each tier holds one marker of ``p`` (one file in
    SSD), ``p`` is gone from B, and ``g`` and ``c`` are served byte for byte on B, on A,
    and on B restarted over the same SSD, and ``p`` (B's drop let go of B's copies only:
    A is its writer) on A and on the restarted B. Without the take-over the drop wrote a
    second marker into SSD: ``ValueError``."""
    prefix = new_prefix()
    G, C3 = _kv(4, 8), _kv(3, 8)
    root = tmp_path / "ssd"
    ssd = _MarkerGate(root, 8 << 20)
    shared = _GatedMarkers(
        redis_server.url, CAPACITY, prefix=prefix, value_size=SMALL_VALUES, lease_ttl=0.3
    )
    async with _cache(redis_server, prefix) as a:
        async with TieredKVCache([shared, ssd], mode="inclusive") as b:
            await _forked_on_b_then_extended_on_a(a, b, G)
            assert sorted(ssd.keys()) == [("g", 1), ("p", 0)]  # (the drop marks SSD too)
            shared.hold = True
            ssd.hold = meanwhile == "writing"
            try:
                with anyio.fail_after(20):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(b.drop, "p")
                        await shared.waiting.wait()  # (the retirement writes p's marker in Redis)
                        assert _same(await b.load("c"), FORK)  # (p recorded as retired again)
                        await b.append("c", C3, answer_tokens=1)  # (its copy into SSD: p's turn)
                        if meanwhile == "writing":
                            await ssd.waiting.wait()
                        else:
                            await b.flush()  # (c's copy into SSD is done)
                            assert ssd.contains(MARKER)
                        shared.go.set()
                        await anyio.sleep(0.2)  # (the retirement waits for the copy's marker)
                        ssd.go.set()
            finally:
                shared.go.set()  # (a failure does not leave a write waiting)
                ssd.go.set()
            await b.flush()
            assert b.stats().errors == 0
            assert unowned(b) == []
            assert not b.contains("p")
            assert sorted(ssd.keys()) == [("c", 2), ("c", 3), ("g", 1), ("p", 0), ("p", 1), MARKER]
            assert _markers_on_disk(root) == [root / "segments" / segment_file_name(MARKER)]
            assert shared.contains(MARKER)  # (Redis: in this replica's index only)
            with redis_server.client() as client:
                assert not list(client.scan_iter(match=f"{prefix}:*:{RETIRED_SEQ}:*"))
            assert _same(await b.load("g"), _cat(_cut(P0, 20), G))
            assert _same(await b.load("c"), _cat(FORK, C3))
        assert _same(await a.load("c"), _cat(FORK, C3))
        assert _same(await a.load("p"), _cat(P0, P1))  # (B's drop: its own copies only)
        restarted = RedisTier(
            redis_server.url, CAPACITY, prefix=prefix, value_size=SMALL_VALUES, lease_ttl=0.3
        )
        async with TieredKVCache([restarted, _MarkerGate(root, 8 << 20)], mode="inclusive") as b:
            assert not b.contains("p")
            assert _same(await b.load("g"), _cat(_cut(P0, 20), G))
            assert _same(await b.load("c"), _cat(FORK, C3))
            assert _same(await b.load("p"), _cat(P0, P1))
