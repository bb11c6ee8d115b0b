"""Many simulations at once (in worker processes), and the paper's throughput metric.

The throughput of a system is the highest arrival rate (users per minute) whose mean
response latency stays under a latency SLO. :func:`throughput` finds it on a sweep of
rates, interpolating linearly between the last rate under the SLO and the first above.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Hashable, Mapping, Sequence, Set
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import TypeVar

import msgspec

from .engine import SimConfig, SimResult, simulate
from .systems import SystemSpec
from .workloads import WorkloadSpec

__all__ = ["Job", "curve_throughput", "run_curves", "run_job", "run_jobs", "throughput"]

_K = TypeVar("_K", bound=Hashable)


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """One simulation: a workload at a rate, a system, a configuration.

    :param workload: the workload
    :param rate: users per minute
    :param system: the serving system
    :param config: hardware and engine settings
    """

    workload: WorkloadSpec
    rate: float
    system: SystemSpec
    config: SimConfig

    def weight(self) -> float:
        """Rough relative cost (for progress reporting): proportional to the rate."""
        return self.rate


def run_job(job: Job) -> SimResult:
    """Run one job in this process."""
    return simulate(job.workload.turns(job.rate), job.system, job.config)


def run_jobs(
    jobs: Sequence[Job],
    *,
    workers: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> list[SimResult]:
    """Run ``jobs`` (in ``workers`` processes; 1: in this one) and return their results
    in the same order. Results do not depend on ``workers``.

    :param workers: processes; ``None``: one per CPU core
    :param progress: called with the fraction of the work done after each job
    """
    if workers is None:
        workers = os.cpu_count() or 1
    total = sum(j.weight() for j in jobs) or 1.0
    done = 0.0
    results: list[SimResult | None] = [None] * len(jobs)
    if workers <= 1 or len(jobs) <= 1:
        for i, job in enumerate(jobs):
            results[i] = run_job(job)
            done += job.weight()
            if progress is not None:
                progress(done / total)
    else:
        # heaviest first, so the last job to finish is a short one
        order = sorted(range(len(jobs)), key=lambda i: -jobs[i].weight())
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(run_job, jobs[i]): i for i in order}
            for future in as_completed(futures):
                i = futures[future]
                results[i] = future.result()
                done += jobs[i].weight()
                if progress is not None:
                    progress(done / total)
    return [r for r in results if r is not None]


def throughput(rates: Sequence[float], latencies: Sequence[float], slo: float) -> float:
    """The highest rate whose mean latency is under ``slo``, on a sweep.

    Walking the rates upward, the answer lies between the last rate under the SLO and the
    first one above it, interpolated linearly in latency; ``0`` if even the lowest rate
    misses the SLO, and the highest rate if none does (the sweep did not go far enough).
    """
    if len(rates) != len(latencies):
        raise ValueError("one latency per rate")
    pairs = sorted(zip(rates, latencies, strict=True))
    best = 0.0
    for (r0, l0), (r1, l1) in itertools.pairwise(pairs):
        if l0 > slo:
            return best
        best = r0
        if l1 > slo:
            if math.isfinite(l1) and l1 > l0:
                return r0 + (r1 - r0) * (slo - l0) / (l1 - l0)
            return r0
    if pairs and pairs[-1][1] <= slo:
        return pairs[-1][0]
    return best


def run_curves(
    jobs: Mapping[_K, Job],
    curves: Sequence[Sequence[_K]],
    slo: float,
    *,
    must: Set[_K] = frozenset(),
    workers: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> dict[_K, SimResult]:
    """Run latency-vs-rate curves, each stopping at its first rate past ``slo``.

    A curve is a sequence of job keys in ascending rate. Its throughput
    (:func:`curve_throughput`) cannot change past the first rate whose mean latency
    misses the SLO, and saturated runs are the slowest, so later rates are skipped unless
    in ``must``. Rates run in phases (every curve's first rate, then every second...), each
    phase in ``workers`` processes; a key shared by several curves runs once.

    :returns: the result of every job that ran, by key
    """
    results: dict[_K, SimResult] = {}
    total = sum(jobs[k].weight() for k in {k for ks in curves for k in ks}) or 1.0
    done = 0.0
    for step in range(max((len(ks) for ks in curves), default=0)):
        wanted: dict[_K, None] = {}
        for ks in curves:
            if step < len(ks) and (
                ks[step] in must or all(_meets(results.get(k), slo) for k in ks[:step])
            ):
                wanted[ks[step]] = None
        todo = [k for k in wanted if k not in results]
        weight = sum(jobs[k].weight() for k in todo)

        def phase(f: float, before: float = done, weight: float = weight) -> None:
            if progress is not None:
                progress((before + f * weight) / total)

        results.update(zip(todo, run_jobs([jobs[k] for k in todo], workers=workers,
                                          progress=phase), strict=True))  # fmt: skip
        done += weight
    if progress is not None:
        progress(1.0)
    return results


def curve_throughput(
    results: Mapping[_K, SimResult], keys: Sequence[_K], rates: Sequence[float], slo: float
) -> float:
    """:func:`throughput` on the prefix of a curve that :func:`run_curves` ran."""
    n = next((i for i, k in enumerate(keys) if k not in results), len(keys))
    return throughput(rates[:n], [results[k].latency_mean for k in keys[:n]], slo)


def _meets(result: SimResult | None, slo: float) -> bool:
    return result is not None and result.latency_mean <= slo
