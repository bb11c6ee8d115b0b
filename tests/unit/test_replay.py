"""The eviction-only replay: hit counting, the oracle, the published queue, the budget."""

from __future__ import annotations

from typing import Any

import pytest

from tieredkv.meta import KVMeta
from tieredkv.policies import LRU, Belady, Eviction, QueueEnhanced
from tieredkv.sim.replay import replay
from tieredkv.sim.trace import Turns


def turns_of(users: list[int], sizes: list[int] | None = None) -> Turns:
    rounds: list[int] = []
    seen: dict[int, int] = {}
    for u in users:
        rounds.append(seen.get(u, 0))
        seen[u] = seen.get(u, 0) + 1
    n = len(users)
    answers = sizes if sizes is not None else [1] * n
    return Turns(users, [float(t) for t in range(n)], [0] * n, answers, rounds)


def test_first_turns_are_not_counted_and_hits_need_residency() -> None:
    # Each turn adds one token; 1 byte per token; room for 3 bytes.
    r = replay(turns_of([1, 2, 1, 2, 1]), LRU(), host_bytes=3, bytes_per_token=1)
    assert r.turns == 5
    assert r.accesses == 3
    # sizes after turns: 1:1, 2:1, 1:2 (hit), 2:2 -> evicts 1 (LRU), 1:3 (miss)
    assert (r.hits, r.misses) == (2, 1)
    assert r.hit_ratio == pytest.approx(2 / 3)
    assert r.miss_ratio == pytest.approx(1 / 3)
    assert r.hit_bytes == 1 + 1
    assert r.miss_bytes == 2
    assert r.evictions >= 1


def test_history_is_capped() -> None:
    r = replay(
        turns_of([1, 1, 1], sizes=[1000, 1000, 1000]),
        LRU(),
        host_bytes=10,
        bytes_per_token=1,
        history_cap=10,
    )
    assert (r.hits, r.misses) == (2, 0)  # capped at 10 tokens it always fits


def test_session_bigger_than_memory_is_rejected() -> None:
    r = replay(turns_of([1, 1]), LRU(), host_bytes=5, bytes_per_token=10)
    assert r.rejected == 2
    assert r.misses == 1


class Spy(LRU):
    """Records what the replay tells a policy."""

    def __init__(self) -> None:
        super().__init__()
        self.metas: list[KVMeta] = []
        self.waiting: list[tuple[str, ...]] = []

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        self.metas.append(meta)
        super().on_access(session, meta, now)

    def victims(self, need, now, view, protected=frozenset()):  # type: ignore[no-untyped-def]
        self.waiting.append(view.waiting)
        assert view.tiers[0].capacity == 2
        return super().victims(need, now, view, protected)


def test_policy_sees_the_oracle_the_queue_and_the_tiers() -> None:
    spy = Spy()
    replay(turns_of([1, 2, 3, 1, 2]), spy, host_bytes=2, bytes_per_token=1, window=2)
    assert [m.next_access for m in spy.metas] == [3.0, 4.0, None, None, None]
    assert [m.prev_answer_tokens for m in spy.metas] == [1] * 5
    assert [m.turns for m in spy.metas] == [1, 1, 1, 2, 2]
    assert spy.waiting[0] == ("u1", "u2")  # at turn 2 (u3), the next two turns


def test_the_policy_sees_what_each_turn_added_uncapped() -> None:
    """``turn_tokens`` is the turn's query plus its answer, as the trace has them, even past
    the history's cap (the policy weighs the new input, not the stored bytes)."""
    turns = Turns([1, 1, 2], [0.0, 1.0, 2.0], [3000, 40, 7], [5, 6, 1], [0, 1, 0])
    spy = Spy()
    replay(turns, spy, host_bytes=2, bytes_per_token=1, history_cap=100)
    assert [m.turn_tokens for m in spy.metas] == [3005, 46, 8]
    assert [m.tokens for m in spy.metas] == [100, 100, 8]


@pytest.mark.parametrize("policy", [Belady(), QueueEnhanced(window=4)])
def test_future_aware_policies_beat_lru_on_a_cycle(policy: Eviction) -> None:
    turns = turns_of([0, 1, 2, 3] * 20)
    kw: dict[str, Any] = {"host_bytes": 3, "bytes_per_token": 1, "history_cap": 1}
    assert replay(turns, LRU(), **kw).hits == 0
    assert replay(turns, policy, **kw).hits > 20


def test_warmup_is_not_counted() -> None:
    r = replay(turns_of([1, 1, 1, 1]), LRU(), host_bytes=100, bytes_per_token=1, warmup=2)
    assert r.accesses == 2


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="host_bytes"):
        replay(turns_of([1]), LRU(), host_bytes=0)
    with pytest.raises(ValueError, match="window"):
        replay(turns_of([1]), LRU(), host_bytes=1, window=-1)
