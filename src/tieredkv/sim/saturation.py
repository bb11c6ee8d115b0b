"""The latency SLO, and whether a run measures anything: a rate where the all-in-memory
ideal keeps up, and a plain note when it does not.

A table in which every system's mean latency is far past the SLO says nothing about
caching: one GPU cannot keep up with the workload at that rate even with every history in
host memory, so every system's latency is the length of its queue. :func:`ideal_rate`
finds, for a recorded trace, the highest of ``native / 2, native / 4, ...`` at which the
ideal system meets the SLO (the ideal's runs are cheap: no I/O, no eviction), which is
what ``tieredkv simulate`` runs on a trace when no ``--rate`` is given, and
:func:`saturation_note` says when every system misses the SLO, why (the ideal system
probed at a rate :data:`PROBE_FACTOR` times lower tells), and what to change.
"""

from __future__ import annotations

import numpy as np

from .engine import SimConfig, SimResult, simulate
from .systems import get_system
from .trace import Turns
from .workloads import WorkloadSpec

__all__ = [
    "PAPER_SLO",
    "PROBE_FACTOR",
    "default_slo",
    "ideal_rate",
    "saturation_note",
    "workload_slo",
]

PAPER_SLO = 5.0
"""The paper's mean-latency SLO, seconds, for answers of 44 tokens on average."""
_PAPER_ANSWER = 44.0
PROBE_FACTOR = 8.0
"""A saturated run's rate divided by this is where the ideal system is probed."""
_HALVINGS = 8
""":func:`ideal_rate` tries the native rate halved 1 to this many times."""


def default_slo(mean_answer: float) -> float:
    """The paper's 5 s SLO, stretched for workloads whose answers are longer than the
    industrial trace's 44 tokens on average (decoding time grows with the answer):
    ``5 * max(1, mean_answer / 44)`` seconds."""
    return PAPER_SLO * max(1.0, mean_answer / _PAPER_ANSWER)


def workload_slo(workload: WorkloadSpec, turns: Turns) -> float:
    """The SLO a run of ``workload`` (as ``turns``) is judged by: 5 s for the synthetic
    workload (the paper's shape), else :func:`default_slo` of its mean answer."""
    if workload.kind == "synthetic" or not len(turns):
        return PAPER_SLO
    return default_slo(float(np.mean(turns.answer)))


def ideal_rate(workload: WorkloadSpec, config: SimConfig) -> tuple[float, float, bool]:
    """For a recorded trace: the highest of ``native / 2, native / 4, ...`` (at most
    :data:`_HALVINGS` halvings) at which the ideal system's mean latency meets the SLO.

    :returns: ``(rate, slo, met)``; when no such rate meets the SLO, the lowest tried with
        ``met=False``
    :raises ValueError: for a generated workload (it has no native rate)
    """
    native = workload.native_rate()
    if native is None:
        raise ValueError(f"the {workload.kind} workload has no native rate")
    ideal = get_system("ideal")
    rate, slo = native, PAPER_SLO
    for k in range(1, _HALVINGS + 1):
        rate = native / 2**k
        turns = workload.turns(rate)
        slo = workload_slo(workload, turns)
        if simulate(turns, ideal, config).latency_mean <= slo:
            return rate, slo, True
    return rate, slo, False


def saturation_note(
    ideal: SimResult, slo: float, *, probe: tuple[float, SimResult] | None = None
) -> str | None:
    """A plain sentence when the ideal system (all KV in host memory) misses the SLO at
    the rate it ran at, saying why and what to change (``None`` when it meets it: then a
    system that misses the SLO misses it for a reason of its own).

    :param ideal: the ideal system's result at the run's rate
    :param slo: the mean-latency SLO, seconds
    :param probe: ``(rate, result)`` of the ideal system at a much lower rate, which tells
        the two cases apart: it meets the SLO there (*saturated*: lower the rate), or it
        does not (*too slow*: single requests take longer than the SLO on this model and
        GPU, whatever the rate)
    """
    if ideal.latency_mean <= slo:
        return None
    head = (
        f"even the ideal system (all KV in host memory) misses the {slo:.3g} s SLO at this "
        f"rate ({ideal.latency_mean:,.1f} s)"
    )
    if probe is None:
        return (
            f"{head}: the table measures queues, or requests too long for this model and "
            "GPU, not caching; lower --rate, or choose a faster --model/--gpu"
        )
    rate, low = probe
    if low.latency_mean <= slo:
        return (
            f"saturated: {head}: one GPU cannot keep up with this workload at this rate, so "
            f"the table measures queues, not caching; at {rate:.4g} users/min the ideal "
            f"system meets the SLO ({low.latency_mean:.3g} s): lower --rate"
        )
    return (
        f"too slow for the SLO: {head}, and at {rate:.4g} users/min too "
        f"({low.latency_mean:,.1f} s): the requests themselves take longer than the SLO on "
        "this model and GPU (long prompts; those beyond the GPU's K/V memory run one at a "
        "time), so a lower rate will not help; choose a faster --model/--gpu (a "
        "long-context model on a larger GPU)"
    )
