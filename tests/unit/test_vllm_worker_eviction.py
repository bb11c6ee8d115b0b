"""The connector's worker evicts from host memory what the eviction policy chooses, however
fast the background copies to the SSD tier are.

In inclusive mode every stored turn is also copied to the SSD tier in the background, and
a conversation being copied is busy: the cache never evicts it. A load that promotes a
history, or a save that grows host memory, made room at once, so when the policy's choice
was still being copied another conversation went instead: which one depended on the disk's
speed, not on the policy (the vLLM benchmark's pressure turns, driven through the worker with
the SSD tier's writes fsynced, kept 30 and 39 of 130 returning conversations in host memory
with Bidaw in two runs). The worker now lets those copies finish first.
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
import torch

from tieredkv.backends.base import SegmentKey
from tieredkv.backends.memory import HostMemoryTier
from tieredkv.backends.ssd import SSDTier
from tieredkv.integrations.vllm import worker as worker_module
from tieredkv.integrations.vllm.config import parse_config
from tieredkv.integrations.vllm.keys import fingerprint
from tieredkv.integrations.vllm.ops import LoadOp, SaveOp
from tieredkv.integrations.vllm.worker import HOST, SSD, WorkerStore

BS = 16  # tokens per block
BLOCKS = 4  # blocks per conversation
SLOW = 3.0  # seconds the slow conversation's copy to the SSD tier takes


class SlowSSD(SSDTier):
    """An SSD tier on which writing one conversation's turns takes ``SLOW`` seconds more
    (a disk busy with someone else's writes)."""

    def __init__(self, directory: Path, slow: str) -> None:
        super().__init__(directory, 64 << 20, fsync=False)
        self.slow = slow

    async def write(self, key: SegmentKey, data: memoryview) -> None:
        if key[0] == self.slow:
            await anyio.sleep(SLOW)
        await super().write(key, data)


def layers() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"layer.0": torch.randn(3 * BLOCKS, 1, BS, 64, generator=g)}


FP = fingerprint(
    model="m", identity="id:m", dtype="float32", kv_dtype="auto", block_size=BS, layout="L"
)


def session(name: str) -> str:
    return f"vllm-{FP}-{name}"


def tokens(name: str) -> tuple[int, ...]:
    first = (ord(name) - ord("a") + 1) * 1000
    return tuple(range(first, first + BLOCKS * BS))


def blocks(slot: int) -> tuple[int, ...]:
    return tuple(range(slot * BLOCKS, (slot + 1) * BLOCKS))


def save(store: WorkerStore, name: str, slot: int) -> None:
    """Store conversation ``name``'s first turn from vLLM's blocks of ``slot`` and wait
    until the cache holds it."""
    op = SaveOp(f"r-{name}", session(name), blocks(slot), 0, BLOCKS, tokens(name), answer_tokens=8)
    store.save(op)
    store.wait_idle()
    assert [(done.session, ok) for done, ok in store.finished_saves()] == [(op.session, True)]


def load(store: WorkerStore, name: str, slot: int) -> None:
    """Load conversation ``name`` into vLLM's blocks of ``slot``."""
    op = LoadOp(f"l-{name}", session(name), blocks(slot), 0, BLOCKS, tokens(name), sync=True)
    assert store.load_sync(op)


def copied(store: WorkerStore, name: str) -> bool:
    meta = store.cache.channel.get(session(name))
    return meta is not None and SSD in meta.copies


def wait_copied(store: WorkerStore, names: str) -> None:
    deadline = time.monotonic() + 60
    while not all(copied(store, n) for n in names):
        assert time.monotonic() < deadline, f"{names}: the copies to the SSD tier never ended"
        time.sleep(0.01)


def one_history_bytes() -> int:
    """The host memory one conversation takes (stored once, on a tier of its own)."""
    config = parse_config({"host_bytes": 1 << 20, "eviction": "lru"})
    store = WorkerStore(config, FP, BS, tiers=[HostMemoryTier(1 << 20, prefault=False)])
    store.open(layers())
    try:
        save(store, "p", 0)
        return store.cache.tiers[0].used
    finally:
        store.close()


@pytest.mark.parametrize("making_room", ["save", "load"])
def test_eviction_waits_for_the_copy_of_the_policys_choice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, making_room: str
) -> None:
    """Host memory holds two conversations; ``a`` is the least recently used (LRU's
    victim) and its copy to the SSD tier is slow. A third conversation's save, or the load
    of one that is only on the SSD tier, needs room: ``a`` leaves host memory once its copy
    is done, ``b`` stays. Before, ``b`` was evicted at once (``a`` was busy being copied)."""
    monkeypatch.setattr(worker_module, "COPY_WAIT", 60.0)  # a loaded machine
    one = one_history_bytes()
    config = parse_config({"host_bytes": 2 * one, "eviction": "lru", "fsync": False})
    tiers = [HostMemoryTier(2 * one, prefault=False), SlowSSD(tmp_path / "ssd", session("a"))]
    store = WorkerStore(config, FP, BS, tiers=tiers)
    store.open(layers())
    try:
        if making_room == "load":  # d: on the SSD tier only (e and b took its place)
            save(store, "d", 2)
            save(store, "e", 0)
            wait_copied(store, "de")
            save(store, "b", 1)
            wait_copied(store, "b")
            assert store.cache.where(session("d")) == SSD
        else:
            save(store, "b", 1)
            wait_copied(store, "b")
        save(store, "a", 0)  # evicts e (load) / fits (save)
        assert not copied(store, "a")  # its copy takes SLOW seconds
        load(store, "b", 1)  # b used after a: a is the least recently used
        began = time.monotonic()
        if making_room == "load":
            load(store, "d", 2)
            want = {"a": SSD, "b": HOST, "d": HOST}
        else:
            save(store, "c", 2)
            want = {"a": SSD, "b": HOST, "c": HOST}
        assert time.monotonic() - began < 30 + SLOW
        assert {n: store.cache.where(session(n)) for n in want} == want
        assert copied(store, "a")
    finally:
        store.close()
