"""The baselines' published mechanisms in the simulator: each one in a scenario where it
changes the outcome (CachedAttention: layer-wise pre-loading, look-ahead prefetching,
asynchronous saves, scheduler-aware eviction; FlashGen: inclusive copies)."""

from __future__ import annotations

import numpy as np
import pytest

from tieredkv.meta import KVMeta, MetadataChannel, TierInfo
from tieredkv.policies.scheduling import Request
from tieredkv.sim.engine import SimConfig, Simulator, simulate
from tieredkv.sim.synthetic import SyntheticWorkload
from tieredkv.sim.systems import SYSTEMS, LookAheadFCFS, SystemSpec, get_system
from tieredkv.sim.trace import Turns

KV = 819_200  # OPT-13B K/V bytes per token
TINY = SimConfig(host_gb=0.001, iteration_overhead=0.001)  # 1 MB: every KV lives on SSD


def fcfs(name: str, **kw: object) -> SystemSpec:
    return SystemSpec(name=name, scheduler="fcfs", eviction="lru", **kw)  # type: ignore[arg-type]


def test_the_presets_carry_the_published_mechanisms() -> None:
    ca, fg = SYSTEMS["cachedattention"], SYSTEMS["flashgen"]
    assert (ca.layerwise_overlap, ca.prefetch_window, ca.background_writes) == (True, 30, True)
    assert (ca.eviction, ca.inclusive) == ("queue-enhanced", False)
    assert (fg.inclusive, fg.eviction, fg.layerwise_overlap) == (True, "lru", False)
    assert isinstance(Simulator(Turns([], [], [], [], []), ca).scheduler, LookAheadFCFS)


def test_layerwise_preloading_hides_the_copy_behind_the_prefill() -> None:
    """The second turn's 1,000-token history is in host memory: with layer-wise loading
    its prefill takes max(compute, copy), without it compute + copy."""
    turns = Turns([1, 1], [0.0, 30.0], [1000, 200], [5, 5], [0, 1])
    cfg = SimConfig(iteration_overhead=0.001)
    cost = cfg.cost_model()
    compute = cost.compute_time(cost.prefill_flops(200, 1005))
    copy = cost.link_time(1005 * KV)
    for overlap, expected in ((True, max(compute, copy)), (False, compute + copy)):
        sim = Simulator(turns, fcfs("x", layerwise_overlap=overlap), cfg)
        sim.run()
        assert sim.hit[1] == 1
        assert sim.first_token[1] - sim.start[1] == pytest.approx(expected + 0.001)


def window_scenario(window: int | None) -> Simulator:
    """One request slot; a 3,000-token answer holds it from t=1 while users 1-3 come back
    at t=10 with their KV on SSD."""
    turns = Turns(
        [1, 2, 3, 9, 1, 2, 3],
        [0.0, 0.0, 0.0, 1.0, 10.0, 10.0, 10.0],
        [1000, 1000, 1000, 10, 20, 20, 20],
        [5, 5, 5, 3000, 5, 5, 5],
        [0, 0, 0, 0, 1, 1, 1],
    )
    cfg = SimConfig(host_gb=0.001, iteration_overhead=0.001, max_seqs=1)
    sim = Simulator(turns, fcfs("x", prefetch_window=window, background_writes=True), cfg)
    sim.run()
    return sim


def test_lookahead_prefetching_loads_only_the_window() -> None:
    load = 1005 * KV / 1.5e9
    ahead, one = window_scenario(None), window_scenario(1)
    u1, u2 = 4, 5  # the rows of users 1 and 2 coming back
    # unbounded: every load landed during the long answer; user 2 runs as user 1 ends
    assert ahead.start[u2] == pytest.approx(ahead.finish[u1])
    # a window of one: user 2's load starts only once user 1 leaves the queue
    assert one.start[u2] == pytest.approx(one.start[u1] + load)
    assert one.start[u2] > one.finish[u1]
    assert one.finish[u2] > ahead.finish[u2]


def test_lookahead_fcfs_counts_the_window_from_the_head() -> None:
    sched = LookAheadFCFS(max_loads=4, window=2)
    view = MetadataChannel()
    view.set_tiers(
        [TierInfo(name="host", level=0, capacity=10), TierInfo(name="ssd", level=1, capacity=99)]
    )
    for i in range(4):
        view.put(KVMeta(session=f"s{i}", tier="ssd", copies=("ssd",), nbytes=5, tokens=1))
        sched.submit(Request(id=str(i), session=f"s{i}", arrival=float(i)), float(i), view)
    assert [r.session for r in sched.start_loads(4.0)] == ["s0", "s1"]
    sched.load_finished("s0", 5.0)
    assert [r.session for r in sched.next_batch(5.0, 100)] == ["s0"]
    assert [r.session for r in sched.start_loads(5.0)] == ["s2"]
    with pytest.raises(ValueError, match="window"):
        LookAheadFCFS(window=0)


def test_asynchronous_saves_let_a_load_pass_a_write() -> None:
    """User 2's 1,005-token KV went to SSD long ago; user 1's 2,001-token append is being
    written when user 2 comes back at t=30: in line, the load waits for it."""
    turns = Turns([2, 1, 2], [0.0, 29.0, 30.0], [1000, 2000, 20], [5, 1, 5], [0, 0, 1])
    load = 1005 * KV / 1.5e9
    background = Simulator(turns, fcfs("bg", background_writes=True), TINY)
    background.run()
    in_line = Simulator(turns, fcfs("fifo"), TINY)
    in_line.run()
    assert background.start[2] == pytest.approx(30.0 + load)
    write_end = in_line.finish[1] + 2001 * KV / 1.5e9
    assert in_line.start[2] == pytest.approx(write_end + load)


def test_a_full_write_buffer_puts_writes_back_in_line() -> None:
    turns = Turns([2, 1, 2], [0.0, 29.0, 30.0], [1000, 2000, 20], [5, 1, 5], [0, 0, 1])
    cfg = SimConfig(host_gb=0.001, iteration_overhead=0.001, write_buffer_gb=0.0)
    a = Simulator(turns, fcfs("bg", background_writes=True), cfg)
    a.run()
    b = Simulator(turns, fcfs("fifo"), cfg)
    b.run()
    assert a.start[2] == pytest.approx(b.start[2])


def test_scheduler_aware_eviction_keeps_a_queued_session() -> None:
    """Users 1 and 2 fill 2 GB of host memory; user 2 comes back and queues behind a long
    answer (one request slot). When that answer's 1.7 GB KV is appended, LRU evicts user
    2 (its KV is the least recent) unless the engine or the policy protects the queue."""
    turns = Turns(
        [1, 2, 9, 2],
        [0.0, 0.0, 1.0, 10.0],
        [1000, 1000, 10, 20],
        [5, 5, 3000, 5],
        [0, 0, 0, 1],
    )
    cfg = SimConfig(host_gb=2.0, max_seqs=1, iteration_overhead=0.001)
    blind = simulate(turns, fcfs("lru", protect_ready=False), cfg)
    aware = simulate(
        turns,
        SystemSpec(name="qe", scheduler="fcfs", eviction="queue-enhanced", protect_ready=False),
        cfg,
    )
    pinned = simulate(turns, fcfs("lru, engine protects"), cfg)
    assert blind.recomputed_tokens == 1005  # user 2's history, evicted while it queued
    assert aware.recomputed_tokens == 0
    assert pinned.recomputed_tokens == 0
    assert aware.latency_mean < blind.latency_mean


def test_inclusive_copies_make_evictions_free_writes() -> None:
    """FlashGen writes each turn's new segment through to SSD and never writes at
    eviction: its SSD writes are exactly the segments; exclusive caching writes more."""
    turns = SyntheticWorkload(users=60, arrival_rate=0.5, seed=2).generate()
    cfg = SimConfig(host_gb=20)
    flashgen = simulate(turns, get_system("flashgen"), cfg)
    after = np.minimum(turns.context_after(), 2048)
    segment = np.minimum((turns.query + np.maximum(turns.answer, 1)), after)
    assert flashgen.evictions > 0
    assert flashgen.ssd_write_bytes == int(segment.sum()) * KV
    exclusive = simulate(turns, get_system("flashgen", inclusive=False), cfg)
    assert exclusive.ssd_write_bytes > flashgen.ssd_write_bytes
    assert flashgen.ssd_read_bytes > 0


def test_prefetch_window_needs_fcfs_and_a_positive_size() -> None:
    with pytest.raises(ValueError, match="prefetch_window"):
        SystemSpec(name="x", prefetch_window=0)
    with pytest.raises(ValueError, match="fcfs"):
        Simulator(
            Turns([], [], [], [], []), SystemSpec(name="x", scheduler="bidaw", prefetch_window=3)
        )
