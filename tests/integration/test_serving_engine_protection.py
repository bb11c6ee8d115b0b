"""The serving loop protects the running turn's KV from eviction, between its load and its
append, with a stub model (no transformers) that takes a while to compute each turn."""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from pathlib import Path

import anyio
import torch

from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.meta import Event, KVMeta, MetadataView, Stored
from tieredkv.policies import BidawScheduler
from tieredkv.serve import ServingEngine, TurnRequest


def kv(tokens: int) -> dict[str, torch.Tensor]:
    return {"k": torch.zeros(tokens, 64), "v": torch.zeros(tokens, 64)}


SEGMENT = 128 * 2 * 64 * 4  # one session's KV: kv(128), fp32


class MostRecentlyUsed:
    """Evicts the most recently accessed resident first: the running session is the first
    candidate, unless the engine protects it."""

    name = "mru"

    def __init__(self) -> None:
        self.order: dict[str, None] = {}  # every session seen, oldest access first
        self.resident: dict[str, int] = {}  # resident session -> bytes

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        self.order.pop(session, None)
        self.order[session] = None

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        self.resident[session] = meta.nbytes
        self.order.setdefault(session, None)

    def on_remove(self, session: str) -> None:
        self.resident.pop(session, None)

    def victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str] = frozenset()
    ) -> list[str] | None:
        chosen: list[str] = []
        freed = 0
        for session in reversed(self.order):
            if freed >= need:
                break
            if session in self.resident and session not in protected:
                chosen.append(session)
                freed += self.resident[session]
        return chosen if freed >= need else None

    def __len__(self) -> int:
        return len(self.resident)

    def resident_bytes(self) -> int:
        return sum(self.resident.values())


@dataclass(frozen=True)
class StubResult:
    answer: tuple[int, ...]
    restored_tokens: int
    recomputed_tokens: int = 0


class SlowAdapter:
    """``chat_turn``: restore the history, "compute" for 0.3 s, store the turn's KV."""

    token_dim = 0

    async def chat_turn(
        self,
        cache: TieredKVCache,
        session: str,
        query: list[int],
        *,
        max_new_tokens: int,
        history: list[int],
    ) -> StubResult:
        restored = (await cache.load(session))["k"].shape[0] if session in cache else 0
        await anyio.sleep(0.3)
        await cache.append(session, kv(len(query) + max_new_tokens), answer_tokens=max_new_tokens)
        return StubResult(answer=(0,) * max_new_tokens, restored_tokens=restored)


async def test_a_prefetch_never_evicts_the_running_sessions_kv(ssd_dir: Path) -> None:
    """Another request's prefetch, while a turn computes, must not evict the running
    session: its new segment then went to the SSD instead of joining its history in host
    memory."""
    policy = MostRecentlyUsed()
    tiers = [HostMemoryTier(2 * SEGMENT + 16384), SSDTier(ssd_dir, 1 << 24)]
    async with TieredKVCache(tiers, eviction=policy, mode="inclusive") as cache:
        for session in ("a", "c", "b"):  # b's append evicts c (MRU): host holds a and b
            await cache.append(session, kv(128), answer_tokens=1)
            await cache.flush()  # write-through done: the session may be evicted
        assert cache.where("a") == cache.where("b") == "host"
        assert cache.where("c") == "ssd"
        stored: list[tuple[str, str]] = []

        def record(event: Event) -> None:
            if isinstance(event, Stored):
                stored.append((event.session, event.tier))

        cache.channel.subscribe(record)
        engine = ServingEngine(SlowAdapter(), cache, BidawScheduler())
        # a runs first; c arrives while a computes, so c's prefetch needs room during a's turn
        results = await engine.run(
            [
                (0.0, TurnRequest(session="a", query=(1,), answer_tokens=1)),
                (0.1, TurnRequest(session="c", query=(1,), answer_tokens=1)),
            ]
        )
        assert ("a", "host") in stored
        assert ("a", "ssd") not in stored
        # this adapter reports no phase timings: the engine records none
        assert [(r.restore, r.compute, r.store) for r in results] == [(0.0, 0.0, 0.0)] * 2
