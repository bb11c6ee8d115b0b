"""A save whose conversation is lost while the turn waits to be stored (another save made
room for itself in host memory, and this conversation had no copy below) is not stored,
and is not reported as an error: under memory pressure that is an expected race, and a
busy server's log must not fill with tracebacks for it.

The worker appends with ``expected_tokens`` (the tokens the turn continues), which the
cache checks under the conversation's lock: a continuation of a lost conversation is not
stored, a first turn starts it afresh. Here the loss comes while the append is on its way
to that lock; the cache refuses the append (:class:`~tieredkv.HistoryLostError`) rather
than store the turn as a history without its start. Before 6 December 2026 that error
reached the save's future, and the worker logged it with its traceback at ERROR level.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from tieredkv.backends.memory import HostMemoryTier
from tieredkv.errors import InvalidArgumentError
from tieredkv.integrations.vllm.config import parse_config
from tieredkv.integrations.vllm.ops import SaveOp
from tieredkv.integrations.vllm.worker import HOST, TOKENS, WorkerStore, decode_meta
from tieredkv.meta import KVMeta

from .test_vllm_worker_eviction import BLOCKS, BS, FP, layers, one_history_bytes, session


def tokens(name: str, blocks: int) -> tuple[int, ...]:
    first = (ord(name) - ord("a") + 1) * 1000
    return tuple(range(first, first + blocks * BS))


def save_op(name: str, start: int, end: int) -> SaveOp:
    """Conversation ``name``'s turn from block ``start`` to ``end`` (vLLM's blocks 0..end)."""
    return SaveOp(
        f"r-{name}-{end}",
        session(name),
        tuple(range(end)),
        start,
        end,
        tokens(name, end),
        answer_tokens=8,
    )


def finish(store: WorkerStore, op: SaveOp) -> bool:
    store.save(op)
    store.wait_idle()
    ((done, ok),) = store.finished_saves()
    assert done.session == op.session
    return ok


def test_a_history_lost_while_its_turn_waits_is_not_stored_and_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    one = one_history_bytes()
    config = parse_config({"host_bytes": one + one // 2, "eviction": "lru"})
    store = WorkerStore(config, FP, BS, tiers=[HostMemoryTier(one + one // 2, prefault=False)])
    store.open(layers())
    cache = store.cache
    real_append = cache.append
    raced: list[str] = []

    async def racing_append(key: str, tensors: Mapping[str, Any], **kw: Any) -> KVMeta:
        """The first append of ``a`` after the worker's check: another conversation's turn
        is stored first, and the room it needs costs ``a`` its only copy."""
        if key == session("a") and not raced:
            raced.append(key)
            b = {n: t.clone() for n, t in tensors.items()}
            b[TOKENS] = torch.tensor(tokens("b", BLOCKS)).reshape(1, -1, 1)
            await real_append(session("b"), b, answer_tokens=8)
            assert cache.channel[session("a")].tier is None  # lost
        return await real_append(key, tensors, **kw)

    try:
        assert finish(store, save_op("a", 0, BLOCKS))
        cache.append = racing_append  # type: ignore[method-assign,assignment]
        caplog.set_level(logging.INFO, logger="tieredkv")
        # the turn continues a's BLOCKS stored blocks: with them gone, it is not stored
        assert not finish(store, save_op("a", BLOCKS, 2 * BLOCKS))
        assert raced == [session("a")]
        assert cache.channel[session("a")].tier is None
        assert any("history was lost" in r.getMessage() for r in caplog.records)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert cache.channel[session("b")].tier is not None
        # a's next save from its first block is stored, as a new history
        assert finish(store, save_op("a", 0, BLOCKS))
        meta = cache.channel[session("a")]
        assert (meta.tier, meta.tokens) == ("host", BLOCKS * BS)
    finally:
        store.close()


def test_a_lost_conversation_whose_record_goes_is_reported_gone() -> None:
    """With ``max_lost_records``, a lost conversation's record goes once newer losses
    pass the bound: the worker's next report gives it no metadata, so the scheduler side's
    mirror forgets it too (a :class:`~tieredkv.Forgotten` event touched it), and a
    continuation of it is still not stored."""
    one = one_history_bytes()
    host = one + one // 2
    config = parse_config({"host_bytes": host, "eviction": "lru", "max_lost_records": 1})
    assert config.max_lost_records == 1
    store = WorkerStore(config, FP, BS, tiers=[HostMemoryTier(host, prefault=False)])
    store.open(layers())
    try:
        for name in "abc":  # each evicts the one before: a and b are lost
            assert finish(store, save_op(name, 0, BLOCKS))
        report = store.report([], [])
        metas = {s: None if m is None else decode_meta(m) for s, m in report.metas.items()}
        assert metas[session("a")] is None  # its record went
        b = metas[session("b")]
        assert b is not None
        assert b.tier is None  # lost, still recorded
        c = metas[session("c")]
        assert c is not None
        assert c.tier == HOST
        assert store.cache.stats().lost_records_forgotten == 1
        assert not finish(store, save_op("a", BLOCKS, 2 * BLOCKS))
        assert session("a") not in store.cache.channel
    finally:
        store.close()


def test_the_connector_bounds_lost_records_by_default_and_refuses_a_bad_bound() -> None:
    assert parse_config({}).max_lost_records == 100_000
    assert parse_config({"max_lost_records": None}).max_lost_records is None
    for bad in (-1, 1.5, "10", True):
        with pytest.raises(InvalidArgumentError, match=r"'max_lost_records'\] must be an integer"):
            parse_config({"max_lost_records": bad})
