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
    assert (ca.eviction, ca.inclusive, ca.blocking_loads, ca.keep_ssd_copy) == (
        "queue-enhanced",
        False,
        True,
        True,
    )
    assert (fg.inclusive, fg.eviction, fg.layerwise_overlap) == (True, "lru", False)
    assert (fg.prefetch, fg.blocking_loads, fg.protect_ready) == (False, True, False)
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
    # user 2's history, evicted (written to SSD) while it queued, is loaded back when it
    # runs; kept in host memory, it is never read from SSD
    assert blind.ssd_read_bytes == 1005 * KV
    assert aware.ssd_read_bytes == pinned.ssd_read_bytes == 0
    assert blind.recomputed_tokens == aware.recomputed_tokens == pinned.recomputed_tokens == 0
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


def test_blocking_loads_stop_the_running_batch_while_the_head_loads() -> None:
    """User 2's 1,005-token KV is on SSD when it comes back at t=10, while user 1 decodes a
    3,000-token answer. An engine that fetches before it computes (FlashGen, CachedAttention
    as the Bidaw paper measures them) stops user 1's decoding for the whole load; one that
    keeps decoding does not."""
    turns = Turns([2, 1, 2], [0.0, 0.5, 10.0], [1000, 10, 20], [5, 3000, 5], [0, 0, 1])
    load = 1005 * KV / 1.5e9
    runs = {}
    for blocking in (False, True):
        sim = Simulator(turns, fcfs("x", prefetch=False, blocking_loads=blocking), TINY)
        runs[blocking] = (sim.run(), sim)
    (free, free_sim), (blocked, blocked_sim) = runs[False], runs[True]
    assert free.ssd_read_bytes == blocked.ssd_read_bytes == 1005 * KV
    # the engine asks for work at an iteration boundary, fetches, and waits: user 1's
    # answer ends exactly one load time later
    assert blocked_sim.finish[1] - free_sim.finish[1] == pytest.approx(load, rel=1e-9)
    assert blocked.gpu_busy < free.gpu_busy


def test_keeping_the_ssd_copy_writes_only_new_segments() -> None:
    """Host memory holds nothing, so every turn's KV moves to SSD at its end and comes back
    for the next turn. Exclusive caching deletes the SSD copy at each load and rewrites the
    whole history; with ``keep_ssd_copy`` only each turn's new segment is written."""
    turns = SyntheticWorkload(users=20, arrival_rate=0.5, seed=3).generate()
    after = np.minimum(turns.context_after(), 2048)
    segment = np.minimum((turns.query + np.maximum(turns.answer, 1)), after)
    kept = simulate(turns, fcfs("kept", keep_ssd_copy=True), TINY)
    exclusive = simulate(turns, fcfs("exclusive"), TINY)
    assert kept.ssd_write_bytes == int(segment.sum()) * KV
    assert exclusive.ssd_write_bytes == int(after.sum()) * KV
    assert kept.ssd_read_bytes == exclusive.ssd_read_bytes > 0


def test_clean_ahead_writes_new_segments_while_the_ssd_idles() -> None:
    """User 1's KV sits in host memory from t=0.3; at t=100 user 2's KV needs its room (no
    write buffer: writes go in line). Written ahead during the idle 100 s, the eviction
    writes nothing, and user 1's return waits only for its own load; otherwise the load
    queues behind the eviction's write. Bytes written are the same."""
    turns = Turns([1, 2, 1], [0.0, 100.0, 100.5], [1000, 1000, 20], [5, 5, 5], [0, 0, 1])
    cfg = SimConfig(host_gb=1.0, write_buffer_gb=0.0, iteration_overhead=0.001)
    waits, writes = {}, {}
    for ahead in (False, True):
        spec = get_system("bidaw", eviction="lru", storage_efficient=False, clean_ahead=ahead)
        sim = Simulator(turns, spec, cfg)
        writes[ahead] = sim.run().ssd_write_bytes
        waits[ahead] = sim.start[2] - sim.arrival[2]
    load = 1005 * KV / 1.5e9
    assert writes[True] == writes[False] == 2010 * KV
    assert waits[True] == pytest.approx(load, rel=1e-9)
    assert waits[False] > load + 0.3
