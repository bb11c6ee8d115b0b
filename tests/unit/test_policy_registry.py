"""The policy registry: every policy by name, and a helpful error for unknown names."""

from __future__ import annotations

import pytest

from tieredkv.errors import TieredKVError, UnknownPolicyError
from tieredkv.policies import (
    FCFS,
    FIFO,
    LFU,
    LRU,
    AdaptiveBidaw,
    Belady,
    BidawEviction,
    BidawScheduler,
    Eviction,
    LookAheadFCFS,
    QueueEnhanced,
    Scheduler,
    eviction_names,
    make_eviction,
    make_scheduler,
    register_eviction,
    scheduler_names,
    scheduler_parameters,
)


def test_every_eviction_policy_is_registered() -> None:
    assert eviction_names() == [
        "fifo", "lru", "lfu", "queue-enhanced", "belady", "bidaw", "bidaw-paper",
    ]  # fmt: skip
    kinds = [FIFO, LRU, LFU, QueueEnhanced, Belady, AdaptiveBidaw, BidawEviction]
    for name, kind in zip(eviction_names(), kinds, strict=True):
        policy = make_eviction(name)
        assert type(policy) is kind
        assert policy.name == name


def test_every_scheduler_is_registered() -> None:
    assert scheduler_names() == ["fcfs", "bidaw", "fcfs-lookahead"]
    assert type(make_scheduler("fcfs")) is FCFS
    assert type(make_scheduler("bidaw")) is BidawScheduler
    default = make_scheduler("fcfs-lookahead")
    assert isinstance(default, LookAheadFCFS)
    assert type(default) is LookAheadFCFS
    assert default.window == 30  # CachedAttention's
    # FCFS with a look-ahead window is CachedAttention's scheduler
    lookahead = make_scheduler("fcfs", window=5)
    assert isinstance(lookahead, LookAheadFCFS)
    assert type(lookahead) is LookAheadFCFS
    assert lookahead.window == 5
    assert scheduler_parameters("FCFS") == {"max_loads", "prefetch", "window"}
    assert {"max_loads", "bandwidth", "latency"} <= scheduler_parameters("bidaw")
    with pytest.raises(UnknownPolicyError, match="known: bidaw, fcfs, fcfs-lookahead"):
        scheduler_parameters("sjf")
    with pytest.raises(ValueError, match="needs prefetch=True"):
        make_scheduler("fcfs", window=5, prefetch=False)


def test_names_are_forgiving_and_kwargs_reach_the_constructor() -> None:
    policy = make_eviction("Queue_Enhanced", window=7)
    assert isinstance(policy, QueueEnhanced)
    assert policy.window == 7
    sched = make_scheduler(" BIDAW ", max_loads=3, bandwidth=1e9)
    assert isinstance(sched, BidawScheduler)
    assert sched.max_loads == 3


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(UnknownPolicyError) as info:
        make_eviction("arc")
    message = str(info.value)
    assert "'arc'" in message
    for name in eviction_names():
        assert name in message
    assert isinstance(info.value, KeyError)
    assert isinstance(info.value, TieredKVError)
    with pytest.raises(UnknownPolicyError, match="fcfs"):
        make_scheduler("sjf")


def test_bad_constructor_arguments_are_explained() -> None:
    with pytest.raises(ValueError, match="max_loads"):
        make_scheduler("fcfs", max_loads=0)
    with pytest.raises(ValueError, match="window"):
        make_eviction("queue-enhanced", window=-1)
    with pytest.raises(ValueError, match="answer_edges"):
        make_eviction("bidaw", answer_edges=(10, 5))
    with pytest.raises(TypeError):
        make_eviction("lru", capacity=3)


def test_third_party_policy_can_register() -> None:
    class MRU(LRU):
        name = "mru-test"

    register_eviction("mru-test", MRU)
    try:
        policy = make_eviction("mru-test")
        assert isinstance(policy, Eviction)
        assert "mru-test" in eviction_names()
    finally:
        from tieredkv.policies import registry

        registry._EVICTIONS.pop("mru-test")
    assert isinstance(make_scheduler("fcfs"), Scheduler)
