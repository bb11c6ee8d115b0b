"""``tieredkv reproduce``: the paper's experiments on one workload, as a Markdown report
with PNG plots (plots need matplotlib, the ``plots`` extra).

Experiments (each a section, a table and a figure):

1. mean response latency vs arrival rate, per system, and the throughput at the SLO;
2. host-memory hit ratio per eviction policy (eviction-only replay), and beyond the
   paper, on a human + agent mix of the same size (no caller hints, correct hints, wrong
   hints), each policy's ratio to Belady's;
3. queueing time per system vs arrival rate (FCFS vs Bidaw's dual queue);
4. ablation: CachedAttention, then Bidaw's mechanisms one by one;
5. sensitivity to host-memory size, and 6. to SSD bandwidth (throughput);
7. weighted reuse distance vs previous answer length (lower bounds, Spearman), the share
   of accesses beyond host memory, and the KV load-time variation.

The *reference rate* of the single-rate experiments is, unless given, the lowest swept
rate at which host memory holds under half of the mean live KV (K/V bytes): the pressure
the paper studies. The report is rendered by :mod:`.render` (Markdown) and :mod:`.plots`
(figures); both are re-exported here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from ..policies import make_eviction
from .agentic import AgenticWorkload, replay_agentic
from .analysis import answer_groups, live_kv, reuse_distances, share_beyond
from .config import SimConfig, SimResult, steady_state
from .costmodel import get_model
from .plots import figures
from .render import render_markdown, summary_note, summary_table, write_report
from .replay import replay
from .saturation import PAPER_SLO, default_slo, workload_slo
from .sweep import Job, curve_throughput, run_curves
from .synthetic import SyntheticWorkload, describe
from .systems import ABLATIONS, SystemSpec, get_system
from .workloads import WorkloadSpec, generated_users

__all__ = [
    "AGENTIC_HINTS",
    "AGENTIC_POLICIES",
    "SYNTHETIC_RATES",
    "TRACE_FRACTIONS",
    "ReproduceOptions",
    "ReproduceReport",
    "agentic_hits",
    "default_rates",
    "default_slo",
    "figures",
    "render_markdown",
    "reproduce",
    "summary_note",
    "summary_table",
    "write_report",
]

REPLAY_POLICIES = ("fifo", "lru", "lfu", "queue-enhanced", "bidaw-paper", "belady")

AGENTIC_POLICIES = ("lru", "bidaw-paper", "bidaw", "belady")
"""Policies of the agentic replay: recency, the paper's eviction, the default (which
learns the gap per tool call and hint) and the oracle."""

AGENTIC_HINTS = {"no hints": (0.0, 0.0), "correct hints": (1.0, 0.0), "wrong hints": (1.0, 1.0)}
"""The agentic replay's callers: the share of agent conversations whose caller hints the
tool's duration, and the share of those whose hints are wrong."""

SYNTHETIC_RATES = (5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0)
"""Default sweep of generated workloads (synthetic, ShareGPT), users per minute."""

TRACE_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 3 / 8, 1 / 2, 3 / 4, 1.0)
"""Default sweep of a recorded trace, as fractions of its native users per minute: never
above what the trace carries, and down to where one GPU keeps up with it."""


def default_rates(workload: WorkloadSpec) -> tuple[float, ...]:
    """The sweep ``reproduce`` runs when none is given: :data:`SYNTHETIC_RATES` for
    generated workloads, :data:`TRACE_FRACTIONS` of the native rate for a trace."""
    native = workload.native_rate()
    if native is None:
        return SYNTHETIC_RATES
    # two decimals, rounded down: a rate above the native one cannot be sampled
    return tuple(math.floor(native * f * 100) / 100 for f in TRACE_FRACTIONS)


class ReproduceOptions(msgspec.Struct, frozen=True, kw_only=True):
    """What ``tieredkv reproduce`` runs.

    :param workload: the workload
    :param config: model, GPU, host memory, SSD and engine settings
    :param systems: system presets of the main comparison
    :param rates: arrival rates swept, users per minute (``None``: :func:`default_rates`)
    :param rate: reference rate of the single-rate experiments (``None``: see the module)
    :param slo: mean-latency SLO of the throughput metric, seconds (``None``: 5, or for a
        trace or ShareGPT :func:`default_slo` of its mean answer length)
    :param host_sizes: host-memory sizes of the sensitivity experiment, GB
    :param ssd_bandwidths: SSD bandwidths of the sensitivity experiment, GB/s
    :param sensitivity_systems: systems of the sensitivity experiments
    :param workers: worker processes (``None``: one per core)
    """

    workload: WorkloadSpec = msgspec.field(default_factory=WorkloadSpec)
    config: SimConfig = msgspec.field(default_factory=SimConfig)
    systems: tuple[str, ...] = ("vllm", "cachedattention", "flashgen", "bidaw", "ideal")
    rates: tuple[float, ...] | None = None
    rate: float | None = None
    slo: float | None = None
    host_sizes: tuple[float, ...] = (120, 160, 200)
    ssd_bandwidths: tuple[float, ...] = (1.5, 5.0)
    sensitivity_systems: tuple[str, ...] = ("flashgen", "bidaw")
    workers: int | None = None


class ReproduceReport(msgspec.Struct, kw_only=True):
    """Everything ``reproduce`` measured (the Markdown is rendered from it).

    :param options: what ran
    :param reference_rate: the single-rate experiments' rate, users per minute
    :param live: per rate, (mean live KV bytes, host bytes / mean live KV)
    :param sweep: per system name, one result per rate (``rates`` order)
    :param throughputs: per system name, users per minute at the SLO
    :param replay_hits: per eviction policy, (hit ratio, byte hit ratio)
    :param agentic: per callers' hints (:data:`AGENTIC_HINTS`), per eviction policy
        (:data:`AGENTIC_POLICIES`), the hit ratio of the eviction-only replay of a human +
        agent mix (:class:`~tieredkv.sim.agentic.AgenticWorkload`) with as many
        conversations, arriving at the reference rate
    :param ablation: per step name, (result at the reference rate, throughput)
    :param host_memory: per system name, per host size, throughput
    :param ssd_bandwidth: per system name, per bandwidth, throughput
    :param groups: previous-answer groups: (answer tokens, lower bound bytes, count)
    :param spearman: Spearman correlation of answer length and lower bound
    :param beyond_host: share of accesses whose reuse distance exceeds host memory
    :param load_cv: per system name, KV load-time CV at the reference rate
    :param reference: per system name, the result at the reference rate (simulated there
        even when the sweep does not include that rate)
    :param rates: the rates swept (sorted), users per minute
    :param slo: the SLO of the throughput metric, seconds
    :param native_rate: users per minute of a recorded trace (``None``: generated)
    :param shape: the workload's shape (:func:`~tieredkv.sim.synthetic.describe`) at the
        reference rate, and (for a trace or ShareGPT) the synthetic workload's at the same
        rate, keyed ``"workload"`` and ``"synthetic"``
    :param seconds: wall time of the run
    :param plots: figure file names written (empty without matplotlib)
    """

    options: ReproduceOptions
    reference_rate: float
    live: dict[float, tuple[float, float]]
    sweep: dict[str, list[SimResult]]
    throughputs: dict[str, float]
    replay_hits: dict[str, tuple[float, float]]
    ablation: dict[str, tuple[SimResult, float]]
    host_memory: dict[str, dict[float, float]]
    ssd_bandwidth: dict[str, dict[float, float]]
    groups: list[tuple[int, float, int]]
    spearman: float
    beyond_host: float
    load_cv: dict[str, float]
    reference: dict[str, SimResult] = msgspec.field(default_factory=dict)
    rates: tuple[float, ...] = ()
    slo: float = PAPER_SLO
    native_rate: float | None = None
    shape: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    agentic: dict[str, dict[str, float]] = msgspec.field(default_factory=dict)
    seconds: float = 0.0
    plots: list[str] = msgspec.field(default_factory=list)


def reproduce(
    options: ReproduceOptions, *, progress: Callable[[float], None] | None = None
) -> ReproduceReport:
    """Run every experiment of the module docstring and return the measurements."""
    started = time.monotonic()
    opts = options
    wl = opts.workload
    base = steady_state(opts.config, wl)
    model = get_model(base.model)
    kv_bpt = model.kv_bytes_per_token
    host_bytes = base.host_gb * 1e9
    native = wl.native_rate()
    rates = tuple(sorted(opts.rates if opts.rates is not None else default_rates(wl)))
    if not rates:
        raise ValueError("give at least one arrival rate")

    # live KV per rate (cheap: generation only), and the reference rate
    live: dict[float, tuple[float, float]] = {}
    for r in rates:
        t, v = live_kv(wl.turns(r), kv_bpt, base.history_cap)
        window = (t >= base.warmup) & (t <= (base.until if base.until is not None else np.inf))
        mean_live = float(v[window].mean()) if window.any() else float(v.mean())
        live[r] = (mean_live, host_bytes / mean_live if mean_live > 0 else float("inf"))
    ref = opts.rate
    if ref is None:
        under = [r for r in rates if live[r][1] < 0.5]
        ref = under[0] if under else rates[-1]
    ref_turns = wl.turns(ref)
    shape = {"workload": describe(ref_turns)}
    if wl.kind != "synthetic":
        users = generated_users(ref, wl.minutes)
        synthetic = SyntheticWorkload(users=users, arrival_rate=ref / 60, seed=wl.seed)
        shape["synthetic"] = describe(synthetic.generate())
    slo = opts.slo if opts.slo is not None else workload_slo(wl, ref_turns)

    # every simulation, deduplicated (a preset and an equal ablation step run once)
    jobs: dict[bytes, Job] = {}

    def job(system: SystemSpec, rate: float, config: SimConfig) -> bytes:
        key = msgspec.json.encode((msgspec.structs.replace(system, name=""), rate, config, wl))
        if key not in jobs:
            jobs[key] = Job(workload=wl, rate=rate, system=system, config=config)
        return key

    sweep_keys = {name: [job(get_system(name), r, base) for r in rates] for name in opts.systems}
    # the single-rate figures of every system, at the reference rate itself (a job of the
    # sweep when the sweep includes that rate)
    ref_keys = {name: job(get_system(name), ref, base) for name in opts.systems}
    rate_set = sorted({*rates, ref})
    ablation_keys = {s.name: [job(s, r, base) for r in rate_set] for s in ABLATIONS}
    host_keys = {
        name: {
            gb: [job(get_system(name), r, msgspec.structs.replace(base, host_gb=gb)) for r in rates]
            for gb in opts.host_sizes
        }
        for name in opts.sensitivity_systems
    }
    ssd_keys = {
        name: {
            bw: [
                job(get_system(name), r, msgspec.structs.replace(base, ssd_gbps=bw)) for r in rates
            ]
            for bw in opts.ssd_bandwidths
        }
        for name in opts.sensitivity_systems
    }
    # curves measured only for a throughput (ablation, sensitivity) stop at their first
    # rate past the SLO; the main sweep runs every rate (its table shows them all)
    full = list(sweep_keys.values())
    partial = [
        *ablation_keys.values(),
        *(ks for per in host_keys.values() for ks in per.values()),
        *(ks for per in ssd_keys.values() for ks in per.values()),
    ]
    must = {k for ks in full for k in ks} | set(ref_keys.values())
    must |= {ks[rate_set.index(ref)] for ks in ablation_keys.values()}
    sim_share = 0.9

    def sim_progress(f: float) -> None:
        if progress is not None:
            progress(sim_share * f)

    results = run_curves(
        jobs,
        [*full, *([k] for k in ref_keys.values()), *partial],
        slo,
        must=must,
        workers=opts.workers,
        progress=sim_progress,
    )

    def tput(ks: Sequence[bytes], rs: Sequence[float]) -> float:
        return curve_throughput(results, ks, rs, slo)

    sweep = {name: [results[k] for k in ks] for name, ks in sweep_keys.items()}
    throughputs = {name: tput(ks, rates) for name, ks in sweep_keys.items()}
    ablation = {
        name: (results[ks[rate_set.index(ref)]], tput(ks, rate_set))
        for name, ks in ablation_keys.items()
    }
    host_memory = {
        name: {gb: tput(ks, rates) for gb, ks in per.items()} for name, per in host_keys.items()
    }
    ssd_bandwidth = {
        name: {bw: tput(ks, rates) for bw, ks in per.items()} for name, per in ssd_keys.items()
    }
    reference = {name: results[k] for name, k in ref_keys.items()}
    load_cv = {name: r.load_time_cv for name, r in reference.items()}

    # eviction-only replay and the reuse-distance analysis at the reference rate
    turns = ref_turns
    replay_hits: dict[str, tuple[float, float]] = {}
    first = int(np.searchsorted(turns.time, base.warmup))
    for name in REPLAY_POLICIES:
        rr = replay(
            turns,
            make_eviction(name),
            host_bytes=int(host_bytes),
            bytes_per_token=kv_bpt,
            history_cap=base.history_cap,
            warmup=first,
        )
        replay_hits[name] = (rr.hit_ratio, rr.byte_hit_ratio)
    agentic = agentic_hits(
        len(np.unique(turns.user)),
        ref / 60.0,
        wl.seed,
        host_bytes=int(host_bytes),
        bytes_per_token=kv_bpt,
        history_cap=base.history_cap,
        warmup=base.warmup,
    )
    if progress is not None:
        progress(0.95)
    d, pa = reuse_distances(
        turns,
        kv_bpt,
        base.history_cap,
        start=base.warmup,
        end=base.until if base.until is not None else np.inf,
    )
    g = answer_groups(d, pa)
    if progress is not None:
        progress(1.0)
    return ReproduceReport(
        options=opts,
        reference_rate=ref,
        live=live,
        sweep=sweep,
        throughputs=throughputs,
        replay_hits=replay_hits,
        ablation=ablation,
        host_memory=host_memory,
        ssd_bandwidth=ssd_bandwidth,
        groups=list(zip(g.answer, g.lower_bound, g.count, strict=True)),
        spearman=g.spearman,
        beyond_host=share_beyond(d, host_bytes),
        load_cv=load_cv,
        reference=reference,
        rates=rates,
        slo=slo,
        native_rate=native,
        shape=shape,
        agentic=agentic,
        seconds=time.monotonic() - started,
    )


def agentic_hits(
    users: int,
    arrival_rate: float,
    seed: int,
    *,
    host_bytes: int,
    bytes_per_token: int,
    history_cap: int,
    warmup: float,
) -> dict[str, dict[str, float]]:
    """Hit ratios of the eviction-only replay of a human + agent mix
    (:class:`~tieredkv.sim.agentic.AgenticWorkload`: ``users`` conversations, half of them
    agents, arriving at ``arrival_rate`` per second), per callers' hints
    (:data:`AGENTIC_HINTS`) and per policy (:data:`AGENTIC_POLICIES`); turns before
    ``warmup`` seconds are not counted."""
    out: dict[str, dict[str, float]] = {}
    for label, (hinted, wrong) in AGENTIC_HINTS.items():
        load = AgenticWorkload(
            users=users, arrival_rate=arrival_rate, hinted=hinted, wrong=wrong, seed=seed
        ).generate()
        first = int(np.searchsorted(load.turns.time, warmup))
        out[label] = {
            name: replay_agentic(
                load,
                make_eviction(name),
                host_bytes=host_bytes,
                bytes_per_token=bytes_per_token,
                history_cap=history_cap,
                warmup=first,
            ).hit_ratio
            for name in AGENTIC_POLICIES
        }
    return out
