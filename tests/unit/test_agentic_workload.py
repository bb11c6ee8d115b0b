"""The agentic workload: tool-call loops of the stated shape, a human mix, and callers
that hint, that do not, and whose hints are wrong."""

from __future__ import annotations

import numpy as np
import pytest

from tieredkv.policies import make_eviction
from tieredkv.sim.agentic import AgenticWorkload, replay_agentic
from tieredkv.sim.replay import replay
from tieredkv.sim.workloads import WORKLOAD_KINDS, WorkloadSpec


def test_shape_of_the_tool_loops_and_the_mix() -> None:
    load = AgenticWorkload(users=400, arrival_rate=1.0, seed=3).generate()
    turns = load.turns
    assert np.all(np.diff(turns.time) >= 0)
    agents = set(turns.user[load.agent].tolist())
    humans = set(turns.user[~load.agent].tolist())
    assert len(agents) == 200
    assert len(humans) == 200
    assert not agents & humans
    calls = turns.answer[load.tool_call]
    assert calls.min() >= 20
    assert calls.max() <= 80
    assert len(np.unique(calls)) == 61
    assert not load.tool_call[~load.agent].any()
    # gaps after a tool call are the tool's run time: 25% of 1-10 minutes, the rest seconds
    nxt = turns.next_index()
    after = load.tool_call & (nxt >= 0)
    gaps = turns.time[nxt[after]] - turns.time[after]
    long = gaps >= 60
    assert 0.22 < long.mean() < 0.28
    assert gaps[long].max() <= 600 + 1e-6
    assert gaps[~long].max() <= 50 + 1e-6
    assert gaps.min() >= 0.5 - 1e-6  # float sums of times
    assert np.isnan(load.hint).all()  # nobody hints by default


def test_callers_that_hint_right_and_wrong() -> None:
    right = AgenticWorkload(users=200, hinted=1.0, seed=5).generate()
    wrong = AgenticWorkload(users=200, hinted=1.0, wrong=1.0, seed=5).generate()
    half = AgenticWorkload(users=200, hinted=0.5, seed=5).generate()
    for load in (right, wrong):
        hinted = ~np.isnan(load.hint)
        assert np.array_equal(hinted, load.tool_call)  # tool calls, and only they, are hinted
    nxt = right.turns.next_index()
    told = ~np.isnan(right.hint) & (nxt >= 0)
    gaps = right.turns.time[nxt[told]] - right.turns.time[told]
    np.testing.assert_allclose(right.hint[told], gaps, rtol=1e-9, atol=1e-6)
    # the same turns; the wrong hints are unrelated to the gaps
    assert np.array_equal(wrong.turns.time, right.turns.time)
    bad = wrong.hint[told]
    assert np.mean(np.abs(bad - gaps) > 1.0) > 0.5
    agents_hinting = {int(u) for u in half.turns.user[~np.isnan(half.hint)]}
    agents = {int(u) for u in half.turns.user[half.agent]}
    assert 0.3 < len(agents_hinting) / len(agents) < 0.7


def test_the_workload_registry_knows_it() -> None:
    assert "agentic" in WORKLOAD_KINDS
    turns = WorkloadSpec(kind="agentic", minutes=5.0, seed=2).turns(60.0)
    assert turns.users() == 300
    with pytest.raises(ValueError, match="agent_share is a fraction"):
        AgenticWorkload(agent_share=1.5)


def test_the_replay_carries_tool_calls_and_hints_to_the_policy() -> None:
    load = AgenticWorkload(users=60, hinted=1.0, seed=1).generate()
    policy = make_eviction("bidaw")
    result = replay_agentic(load, policy, host_bytes=int(5e9))
    assert result.turns == len(load)
    kinds = {policy.kind_of(b) for b in range(policy._buckets)}  # type: ignore[attr-defined]
    assert kinds == {"answer", "tool", "hint"}
    seen = {policy.kind_of(b) for b, _ in policy._samples}  # type: ignore[attr-defined]
    assert seen == {"hint", "answer"}  # hinted tool calls, and the rest
    with pytest.raises(ValueError, match="one value per turn"):
        replay(load.turns, make_eviction("lru"), host_bytes=int(5e9), tool_calls=[True])
