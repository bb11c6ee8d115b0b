"""The serving simulator: exact step times, the policy protocol, causality, determinism."""

from __future__ import annotations

from collections.abc import Set

import numpy as np
import pytest

from tieredkv.meta import KVMeta, MetadataView
from tieredkv.policies import FCFS, LRU
from tieredkv.sim.engine import SimConfig, Simulator, simulate
from tieredkv.sim.sweep import Job, run_jobs, throughput
from tieredkv.sim.synthetic import SyntheticWorkload
from tieredkv.sim.systems import SYSTEMS, SystemSpec, get_system
from tieredkv.sim.trace import Turns
from tieredkv.sim.workloads import WorkloadSpec

CFG = SimConfig(iteration_overhead=0.001)


def one_turn(query: int, answer: int) -> Turns:
    return Turns([7], [5.0], [query], [answer], [0])


def test_one_request_takes_prefill_plus_decode_iterations() -> None:
    sim = Simulator(one_turn(100, 10), get_system("ideal"), CFG)
    r = sim.run()
    cost = CFG.cost_model()
    prefill = cost.compute_time(cost.prefill_flops(100, 0)) + cost.iteration_overhead
    # the prefill yields token 1; 9 decode iterations follow, each reading 101 + j tokens
    decode = sum(cost.decode_iteration(1, 101 + j) for j in range(9))
    assert sim.first_token[0] - sim.arrival[0] == pytest.approx(prefill)
    assert r.latency_mean == pytest.approx(prefill + decode)
    assert r.queueing_mean == 0.0
    assert r.turns == 1


def test_a_new_request_joins_at_an_iteration_boundary() -> None:
    turns = Turns([1, 2], [0.0, 0.05], [50, 50], [200, 5], [0, 0])
    sim = Simulator(turns, get_system("ideal"), CFG)
    sim.run()
    cost = CFG.cost_model()
    # user 1 decodes alone from its first token until user 2's prefill starts
    boundary = sim.first_token[0]
    j = 0
    while boundary + 1e-12 < sim.arrival[1]:
        boundary += cost.decode_iteration(1, 51 + j)
        j += 1
    assert sim.start[1] == pytest.approx(boundary)
    assert sim.finish[1] < sim.finish[0]  # the short answer ends first


def test_vllm_recomputes_every_history_and_ideal_always_hits() -> None:
    turns = SyntheticWorkload(users=20, arrival_rate=0.2, seed=4).generate()
    hist = int(np.minimum(turns.context_after() - turns.query - turns.answer, 2048).sum())
    vllm = simulate(turns, get_system("vllm"), CFG)
    assert vllm.recomputed_tokens == hist
    assert vllm.accesses == 0
    assert vllm.ssd_read_bytes == 0
    ideal = simulate(turns, get_system("ideal"), CFG)
    assert ideal.recomputed_tokens == 0
    assert ideal.host_hit_ratio == 1.0
    assert ideal.accesses == int((turns.round_index > 0).sum())
    assert vllm.latency_mean > ideal.latency_mean


def test_on_demand_fcfs_serves_everything_and_waits_longer_than_prefetching() -> None:
    """FCFS(prefetch=False) fetches the head's KV only when the GPU asks for work: every
    request is still served, and the loads sit on the critical path."""
    turns = SyntheticWorkload(users=60, arrival_rate=0.5, seed=2).generate()
    cfg = SimConfig(host_gb=20)
    system = get_system("flashgen")  # on demand itself: prefetch=False
    ahead = simulate(turns, get_system("flashgen", prefetch=True), cfg)
    sim = Simulator(turns, system, cfg, scheduler=FCFS(prefetch=False))
    on_demand = sim.run()
    assert on_demand.turns == ahead.turns == len(turns)
    assert on_demand.ssd_read_bytes > 0
    assert on_demand.latency_mean > ahead.latency_mean


class Spy(LRU):
    """LRU that checks the protocol the simulator drives."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.accesses: dict[str, int] = {}
        self.appends: list[KVMeta] = []
        self.victim_calls = 0

    def on_access(self, session: str, meta: KVMeta, now: float) -> None:
        self.accesses[session] = self.accesses.get(session, 0) + 1
        super().on_access(session, meta, now)

    def on_admit(self, session: str, meta: KVMeta, now: float) -> None:
        assert meta.tier == "host"
        super().on_admit(session, meta, now)
        assert self.resident_bytes() <= self.capacity

    def victims(
        self, need: int, now: float, view: MetadataView, protected: Set[str] = frozenset()
    ) -> list[str] | None:
        self.victim_calls += 1
        assert view.tiers[0].capacity == self.capacity
        chosen = super().victims(need, now, view, protected)
        assert not set(chosen or ()) & set(protected)
        return chosen


def test_policies_see_the_live_cache_protocol() -> None:
    turns = SyntheticWorkload(users=60, arrival_rate=0.5, seed=2).generate()
    cfg = SimConfig(host_gb=20)
    spy = Spy(int(20e9))
    sim = Simulator(turns, get_system("cachedattention", eviction="lru"), cfg, eviction=spy)
    r = sim.run()
    assert spy.victim_calls > 0
    assert r.evictions > 0
    assert 0 < r.host_hit_ratio < 1
    assert r.ssd_read_bytes > 0
    assert r.ssd_write_bytes > 0
    # every turn appends (one access); every turn with its history loaded reads it (another)
    loaded = int((sim.hit >= 0).sum())
    assert len(turns) < sum(spy.accesses.values()) <= len(turns) + loaded


def test_a_user_never_sends_before_the_previous_answer_ends() -> None:
    turns = SyntheticWorkload(users=80, arrival_rate=1.0, seed=3).generate()
    sim = Simulator(turns, get_system("vllm"), SimConfig(host_gb=10))
    sim.run()
    nxt = turns.next_index()
    has = nxt >= 0
    assert np.all(sim.arrival[nxt[has]] >= sim.finish[has] - 1e-9)
    assert np.all(sim.arrival >= turns.time - 1e-9)
    assert np.all(sim.finish >= sim.first_token)
    assert np.all(sim.first_token > sim.start)


def test_same_seed_same_result_in_one_or_two_processes() -> None:
    wl = WorkloadSpec(minutes=4, seed=9)
    cfg = SimConfig(host_gb=15)
    jobs = [
        Job(workload=wl, rate=20, system=SYSTEMS[name], config=cfg)
        for name in ("bidaw", "flashgen")
    ]
    one = run_jobs(jobs, workers=1)
    two = run_jobs(jobs, workers=2)
    assert one == two
    assert one[0].system == "bidaw"


def test_a_simulator_runs_once() -> None:
    sim = Simulator(one_turn(5, 5), get_system("ideal"))
    sim.run()
    with pytest.raises(RuntimeError, match="runs once"):
        sim.run()


def test_throughput_interpolates_at_the_slo() -> None:
    assert throughput([10, 20, 30], [1.0, 3.0, 9.0], 5.0) == pytest.approx(20 + 10 * 2 / 6)
    assert throughput([10, 20], [6.0, 9.0], 5.0) == 0.0
    assert throughput([10, 20], [1.0, 2.0], 5.0) == 20
    with pytest.raises(ValueError, match="one latency per rate"):
        throughput([1], [], 1.0)


def test_systems_compose_and_validate() -> None:
    mine = SystemSpec(name="mine", scheduler="bidaw", eviction="lfu", inclusive=True)
    r = simulate(SyntheticWorkload(users=10, seed=1).generate(), mine, SimConfig(host_gb=5))
    assert r.system == "mine"
    assert get_system("bidaw", scheduler="fcfs").scheduler == "fcfs"
    with pytest.raises(ValueError, match="presets: vllm"):
        get_system("sglang")
    with pytest.raises(ValueError, match="cache must be"):
        SystemSpec(name="x", cache="three-tier")
    with pytest.raises(ValueError, match="host_gb"):
        SimConfig(host_gb=0)
