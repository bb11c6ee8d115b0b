"""The simulator against the paper's own figures, on the synthetic workload (OPT-13B, A800,
200 GB of host memory, 5 s mean-latency SLO; 40 minutes of arrivals, steady state counted,
as ``tieredkv reproduce`` runs it), and the paper's ranking on three hours of the same
generator (the industrial trace's shape in its steady state).

A supported rate within +-15% of the paper's is pinned by two runs: at 0.85x the paper's
rate the system meets the SLO, at 1.15x it misses it (``docs/explanation/simulator.md``,
"Calibration", has the measured figures).
"""

from __future__ import annotations

import itertools

import msgspec
import pytest

from tieredkv.sim.analysis import live_kv
from tieredkv.sim.calibration import (
    PAPER_LATENCY_RATIO,
    PAPER_RATES,
    TRACE_SHAPED,
    TRACE_SHAPED_RATE,
)
from tieredkv.sim.config import steady_state
from tieredkv.sim.engine import SimConfig, SimResult
from tieredkv.sim.sweep import Job, run_job, run_jobs
from tieredkv.sim.synthetic import describe
from tieredkv.sim.systems import ABLATIONS, get_system
from tieredkv.sim.workloads import WorkloadSpec

# about 95 s in all on one core, run on every core: CI runs them
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SLO = 5.0
WORKLOAD = WorkloadSpec()  # synthetic, 40 minutes, seed 0
BAND = (0.85, 1.15)
ABLATION_RATE = round(PAPER_RATES["bidaw", 1.5] * BAND[0], 2)


def fg_high(bw: float) -> float:
    """The top of FlashGen's band: 1.15x its paper rate."""
    return round(PAPER_RATES["flashgen", bw] * BAND[1], 2)


def config(bw: float) -> SimConfig:
    return steady_state(SimConfig(ssd_gbps=bw), WORKLOAD)


def synthetic(name: str, bw: float, rate: float) -> Job:
    """A system (or an ablation step) on the synthetic workload at ``bw`` GB/s."""
    step = {s.name: s for s in ABLATIONS}
    system = step[name] if name in step else get_system(name)
    return Job(workload=WORKLOAD, rate=rate, system=system, config=config(bw))


def trace_shaped_job(name: str, rate: float, *, host_gb: float = 200.0) -> Job:
    return Job(
        workload=TRACE_SHAPED,
        rate=rate,
        system=get_system(name),
        config=steady_state(SimConfig(host_gb=host_gb), TRACE_SHAPED),
    )


SHAPED = ("vllm", "cachedattention", "flashgen", "bidaw", "ideal")
JOBS: dict[str, list[Job]] = {
    "test_supported_rate_within_the_band_of_the_paper": [
        synthetic(name, bw, round(PAPER_RATES[name, bw] * f, 2))
        for name, bw in PAPER_RATES
        for f in BAND
    ],
    "test_rankings_go_the_papers_way": [
        *(synthetic(name, bw, fg_high(bw)) for bw in (1.5, 5.0) for name in ("flashgen", "bidaw")),
        synthetic("flashgen", 5.0, fg_high(1.5)),
    ],
    "test_latency_ratio_has_the_papers_magnitude": [
        synthetic(name, 1.5, PAPER_RATES["flashgen", 1.5]) for name in ("flashgen", "bidaw")
    ],
    "test_ablation_steps_each_lower_the_latency": [
        synthetic(s.name, 1.5, ABLATION_RATE) for s in ABLATIONS
    ],
    "test_bidaws_tail_stays_within_twice_the_ideals": [
        synthetic(name, 1.5, 30.0) for name in ("bidaw", "ideal")
    ],
    "test_on_the_trace_shaped_workload_the_ranking_is_the_papers": [
        trace_shaped_job(name, TRACE_SHAPED_RATE) for name in SHAPED
    ],
    "test_past_the_host_cliff_flashgen_collapses_for_want_of_host_memory": [
        trace_shaped_job("bidaw", 15.0),
        trace_shaped_job("flashgen", 15.0),
        trace_shaped_job("flashgen", 15.0, host_gb=400.0),
        trace_shaped_job("ideal", 15.0),
    ],
}
"""The simulations each test reads (a test that reads one not listed here runs it then)."""


def key(job: Job) -> bytes:
    """A job's identity (a system's parameters are a dict: a job is not hashable)."""
    return msgspec.json.encode(job)


class Runs:
    """Every simulation the module's selected tests read, each run once, all of them at
    the module's start on every core (:func:`tieredkv.sim.sweep.run_jobs`: the results
    do not depend on the number of processes)."""

    def __init__(self, jobs: list[Job]) -> None:
        todo = list({key(job): job for job in jobs}.values())
        self._done = {key(job): r for job, r in zip(todo, run_jobs(todo), strict=True)}

    def job(self, job: Job) -> SimResult:
        if key(job) not in self._done:
            self._done[key(job)] = run_job(job)
        return self._done[key(job)]

    def __getitem__(self, key: tuple[str, float, float]) -> SimResult:
        return self.job(synthetic(*key))


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Runs:
    module = request.module.__name__
    names = {
        item.originalname
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.module.__name__ == module
    }
    return Runs([job for name in sorted(names) for job in JOBS.get(name, [])])


@pytest.mark.parametrize(("name", "bw"), list(PAPER_RATES), ids=lambda v: str(v))
def test_supported_rate_within_the_band_of_the_paper(runs: Runs, name: str, bw: float) -> None:
    lo, hi = BAND
    paper = PAPER_RATES[name, bw]
    below = runs[name, bw, round(paper * lo, 2)].latency_mean
    above = runs[name, bw, round(paper * hi, 2)].latency_mean
    assert below <= SLO, f"{name} @ {bw} GB/s misses the SLO at {lo}x the paper's rate"
    assert above > SLO, f"{name} @ {bw} GB/s still meets the SLO at {hi}x the paper's rate"


def test_rankings_go_the_papers_way(runs: Runs) -> None:
    """Bidaw supports more users than FlashGen at both bandwidths (where FlashGen misses
    the SLO, Bidaw meets it, with a higher host hit ratio), and both gain from a faster
    SSD (where FlashGen misses at 1.5 GB/s, it meets the SLO at 5 GB/s)."""
    for bw in (1.5, 5.0):
        rate = fg_high(bw)
        assert runs["flashgen", bw, rate].latency_mean > SLO
        assert runs["bidaw", bw, rate].latency_mean <= SLO
        assert runs["bidaw", bw, rate].host_hit_ratio > runs["flashgen", bw, rate].host_hit_ratio
    assert runs["flashgen", 1.5, fg_high(1.5)].latency_mean > SLO
    assert runs["flashgen", 5.0, fg_high(1.5)].latency_mean <= SLO


def test_latency_ratio_has_the_papers_magnitude(runs: Runs) -> None:
    """At FlashGen's supported rate its mean latency is the SLO; Bidaw's latency there is
    at least 3x lower, and not more than 15% beyond the paper's largest ratio, 3.58x
    (measured at the paper's FlashGen rate, which the band test pins within 15%; past
    FlashGen's knee its queue, and any ratio, grows without bound)."""
    rate = PAPER_RATES["flashgen", 1.5]
    assert runs["flashgen", 1.5, rate].latency_mean <= SLO
    ratio = SLO / runs["bidaw", 1.5, rate].latency_mean
    assert 3.0 <= ratio <= PAPER_LATENCY_RATIO * 1.15, ratio


def test_ablation_steps_each_lower_the_latency(runs: Runs) -> None:
    """The paper's ablation (CachedAttention, then I/O-aware scheduling, answer-based
    eviction and storage-efficient tensors added one at a time) improves at every step:
    at 0.85x Bidaw's paper rate (1.5 GB/s) each step's mean latency is lower than the one
    before, and only the whole of Bidaw meets the SLO."""
    latency = [runs[s.name, 1.5, ABLATION_RATE].latency_mean for s in ABLATIONS]
    assert all(a > b for a, b in itertools.pairwise(latency)), latency
    assert latency[-1] <= SLO < latency[-2], latency


def test_bidaws_tail_stays_within_twice_the_ideals(runs: Runs) -> None:
    """Issue 17's tail target at 30 users/min (1.5 GB/s), the highest swept rate below
    Bidaw's supported one, where the SSD is saturated at the peak: Bidaw meets the SLO and
    its P99 is at most twice the ideal's."""
    bidaw, ideal = runs["bidaw", 1.5, 30.0], runs["ideal", 1.5, 30.0]
    assert bidaw.latency_mean <= SLO
    assert bidaw.latency_p99 <= 2 * ideal.latency_p99, (bidaw.latency_p99, ideal.latency_p99)


# -- the real trace's shape, in its steady state -----------------------------------------
def trace_shaped(runs: Runs, name: str, rate: float, *, host_gb: float = 200.0) -> SimResult:
    return runs.job(trace_shaped_job(name, rate, host_gb=host_gb))


@pytest.fixture(scope="module")
def shaped(runs: Runs) -> dict[str, SimResult]:
    return {name: trace_shaped(runs, name, TRACE_SHAPED_RATE) for name in SHAPED}


def test_the_trace_shaped_workload_has_the_industrial_traces_shape() -> None:
    """Thousands of users, ~22 turns each, 35-token queries, 44-token answers, think times
    of median 43 s (``docs/explanation/simulator.md`` has the measured table); the mean
    live K/V in the counted window is the 200 GB of host memory."""
    turns = TRACE_SHAPED.turns(TRACE_SHAPED_RATE)
    shape = describe(turns)
    assert shape["users"] >= 2000
    assert 20 <= shape["turns_mean"] <= 25
    assert 33 <= shape["query_mean"] <= 38
    assert 42 <= shape["answer_mean"] <= 47
    assert 38 <= shape["gap_median"] <= 48
    config = steady_state(SimConfig(), TRACE_SHAPED)
    t, live = live_kv(turns, 819_200)
    window = live[(t >= config.warmup) & (t <= TRACE_SHAPED.minutes * 60)]
    assert 0.9 <= 200e9 / window.mean() <= 1.1


def test_on_the_trace_shaped_workload_the_ranking_is_the_papers(
    shaped: dict[str, SimResult],
) -> None:
    """Where the ideal meets the SLO and host memory holds the live K/V: Bidaw is the
    fastest caching system, both two-tier baselines come next within 4x of it (the
    paper: up to 3.58x), and recomputing every history (vLLM) is the slowest."""
    lat = {name: r.latency_mean for name, r in shaped.items()}
    assert lat["ideal"] <= SLO
    for baseline in ("cachedattention", "flashgen"):
        assert lat["bidaw"] < lat[baseline] <= 4 * lat["bidaw"], lat
        assert lat[baseline] < lat["vllm"], lat
    assert shaped["bidaw"].host_hit_ratio > shaped["flashgen"].host_hit_ratio


def test_past_the_host_cliff_flashgen_collapses_for_want_of_host_memory(runs: Runs) -> None:
    """At 15 users/min the ideal still meets the SLO (about 1.8 s), but the live K/V
    (about 270 GB) outgrows the 200 GB host memory: FlashGen's LRU loses the returning
    conversations, every miss stalls its GPU behind an on-demand SSD load, and the queue
    that forms lets LRU evict the KV of the very requests that run next, which are read
    back again: its host hit ratio (counted where the history is read) falls under 0.1 and
    its latency runs away. That is its design, not the model's: give it the 400 GB that
    hold the live K/V, and it is back within 4x of Bidaw."""
    bidaw = trace_shaped(runs, "bidaw", 15.0)
    collapsed = trace_shaped(runs, "flashgen", 15.0)
    roomy = trace_shaped(runs, "flashgen", 15.0, host_gb=400.0)
    assert trace_shaped(runs, "ideal", 15.0).latency_mean <= SLO
    assert collapsed.host_hit_ratio < 0.1
    assert collapsed.latency_mean > 20 * bidaw.latency_mean
    assert roomy.latency_mean <= 4 * bidaw.latency_mean
