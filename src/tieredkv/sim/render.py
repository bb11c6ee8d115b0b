"""The ``tieredkv reproduce`` report as Markdown: the tables of every experiment, the
summary, its plain note when nothing in it measures caching, and the paper's anchors next
to the simulated ones (:func:`render_markdown`, :func:`write_report`)."""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .calibration import calibration_rows, paper_setup
from .config import SimConfig, steady_state
from .plots import save_figures
from .workloads import degenerate_note

if TYPE_CHECKING:
    from .report import ReproduceReport

__all__ = ["render_markdown", "summary_note", "summary_table", "write_report"]


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
    caching: a degenerate run (too few users at the highest rate:
    :func:`~tieredkv.sim.workloads.degenerate_note`), or the ideal system (all KV in host
    memory) missing the SLO at every swept rate (``None`` otherwise, or when the ideal did
    not run)."""
    wl = report.options.workload
    few = degenerate_note(wl.kind, max([*report.rates, report.reference_rate]), wl.minutes)
    if few is not None:
        return few
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
    c = steady_state(o.config, o.workload)
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
            "(the plots extra: `pip install -e '.[plots]'` in a checkout, or "
            "`pip install matplotlib`, and run again). Tables only.\n"
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
    out.append(_systems_section(report))
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
    if report.agentic:
        out.append(_agentic_section(report))

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
    flat = [s for s, per in report.ssd_bandwidth.items() if len(set(per.values())) == 1]
    if flat and len(o.ssd_bandwidths) > 1:
        out.append(
            f"\n{', '.join(flat)}: the same throughput at every bandwidth. A flat line means "
            "the SSD does not limit that system here: at the lowest bandwidth it already "
            "loads what it needs while the GPU computes, and the GPU sets the rate (or the "
            "system met the SLO at every swept rate: sweep higher --rates)."
            + (
                " The paper measures Bidaw gaining 27.8 -> 30.4 users/min from 1.5 to 5 GB/s; "
                + _doc_link("the simulator", "calibration-against-the-papers-figures")
                + " says why this model does not."
                if "bidaw" in flat
                else ""
            )
            + "\n"
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


SYSTEM_MEANINGS = {
    "vllm": "vLLM without a KV cache between turns: each turn recomputes (prefills) the "
    "conversation's whole history",
    "cachedattention": "CachedAttention (ATC'24): host memory and SSD, FCFS with loads "
    "prefetched for the next 30 queued requests, queue-aware eviction",
    "flashgen": "FlashGen: host memory and SSD, inclusive (write-through), loads on demand "
    "while the GPU waits, LRU",
    "bidaw": "Bidaw (FAST'26): host memory and SSD, the I/O-aware dual-queue scheduler, "
    "eviction by the previous answer's length, storage-efficient tensors",
    "ideal": "an upper bound, not a system: every history stays in host memory (unbounded) "
    "and no turn waits for the SSD; only the GPU's compute limits it",
}
"""What each preset stands for, in the report's words (docs/explanation/simulator.md has
the details)."""


def _doc_link(text: str, anchor: str = "") -> str:
    """A Markdown link to docs/explanation/simulator.md: to the file in this checkout where
    the installed package is one (the report is written anywhere), else the path in the
    repository."""
    rel = "docs/explanation/simulator.md"
    page = Path(__file__).resolve().parents[3] / rel
    target = page.as_uri() if page.is_file() else rel
    return f"[{text}]({target}{'#' + anchor if anchor else ''}) (`{rel}`)"


def _systems_section(report: ReproduceReport) -> str:
    """What each system of the run is (for a preset) or is made of."""
    names = list(dict.fromkeys([*report.options.systems, *report.options.sensitivity_systems]))
    rows = [[n, SYSTEM_MEANINGS.get(n, "a system of your own (SystemSpec)")] for n in names]
    return (
        "\nSystems compared (their models: "
        + _doc_link("the simulator", "systems")
        + "):\n\n"
        + _table(["system", "what it is"], rows)
        + "\n"
    )


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


def _agentic_section(report: ReproduceReport) -> str:
    """Beyond the paper: the agentic mix's hit ratios per policy, and their ratio to
    Belady's."""
    policies = list(next(iter(report.agentic.values())))
    rows = []
    for label, hits in report.agentic.items():
        best = hits.get("belady", 0.0)
        rows.append(
            [
                label,
                *(f"{hits[p]:.3f} ({hits[p] / best:.2f}x)" if best else hits[p] for p in policies),
            ]
        )
    return (
        "\n\n### Beyond the paper: a human + agent mix\n\n"
        "The same replay on a mix of human and agent conversations (as many, arriving at "
        f"{report.reference_rate:g} per minute; half are agents calling tools of 20-80 "
        "tokens, 25% of which run 1-10 minutes), with callers that give no hints, "
        "correct hints or wrong hints of each tool's duration. Each cell is the hit ratio "
        "and its ratio to Belady's; `bidaw` is the default eviction (it learns the gap "
        "after tool calls and hints), `bidaw-paper` the paper's "
        "(`docs/explanation/bidaw-eviction.md`, *Beyond the paper*).\n\n"
        + _table(["callers", *policies], rows)
    )


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
    report.plots = save_figures(report, out)
    path = out / "report.md"
    path.write_text(render_markdown(report, command), encoding="utf-8")
    return path
