"""``tieredkv reproduce``: the paper's experiments on one workload, as a Markdown report
with PNG plots (plots need matplotlib: ``pip install 'tieredkv[plots]'``).

Experiments (each a section, a table and a figure):

1. mean response latency vs arrival rate, per system, and the throughput at the SLO;
2. host-memory hit ratio per eviction policy (eviction-only replay);
3. queueing time per system vs arrival rate (FCFS vs Bidaw's dual queue);
4. ablation: CachedAttention, then Bidaw's mechanisms one by one;
5. sensitivity to host-memory size, and 6. to SSD bandwidth (throughput);
7. weighted reuse distance vs previous answer length (lower bounds, Spearman), the share
   of accesses beyond host memory, and the KV load-time variation.

The *reference rate* of the single-rate experiments is, unless given, the lowest swept
rate at which host memory holds under half of the mean live KV (K/V bytes): the pressure
the paper studies.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ..policies import make_eviction
from .analysis import answer_groups, live_kv, reuse_distances, share_beyond
from .calibration import calibration_rows, paper_setup
from .costmodel import get_model
from .engine import SimConfig, SimResult
from .replay import replay
from .saturation import PAPER_SLO, default_slo, workload_slo
from .sweep import Job, curve_throughput, run_curves
from .synthetic import SyntheticWorkload, describe
from .systems import ABLATIONS, SystemSpec, get_system
from .workloads import WorkloadSpec

__all__ = [
    "SYNTHETIC_RATES",
    "TRACE_FRACTIONS",
    "ReproduceOptions",
    "ReproduceReport",
    "default_rates",
    "default_slo",
    "reproduce",
    "summary_note",
    "summary_table",
]

REPLAY_POLICIES = ("fifo", "lru", "lfu", "queue-enhanced", "bidaw", "belady")

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
    seconds: float = 0.0
    plots: list[str] = msgspec.field(default_factory=list)


def _measure(config: SimConfig, workload: WorkloadSpec) -> SimConfig:
    """Count the steady state of a generated workload only (not its ramp-up and -down)."""
    if workload.kind in ("synthetic", "sharegpt") and config.warmup == 0 and config.until is None:
        end = workload.minutes * 60.0
        return msgspec.structs.replace(config, warmup=0.375 * end, until=end)
    return config


def reproduce(
    options: ReproduceOptions, *, progress: Callable[[float], None] | None = None
) -> ReproduceReport:
    """Run every experiment of the module docstring and return the measurements."""
    started = time.monotonic()
    opts = options
    wl = opts.workload
    base = _measure(opts.config, wl)
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
        users = max(1, round(ref * wl.minutes))
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
        seconds=time.monotonic() - started,
    )


# -- rendering ------------------------------------------------------------------------
def _cell(v: object) -> str:
    """A table cell: integers (counts) with thousands separators; floats to 3 decimals
    below 10, else 1 (``-`` when not finite)."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return f"{int(v):,}"
    if isinstance(v, float):
        if not np.isfinite(v):
            return "-"
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cell = _cell
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def summary_table(report: ReproduceReport) -> str:
    """The report's summary: per system, throughput at the SLO and latency at the
    reference rate (Markdown)."""
    ref = report.reference_rate
    rows: list[list[object]] = []
    bidaw_tp = report.throughputs.get("bidaw")
    for name, r in report.reference.items():
        tp = report.throughputs[name]
        rel = f"{bidaw_tp / tp:.2f}x" if bidaw_tp and tp > 0 and name != "bidaw" else "-"
        rows.append(
            [
                name,
                tp,
                rel,
                r.latency_mean,
                r.latency_p90,
                r.latency_p99,
                r.queueing_mean,
                r.ttft_mean,
                r.host_hit_ratio if r.accesses else float("nan"),
                r.gpu_busy,
            ]
        )
    return _table(
        [
            "system",
            f"throughput (users/min, mean latency <= {report.slo:g} s)",
            "bidaw's throughput over it",
            f"mean latency @ {ref:g}/min (s)",
            "P90 (s)",
            "P99 (s)",
            "queueing (s)",
            "TTFT (s)",
            "host hit ratio",
            "GPU busy",
        ],
        rows,
    )


def summary_note(report: ReproduceReport) -> str | None:
    """A plain note under the summary when no throughput of it says anything about
    caching: the ideal system (all KV in host memory) misses the SLO at every swept rate
    (``None`` otherwise, or when the ideal did not run)."""
    ideal = report.sweep.get("ideal")
    if not ideal or any(r.latency_mean <= report.slo for r in ideal):
        return None
    lowest = min(report.rates)
    return (
        f"the ideal system (all KV in host memory) misses the {report.slo:.3g} s SLO at every "
        f"swept rate, {ideal[0].latency_mean:,.1f} s at the lowest ({lowest:g} users/min): "
        "every throughput here is 0 and the latencies measure queues, or requests too long "
        "for this model and GPU, not caching; sweep lower --rates, or choose a faster "
        "--model/--gpu"
    )


def render_markdown(report: ReproduceReport, command: str) -> str:
    """The report as Markdown (figures referenced by file name, if any were written)."""
    o = report.options
    c = _measure(o.config, o.workload)
    ref = report.reference_rate
    rates = list(report.rates)
    plots = set(report.plots)

    def fig(name: str, caption: str) -> str:
        return f"\n![{caption}]({name})\n" if name in plots else ""

    out: list[str] = []
    out.append("# tieredkv reproduce: Bidaw (FAST'26) experiments in simulation\n")
    out.append(f"Command: `{command}` ({report.seconds:.0f} s wall time).\n")
    if not plots:
        out.append(
            "Plots were not drawn: matplotlib is not installed "
            "(`pip install 'tieredkv[plots]'` and run again). Tables only.\n"
        )
    wl = o.workload
    source = wl.kind if not wl.paths else f"{wl.kind} ({', '.join(wl.paths)})"
    out.append("## Setup\n")
    out.append(
        _table(
            ["setting", "value"],
            [
                ["workload", source],
                ["minutes of arrivals (generated workloads)", f"{wl.minutes:g}"],
                ["seed", wl.seed],
                ["model", c.model],
                ["GPU", c.gpu],
                ["host memory (GB)", f"{c.host_gb:g}"],
                ["SSD bandwidth (GB/s)", f"{c.ssd_gbps:g}"],
                ["history cap (tokens)", c.history_cap],
                [
                    "turns counted from / to (s)",
                    f"{c.warmup:g} / {'end' if c.until is None else f'{c.until:g}'}",
                ],
                ["latency SLO of the throughput metric (s)", report.slo],
                ["reference rate (users/min)", ref],
                [
                    "native rate of the trace (users/min)",
                    report.native_rate if report.native_rate is not None else "- (generated)",
                ],
            ],
        )
    )
    out.append(_shape_section(report))
    out.append("\nLoad: mean live KV (K/V bytes of every active conversation) per rate.\n")
    out.append(
        _table(
            ["rate (users/min)", "mean live KV (GB)", "host memory / live KV"],
            [[r, report.live[r][0] / 1e9, report.live[r][1]] for r in rates],
        )
    )
    out.append("\n## Summary\n")
    out.append(summary_table(report))
    note = summary_note(report)
    if note is not None:
        out.append(f"\n**{note[0].upper()}{note[1:]}.**\n")
    out.append(_calibration_section(report, c))

    out.append("\n\n## 1. Response latency vs arrival rate\n")
    out.append(fig("latency_vs_rate.png", "mean latency vs arrival rate"))
    out.append(
        _table(
            ["rate (users/min)", *report.sweep],
            [
                [r, *(report.sweep[s][i].latency_mean for s in report.sweep)]
                for i, r in enumerate(rates)
            ],
        )
    )
    out.append(
        "\nMean / P95 / P99 response latency (s) per system and rate; the ideal's P99 is "
        "the yardstick of the tail (Bidaw's should stay within 2x of it where the ideal "
        "meets the SLO):\n"
    )
    out.append(
        _table(
            ["rate (users/min)", *report.sweep],
            [
                [
                    r,
                    *(
                        f"{_cell(x.latency_mean)} / {_cell(x.latency_p95)} / {_cell(x.latency_p99)}"
                        for x in (report.sweep[s][i] for s in report.sweep)
                    ),
                ]
                for i, r in enumerate(rates)
            ],
        )
    )
    out.append("\nTail latency at the reference rate (s):\n")
    out.append(
        _table(
            ["system", "mean", "P50", "P90", "P95", "P99"],
            [
                [s, x.latency_mean, x.latency_p50, x.latency_p90, x.latency_p95, x.latency_p99]
                for s, x in report.reference.items()
            ],
        )
    )

    out.append("\n\n## 2. Host-memory hit ratio per eviction policy\n")
    out.append(
        f"Eviction-only replay at {ref:g} users/min, {c.host_gb:g} GB of host memory, "
        "K/V bytes (turns before the warm-up not counted).\n"
    )
    out.append(fig("hit_ratio.png", "hit ratio per policy"))
    out.append(
        _table(
            ["policy", "hit ratio", "byte hit ratio"],
            [[p, h, b] for p, (h, b) in report.replay_hits.items()],
        )
    )

    out.append("\n\n## 3. Queueing time\n")
    out.append(fig("queueing.png", "queueing time vs arrival rate"))
    out.append(
        _table(
            ["rate (users/min)", *report.sweep],
            [
                [r, *(report.sweep[s][i].queueing_mean for s in report.sweep)]
                for i, r in enumerate(rates)
            ],
        )
    )

    out.append("\n\n## 4. Ablation\n")
    out.append(fig("ablation.png", "ablation"))
    steps = list(report.ablation.items())
    base_tp = steps[0][1][1] if steps else 0.0
    out.append(
        _table(
            [
                "configuration",
                f"mean latency @ {ref:g}/min (s)",
                "queueing (s)",
                "host hit ratio",
                "throughput (users/min)",
                "vs CachedAttention",
            ],
            [
                [
                    name,
                    r.latency_mean,
                    r.queueing_mean,
                    r.host_hit_ratio,
                    tp,
                    f"{tp / base_tp:.2f}x" if base_tp > 0 else "-",
                ]
                for name, (r, tp) in steps
            ],
        )
    )

    out.append("\n\n## 5. Host-memory size\n")
    out.append(fig("host_memory.png", "throughput vs host memory"))
    out.append(
        _table(
            ["system", *(f"{gb:g} GB" for gb in o.host_sizes)],
            [[s, *per.values()] for s, per in report.host_memory.items()],
        )
    )
    out.append("\n\n## 6. SSD bandwidth\n")
    out.append(fig("ssd_bandwidth.png", "throughput vs SSD bandwidth"))
    out.append(
        _table(
            ["system", *(f"{bw:g} GB/s" for bw in o.ssd_bandwidths)],
            [[s, *per.values()] for s, per in report.ssd_bandwidth.items()],
        )
    )

    out.append("\n\n## 7. Reuse distance vs previous answer length\n")
    out.append(fig("reuse_distance.png", "reuse distance lower bound vs answer length"))
    out.append(
        f"At {ref:g} users/min: Spearman correlation of previous answer length and the "
        f"lower bound of the weighted reuse distance **{report.spearman:.3f}** "
        f"(paper: 0.94-0.98); accesses whose reuse distance exceeds {c.host_gb:g} GB "
        f"of host memory: **{report.beyond_host:.1%}** (paper: 80%). KV load-time "
        "coefficient of variation per system: "
        + ", ".join(f"{s} {v:.0%}" for s, v in report.load_cv.items())
        + " (paper: > 90%).\n"
    )
    out.append(
        _table(
            ["previous answer (tokens, group start)", "lower bound (GB)", "accesses"],
            [[a, lb / 1e9, n] for a, lb, n in report.groups],
        )
    )
    out.append("")
    return "\n".join(out)


_SHAPE_ROWS = (
    ("users", "users"),
    ("turns", "turns"),
    ("rate_mean", "new users per minute, mean"),
    ("rate_peak", "new users per minute, busiest 10 minutes"),
    ("turns_mean", "turns per user, mean"),
    ("turns_median", "turns per user, median"),
    ("turns_p90", "turns per user, P90"),
    ("query_mean", "query tokens, mean"),
    ("answer_mean", "answer tokens, mean"),
    ("gap_p10", "think time between turns (s), P10"),
    ("gap_median", "think time between turns (s), median"),
    ("gap_p90", "think time between turns (s), P90"),
    ("final_context_median", "final context per user (tokens), median"),
    ("final_context_p90", "final context per user (tokens), P90"),
)


_COUNTS = frozenset(("users", "turns"))
"""Shape statistics that are counts (printed as integers)."""


def _count(v: float) -> object:
    """A count measured as a float, as an integer (``nan`` stays, printed ``-``)."""
    return int(v) if np.isfinite(v) else v


def _shape_section(report: ReproduceReport) -> str:
    """The workload's shape at the reference rate, next to the synthetic stand-in's."""
    shapes = report.shape
    if not shapes:
        return ""
    names = list(shapes)
    header = ["statistic", *("this workload" if n == "workload" else n for n in names)]
    nan = float("nan")
    rows = [
        [label, *(_count(shapes[n].get(key, nan)) if key in _COUNTS else shapes[n].get(key, nan)
                  for n in names)]
        for key, label in _SHAPE_ROWS
    ]  # fmt: skip
    text = f"\nWorkload shape at {report.reference_rate:g} users/min"
    if "synthetic" in shapes:
        text += (
            " next to the synthetic workload's at the same rate (the stand-in the paper's "
            "figures are calibrated on): where they differ, so will the results"
        )
    if report.native_rate is not None:
        text += (
            f". The trace carries {report.native_rate:.1f} users per minute; a rate below "
            "it keeps that fraction of its users (Bidaw format) or stretches its time "
            "(Mooncake)"
        )
    return text + ".\n\n" + _table(header, rows) + "\n"


def _calibration_section(report: ReproduceReport, config: SimConfig) -> str:
    """The paper's anchors next to this run's (only meaningful in the paper's setup)."""
    out = ["\n\n## Paper vs simulated\n"]
    if (
        not paper_setup(config)
        or config.ssd_gbps != 1.5
        or report.options.workload.kind != ("synthetic")
    ):
        out.append(
            "The paper's anchors were measured with OPT-13B on an A800, 200 GB of host memory "
            "and a 1.5 GB/s SSD on the authors' trace, which the synthetic workload stands "
            "in for; this run differs, so they are not compared.\n"
        )
        return "\n".join(out)
    rows = calibration_rows(report.rates, report.sweep, report.ssd_bandwidth, report.slo)
    out.append(
        "The supported rates come from sections 1 and 6 (interpolated on the swept rates); "
        "`docs/explanation/simulator.md` explains where they differ.\n"
    )
    out.append(
        _table(
            ["figure", "paper", "simulated", "simulated / paper"],
            [
                [
                    r.figure,
                    r.paper,
                    r.simulated,
                    f"{r.deviation:+.0%}" if np.isfinite(r.simulated) else "-",
                ]
                for r in rows
            ],
        )
    )
    return "\n".join(out)


def write_report(report: ReproduceReport, out_dir: str | os.PathLike[str], command: str) -> Path:
    """Write ``report.md`` (and PNG figures when matplotlib is available) into
    ``out_dir``; returns the Markdown file's path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report.plots = _plots(report, out)
    path = out / "report.md"
    path.write_text(render_markdown(report, command), encoding="utf-8")
    return path


def _plots(report: ReproduceReport, out: Path) -> list[str]:
    """Draw and save every figure as PNG into ``out``; returns their file names (none
    without matplotlib)."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return []
    written: list[str] = []
    for name, fig in figures(report):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written


def figures(report: ReproduceReport) -> Iterator[tuple[str, Any]]:
    """The report's figures, as ``(file name, matplotlib figure)``: each with a title,
    axes labelled with their units, and a legend where it draws several series (the
    caller closes them).

    :raises ModuleNotFoundError: without matplotlib
    """
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    rates = list(report.rates)
    per_rate = "arrival rate (users per minute)"
    where = f"{report.options.config.model}, {report.options.config.host_gb:g} GB host memory"

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, results in report.sweep.items():
        ax.plot(rates, [r.latency_mean for r in results], marker="o", label=name)
    ax.axhline(report.slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {report.slo:g} s")
    ax.set_yscale("log")
    ax.set_xlabel(per_rate)
    ax.set_ylabel("mean response latency (s, log scale)")
    ax.set_title(f"Response latency vs arrival rate ({where})")
    ax.legend()
    yield "latency_vs_rate.png", fig

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    names = list(report.replay_hits)
    ax.bar(names, [report.replay_hits[n][0] for n in names], color="tab:blue")
    ax.set_xlabel("eviction policy")
    ax.set_ylabel("host-memory hit ratio (hits / accesses)")
    ax.set_ylim(0, 1)
    ax.set_title(f"Hit ratio per eviction policy at {report.reference_rate:g} users/min")
    yield "hit_ratio.png", fig

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, results in report.sweep.items():
        ax.plot(rates, [max(r.queueing_mean, 1e-3) for r in results], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel(per_rate)
    ax.set_ylabel("mean queueing time (s, log scale)")
    ax.set_title("Queueing time (arrival to prefill) vs arrival rate")
    ax.legend()
    yield "queueing.png", fig

    fig, ax = plt.subplots(figsize=(7.2, 3.8))
    steps = list(report.ablation)
    ax.barh(steps[::-1], [report.ablation[s][1] for s in steps][::-1], color="tab:green")
    ax.set_xlabel(f"throughput (users per minute at mean latency <= {report.slo:g} s)")
    ax.set_ylabel("configuration")
    ax.set_title("Ablation: Bidaw's mechanisms added one by one")
    yield "ablation.png", fig

    for fname, data, xlabel, what in (
        ("host_memory.png", report.host_memory, "host memory (GB)", "host-memory size"),
        ("ssd_bandwidth.png", report.ssd_bandwidth, "SSD bandwidth (GB/s)", "SSD bandwidth"),
    ):
        fig, ax = plt.subplots(figsize=(6.0, 3.8))
        for name, per in data.items():
            ax.plot(list(per), list(per.values()), marker="o", label=name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"throughput (users per minute at <= {report.slo:g} s)")
        ax.set_title(f"Throughput vs {what}")
        ax.legend()
        yield fname, fig

    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    ax.plot([a for a, _, _ in report.groups], [lb / 1e9 for _, lb, _ in report.groups], marker="o")
    ax.set_xlabel("previous answer length (tokens)")
    ax.set_ylabel("reuse distance lower bound (GB)")
    ax.set_title(f"Reuse distance vs previous answer (Spearman {report.spearman:.2f})")
    yield "reuse_distance.png", fig
