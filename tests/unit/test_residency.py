"""The one residency rule (tieredkv.residency): publish, then notify the policies, then
announce the event, whatever the change; the simulator and the replay go through it."""

from __future__ import annotations

from collections.abc import Set
from pathlib import Path

import pytest
import torch

from tieredkv import HostMemoryTier, SSDTier, TieredKVCache
from tieredkv.meta import Dropped, Evicted, KVMeta, MetadataChannel, MetadataView, Stored
from tieredkv.policies import LRU
from tieredkv.residency import Residency
from tieredkv.sim.engine import SimConfig, Simulator
from tieredkv.sim.replay import replay
from tieredkv.sim.synthetic import SyntheticWorkload
from tieredkv.sim.systems import get_system


class Recorder:
    """An eviction policy that logs what it is told, and what the channel held then."""

    name = "recorder"

    def __init__(self, log: list[tuple[str, ...]], channel: MetadataChannel, tier: str) -> None:
        self.log = log
        self.channel = channel
        self.tier = tier
        self.lru = LRU()

    def _seen(self, session: str) -> str:
        meta = self.channel.get(session)
        return "unpublished" if meta is None else f"tokens={meta.tokens}"

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        self.log.append((self.tier, "on_access", session, self._seen(session)))
        self.lru.on_access(session, meta, now)

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        self.log.append((self.tier, "on_admit", session, self._seen(session)))
        self.lru.on_admit(session, meta, now)

    def on_remove(self, session: str) -> None:
        self.log.append((self.tier, "on_remove", session, self._seen(session)))
        self.lru.on_remove(session)

    def victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str] = frozenset()
    ) -> list[str] | None:
        return self.lru.victims(need, now, view, protected)

    def __len__(self) -> int:
        return len(self.lru)

    def resident_bytes(self) -> int:
        return self.lru.resident_bytes()


def test_publish_then_notify_then_announce() -> None:
    log: list[tuple[str, ...]] = []
    channel = MetadataChannel()
    channel.subscribe(lambda event: log.append(("event", type(event).__name__)))
    host, ssd = Recorder(log, channel, "host"), Recorder(log, channel, "ssd")
    residency = Residency(channel, [host, ssd], emit=channel.emit)
    meta = KVMeta(session="u", tier="host", copies=("host",), nbytes=10, tokens=5, turns=1)
    stored = Stored(session="u", time=1.0, nbytes=10, tier="host", tokens=5, seconds=0.0)
    assert residency.accessed(meta, 1.0, admit=0, event=stored) is meta
    # every tier's policy sees the access, then the tier it lives in the admission; each
    # reads the session's new metadata on the channel; the event comes last
    assert log == [
        ("host", "on_access", "u", "tokens=5"),
        ("ssd", "on_access", "u", "tokens=5"),
        ("host", "on_admit", "u", "tokens=5"),
        ("event", "Stored"),
    ]
    log.clear()
    moved = KVMeta(session="u", tier="ssd", copies=("ssd",), nbytes=10, tokens=6, turns=1)
    residency.removed(
        "u", 0, moved, Evicted(session="u", time=2.0, nbytes=10, tier="host", lost=False)
    )
    residency.admitted(moved, 2.0, 1)
    assert log == [
        ("host", "on_remove", "u", "tokens=6"),
        ("event", "Evicted"),
        ("ssd", "on_admit", "u", "tokens=6"),
    ]
    assert channel["u"] is moved
    # a tier without a policy is not notified; without emit an event is dropped
    quiet = Residency(channel, [host])
    log.clear()
    quiet.admitted(meta, 3.0, 1, stored)
    quiet.removed("u", 1)
    assert log == []
    assert quiet.published(meta) is meta
    assert channel["u"] is meta


def test_the_simulator_notifies_in_that_order() -> None:
    """A run with a recording policy: every admission of a session follows an access or a
    load it saw, reads its published metadata, and a removal is never of a session that
    was not admitted."""
    turns = SyntheticWorkload(users=30, arrival_rate=1.0, seed=2).generate()
    log: list[tuple[str, ...]] = []
    probe = Recorder(log, MetadataChannel(), "host")
    sim = Simulator(turns, get_system("flashgen"), SimConfig(host_gb=1.0), eviction=probe)
    probe.channel = sim.channel  # the policy reads the channel the simulator publishes to
    sim.run()
    resident: set[str] = set()
    for _, what, session, seen in log:
        assert seen != "unpublished", (what, session)  # published before the policy heard
        if what == "on_admit":
            resident.add(session)
        elif what == "on_remove":
            assert session in resident, session
            resident.discard(session)
    assert ("host", "on_remove") in {(t, w) for t, w, *_ in log}  # evictions happened


def test_the_replay_notifies_in_that_order() -> None:
    """The replay: each turn is an access (every policy), room is made (removals), then the
    admission of that turn's history, with the metadata the access published."""
    turns = SyntheticWorkload(users=80, arrival_rate=1.0, seed=4).generate()
    log: list[tuple[str, ...]] = []

    class Probe(Recorder):
        def _seen(self, session: str) -> str:
            return ""

        def on_access(self, session: str, meta: KVMeta, now: float) -> None:
            log.append(("on_access", session, str(meta.tokens)))
            self.lru.on_access(session, meta, now)

        def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
            log.append(("on_admit", session, str(meta.tokens)))
            self.lru.on_admit(session, meta, now)

        def on_remove(self, session: str) -> None:
            log.append(("on_remove", session))
            self.lru.on_remove(session)

    result = replay(turns, Probe(log, MetadataChannel(), "host"), host_bytes=20 * 10**9)
    assert result.evictions > 0
    assert result.hits > 0
    last_access: tuple[str, ...] | None = None
    for entry in log:
        if entry[0] == "on_access":
            last_access = entry
        elif entry[0] == "on_admit":
            assert last_access is not None
            assert entry[1:] == last_access[1:]  # the session and meta the access published
    # every eviction told to the policy (and a history that could not grow in place)
    assert sum(e[0] == "on_remove" for e in log) >= result.evictions


def test_unpublished_takes_the_session_off_and_announced_only_announces() -> None:
    """A drop: the metadata leaves the channel (a Residency built without ``remove=`` says
    so), the policies are told nothing by it, and an event announced alone is just emitted."""
    log: list[tuple[str, ...]] = []
    channel = MetadataChannel()
    channel.subscribe(lambda event: log.append(("event", type(event).__name__)))
    host = Recorder(log, channel, "host")
    residency = Residency(channel, [host], emit=channel.emit, remove=channel.remove)
    meta = KVMeta(session="u", tier="host", copies=("host",), nbytes=10, tokens=5, turns=1)
    residency.published(meta)
    residency.unpublished("u")
    assert channel.get("u") is None
    residency.announced(Dropped(session="u", time=1.0, nbytes=10))
    assert log == [("event", "Dropped")]
    with pytest.raises(TypeError, match="remove="):
        Residency(channel, [host]).unpublished("u")


async def test_the_cache_notifies_in_that_order(tmp_path: Path) -> None:
    """The live cache: a turn that spills to the SSD tier, a load that promotes it back and
    a drop each publish before any policy hears of them and announce their event last;
    every policy sees each access; a drop tells each tier's policy it left."""
    log: list[tuple[str, ...]] = []
    channel = MetadataChannel()
    channel.subscribe(lambda event: log.append(("event", type(event).__name__)))
    host, ssd = Recorder(log, channel, "host"), Recorder(log, channel, "ssd")
    kv = {"kv": torch.arange(64 * 256, dtype=torch.int16).reshape(64, 256)}
    tiers = [HostMemoryTier(64 << 10), SSDTier(tmp_path / "ssd", 4 << 20)]
    async with TieredKVCache(tiers, eviction=[host, ssd], channel=channel) as cache:
        await cache.append("a", kv, answer_tokens=1)
        assert log == [
            ("host", "on_access", "a", "tokens=64"),
            ("ssd", "on_access", "a", "tokens=64"),
            ("host", "on_admit", "a", "tokens=64"),
            ("event", "Stored"),
        ]
        log.clear()
        await cache.append("b", kv, answer_tokens=1)  # "a" is demoted to make room
        assert cache.where("a") == "ssd"
        assert log.index(("host", "on_remove", "a", "tokens=64")) < log.index(
            ("ssd", "on_admit", "a", "tokens=64")
        )
        assert log[-1] == ("event", "Stored")
        assert ("event", "Demoted") in log
        log.clear()
        out = await cache.load("a")  # promoted back ("b" goes down)
        assert torch.equal(out["kv"], kv["kv"])
        assert cache.where("a") == "host"
        assert ("host", "on_admit", "a", "tokens=64") in log
        assert log[-1] == ("event", "Loaded")
        assert log.index(("event", "Promoted")) < log.index(("host", "on_access", "a", "tokens=64"))
        log.clear()
        await cache.drop("a")
        assert log == [  # off the channel first; every tier's policy is told it left
            ("host", "on_remove", "a", "unpublished"),
            ("ssd", "on_remove", "a", "unpublished"),
            ("event", "Dropped"),
        ]
        assert channel.get("a") is None
