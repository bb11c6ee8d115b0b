"""The ``tieredkv reproduce`` figures (matplotlib, the ``plots`` extra): each with a title,
axes labelled with their units, and a legend where it draws several series."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .report import ReproduceReport

__all__ = ["SYSTEM_COLORS", "figures", "save_figures", "system_color"]

SYSTEM_COLORS = {
    "vllm": "tab:blue",
    "cachedattention": "tab:orange",
    "flashgen": "tab:green",
    "bidaw": "tab:red",
    "ideal": "tab:purple",
}
"""Each preset's color in every figure (the order of matplotlib's default cycle, so the
latency figure of the five presets looks as it always did)."""

_OTHER_COLORS = ("tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan")


def system_color(name: str, others: list[str]) -> str:
    """``name``'s color: a preset's own (:data:`SYSTEM_COLORS`), else the next of a few
    others in the order ``others`` first met them (pass one list per report)."""
    if name in SYSTEM_COLORS:
        return SYSTEM_COLORS[name]
    if name not in others:
        others.append(name)
    return _OTHER_COLORS[others.index(name) % len(_OTHER_COLORS)]


def save_figures(report: ReproduceReport, out: Path) -> list[str]:
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
    others: list[str] = []
    per_rate = "arrival rate (users per minute)"
    where = f"{report.options.config.model}, {report.options.config.host_gb:g} GB host memory"

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, results in report.sweep.items():
        color = system_color(name, others)
        ax.plot(rates, [r.latency_mean for r in results], marker="o", label=name, color=color)
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
        queueing = [max(r.queueing_mean, 1e-3) for r in results]
        ax.plot(rates, queueing, marker="o", label=name, color=system_color(name, others))
    ax.set_yscale("log")
    ax.set_xlabel(per_rate)
    ax.set_ylabel("mean queueing time (s, log scale)")
    ax.set_title("Queueing time (arrival to prefill) vs arrival rate")
    ax.legend()
    yield "queueing.png", fig

    fig, ax = plt.subplots(figsize=(7.2, 3.8))
    steps = list(report.ablation)
    # the first step is CachedAttention and the last Bidaw: their colors; the steps between
    colors = [
        SYSTEM_COLORS["bidaw"] if s.endswith("(bidaw)") else SYSTEM_COLORS.get(s, "tab:olive")
        for s in steps
    ]
    ax.barh(steps[::-1], [report.ablation[s][1] for s in steps][::-1], color=colors[::-1])
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
            color = system_color(name, others)
            ax.plot(list(per), list(per.values()), marker="o", label=name, color=color)
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
