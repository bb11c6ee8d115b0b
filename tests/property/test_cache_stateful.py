"""A Hypothesis state machine drives a real two-tier cache (tiny budgets, real files) side by
side with a plain dict model, and checks after every step that every load equals what was
appended, that no tier exceeds its budget, and that no tier leaks space."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, ClassVar

import hypothesis.strategies as st
import pytest
import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.invariants import problems
from tieredkv import (
    CapacityError,
    HistoryLostError,
    HostMemoryTier,
    SessionNotFoundError,
    SSDTier,
    TieredKVCache,
)

SESSIONS = st.sampled_from(["a", "b", "c", "d", "e/..", "é"])


def segment(tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"kv": torch.randint(0, 256, (tokens, 1000), dtype=torch.uint8, generator=g)}


class CacheMachine(RuleBasedStateMachine):
    mode: ClassVar[str] = "exclusive"

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tieredkv-stateful-"))
        self._portal_cm: AbstractContextManager[BlockingPortal] = start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        self.model: dict[str, list[dict[str, torch.Tensor]]] = {}
        self.cache: TieredKVCache | None = None
        self.lost_seen = 0
        self.unreported: set[str] = set()
        """Sessions lost since a call last said so: their next append raises once."""

    @initialize()
    def open_cache(self) -> None:
        self._open()

    def _open(self) -> None:
        # host: four 4 KiB blocks; SSD: twelve. A 1..6-token segment takes 1 or 2 blocks.
        tiers = [HostMemoryTier(16 << 10), SSDTier(self.dir, 48 << 10, fsync=False)]
        self.cache = TieredKVCache(tiers, mode=self.mode)  # type: ignore[arg-type]
        self.portal.call(self.cache.open)
        self.lost_seen = 0
        self.unreported = set()  # (a new cache knows no earlier losses)

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        async def run() -> Any:
            return await fn(*args, **kwargs)

        return self.portal.call(run)

    def _sync_losses(self) -> None:
        """Sessions the cache evicted from its last tier are gone: the model forgets them."""
        assert self.cache is not None
        lost = self.cache.stats().lost
        for key in list(self.model):
            if not self.cache.contains(key):
                assert lost > self.lost_seen, f"{key!r} vanished without being counted as lost"
                del self.model[key]
                self.unreported.add(key)
        self.lost_seen = lost

    @rule(session=SESSIONS, tokens=st.integers(1, 6), seed=st.integers(0, 2**16))
    def append(self, session: str, tokens: int, seed: int) -> None:
        assert self.cache is not None
        seg = segment(tokens, seed)
        self._sync_losses()
        try:
            self.call(self.cache.append, session, seg, answer_tokens=tokens)
        except HistoryLostError:  # told once, nothing stored
            assert session in self.unreported, session
            assert session not in self.model
            assert session not in self.cache
            self.unreported.discard(session)
            return
        except CapacityError:
            assert self.cache.where(session) is None or session in self.model
            self._sync_losses()
            return
        self._sync_losses()
        assert session not in self.unreported, f"{session!r} lost: its append was not refused"
        if session not in self.model:  # new, or lost, told, and started afresh
            self.model[session] = []
        meta = self.cache.channel[session]
        self.model[session].append(seg)
        assert meta.turns == len(self.model[session])

    @rule(session=SESSIONS)
    def load(self, session: str) -> None:
        assert self.cache is not None
        try:
            got = self.call(self.cache.load, session)
        except SessionNotFoundError:
            assert session not in self.model
            self.unreported.discard(session)  # (told)
            return
        expected = torch.cat([s["kv"] for s in self.model[session]])
        assert torch.equal(got["kv"], expected)
        self._sync_losses()

    @rule(session=SESSIONS)
    def prefetch(self, session: str) -> None:
        assert self.cache is not None
        try:
            self.call(self.cache.prefetch, session)
        except SessionNotFoundError:
            assert session not in self.model
            self.unreported.discard(session)  # (told)
        self._sync_losses()

    @rule(session=SESSIONS)
    def drop(self, session: str) -> None:
        assert self.cache is not None
        try:
            self.call(self.cache.drop, session)
        except SessionNotFoundError:
            assert session not in self.model
            return
        finally:
            self.unreported.discard(session)  # (a drop tells)
        self.model.pop(session, None)

    @rule()
    def restart(self) -> None:
        """Close and reopen on the same directory: what the SSD holds comes back whole, and
        so do the sessions only host memory held that the close wrote down (into the SSD's
        free room: those it could not are counted as unsaved)."""
        assert self.cache is not None
        on_ssd = {k for k in self.model if "ssd" in self.cache.channel[k].copies}
        host_only = set(self.model) - on_ssd
        self.call(self.cache.aclose)
        stats = self.cache.stats()
        assert stats.written_down + stats.unsaved == len(host_only)
        self._open()
        assert self.cache is not None
        back = set(self.cache.sessions())
        assert on_ssd <= back <= on_ssd | host_only
        assert len(back) == len(on_ssd) + stats.written_down
        for key in list(self.model):
            if key not in back:
                del self.model[key]

    @invariant()
    def budgets_hold_and_nothing_leaks(self) -> None:
        if self.cache is None:
            return
        self.call(self.cache.flush)
        self._sync_losses()
        stats = self.cache.stats()
        for tier in stats.tiers:
            assert tier.used <= tier.capacity
            held = sum(m.nbytes for m in self.cache.channel.values() if tier.name in m.copies)
            assert tier.used == held, f"{tier.name}: {tier.used} used, {held} accounted"
        assert set(self.cache.sessions()) == set(self.model)
        found = problems(self.cache)
        assert not found, "\n".join(found)

    def teardown(self) -> None:
        try:
            if self.cache is not None:
                self.call(self.cache.aclose)
        finally:
            self._portal_cm.__exit__(None, None, None)
            shutil.rmtree(self.dir, ignore_errors=True)


class InclusiveCacheMachine(CacheMachine):
    mode = "inclusive"


_settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
CacheMachine.TestCase.settings = _settings
InclusiveCacheMachine.TestCase.settings = _settings
TestExclusiveCache = pytest.mark.timeout(300)(CacheMachine.TestCase)
TestInclusiveCache = pytest.mark.timeout(300)(InclusiveCacheMachine.TestCase)
