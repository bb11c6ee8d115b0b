"""How the systems' ranking moves with the hardware, the model and the workload.

``python -m tieredkv.sim.sensitivity --out DIR`` varies one setting at a time around the
paper's setup (OPT-13B, A800, 200 GB host memory, 1.5 GB/s SSD, the synthetic workload)
and measures every system's supported rate (users per minute whose mean latency meets the
SLO) at each value: SSD bandwidth, host memory, model, prefill efficiency (``mfu``) and
answer length. It writes ``sensitivity.md`` (a table per setting) and, with matplotlib, one
plot per setting. ``docs/explanation/sensitivity.md`` discusses a run.

Each supported rate comes from a sweep of arrival rates that stops at its first rate past
the SLO (:func:`~tieredkv.sim.sweep.run_curves`).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from .config import steady_state
from .engine import SimConfig
from .sweep import Job, curve_throughput, run_curves
from .systems import get_system
from .workloads import WorkloadSpec

__all__ = ["AXES", "RATES", "SYSTEMS", "Sensitivity", "main", "sensitivity"]

SYSTEMS = ("vllm", "cachedattention", "flashgen", "bidaw", "ideal")
"""The systems compared."""

RATES = (5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 35.0, 40.0, 50.0, 60.0)
"""Arrival rates swept for each supported rate, users per minute (stopping past the SLO)."""

AXES: dict[str, tuple[Any, ...]] = {
    "ssd_gbps": (1.5, 5.0, 12.0),
    "host_gb": (100.0, 200.0, 400.0),
    "model": ("opt-6.7b", "opt-13b", "llama-3-8b"),
    "mfu": (0.2, 0.35, 0.6),
    "answer_scale": (0.5, 1.0, 2.0),
}
"""The settings varied and their values (``answer_scale`` multiplies the synthetic
workload's answer lengths; the others are :class:`~tieredkv.sim.engine.SimConfig` fields)."""

_LABELS = {
    "ssd_gbps": "SSD bandwidth (GB/s)",
    "host_gb": "host memory (GB)",
    "model": "model",
    "mfu": "prefill efficiency (fraction of peak)",
    "answer_scale": "answer length (x the industrial trace's)",
}


class Sensitivity(msgspec.Struct, kw_only=True):
    """Supported rates per setting, per value, per system (users per minute).

    :param slo: the mean-latency SLO, seconds
    :param throughput: ``throughput[axis][value][system]``
    :param seconds: wall time of the run
    """

    slo: float
    throughput: dict[str, dict[str, dict[str, float]]]
    seconds: float = 0.0


def _point(axis: str, value: Any, minutes: float) -> tuple[WorkloadSpec, SimConfig]:
    scale = value if axis == "answer_scale" else 1.0
    workload = WorkloadSpec(minutes=minutes, answer_scale=scale)
    config = SimConfig() if axis == "answer_scale" else SimConfig(**{axis: value})
    return workload, steady_state(config, workload)


def sensitivity(
    axes: Sequence[str] = tuple(AXES),
    *,
    slo: float = 5.0,
    minutes: float = 40.0,
    workers: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> Sensitivity:
    """Measure every system's supported rate at each value of each axis in ``axes``.

    :param minutes: minutes of arrivals of the synthetic workload (steady state counted)

    :raises ValueError: for an axis not in :data:`AXES`
    """
    started = time.monotonic()
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ValueError(f"unknown axes {unknown}; choose from {', '.join(AXES)}")
    jobs: dict[bytes, Job] = {}
    curves: dict[tuple[str, str, str], list[bytes]] = {}
    for axis in axes:
        for value in AXES[axis]:
            workload, config = _point(axis, value, minutes)
            for name in SYSTEMS:
                keys = []
                for rate in RATES:
                    job = Job(workload=workload, rate=rate, system=get_system(name), config=config)
                    key = msgspec.json.encode(job)  # equal points on two axes run once
                    jobs.setdefault(key, job)
                    keys.append(key)
                curves[axis, str(value), name] = keys
    results = run_curves(jobs, list(curves.values()), slo, workers=workers, progress=progress)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (axis, value, name), keys in curves.items():
        tp = curve_throughput(results, keys, RATES, slo)
        out.setdefault(axis, {}).setdefault(value, {})[name] = tp
    return Sensitivity(slo=slo, throughput=out, seconds=time.monotonic() - started)


def render(result: Sensitivity, command: str, plots: Sequence[str] = ()) -> str:
    """The tables as Markdown (``plots``: figure file names to reference)."""
    out = [
        "# Sensitivity: supported users per minute as one setting moves\n",
        f"Command: `{command}` ({result.seconds:.0f} s wall time). Around OPT-13B on an "
        "A800, 200 GB of host memory, a 1.5 GB/s SSD and the synthetic workload; a supported "
        f"rate is the highest arrival rate whose mean latency stays under {result.slo:g} s "
        f"(swept {', '.join(f'{r:g}' for r in RATES)}; "
        f"'>= {RATES[-1]:g}' when it never missed).\n",
    ]
    for axis, per in result.throughput.items():
        out.append(f"\n## {_LABELS[axis]}\n")
        if f"{axis}.png" in plots:
            out.append(f"![{_LABELS[axis]}]({axis}.png)\n")
        names = list(next(iter(per.values())))
        out.append("| " + " | ".join([_LABELS[axis], *names, "bidaw / best baseline"]) + " |")
        out.append("|" + "---|" * (len(names) + 2))
        for value, tps in per.items():
            base = max((tps[n] for n in ("cachedattention", "flashgen") if n in tps), default=0.0)
            cells = [_cell(tps[n]) for n in names]
            rel = f"{tps['bidaw'] / base:.2f}x" if base > 0 and "bidaw" in tps else "-"
            out.append("| " + " | ".join([value, *cells, rel]) + " |")
    return "\n".join(out) + "\n"


def _cell(tp: float) -> str:
    return f">= {tp:g}" if tp >= RATES[-1] else f"{tp:.1f}"


def _plot(result: Sensitivity, out: Path) -> list[str]:
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return []
    written = []
    for axis, per in result.throughput.items():
        fig, ax = plt.subplots(figsize=(6.0, 3.8))
        values = list(per)
        for name in next(iter(per.values())):
            ax.plot(values, [per[v][name] for v in values], marker="o", label=name)
        ax.set_xlabel(_LABELS[axis])
        ax.set_ylabel(f"supported users/min (mean <= {result.slo:g} s)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{axis}.png", dpi=110)
        plt.close(fig)
        written.append(f"{axis}.png")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: ``python -m tieredkv.sim.sensitivity [--axes a,b] [--out DIR]``."""
    parser = argparse.ArgumentParser(
        prog="python -m tieredkv.sim.sensitivity", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--axes", default=",".join(AXES), help="settings to vary (default all)")
    parser.add_argument("--slo", type=float, default=5.0, help="mean-latency SLO, s")
    parser.add_argument("--jobs", type=int, help="worker processes (default: one per core)")
    parser.add_argument("--out", default="tieredkv-sensitivity", help="output folder")
    args = parser.parse_args(argv)
    axes = [a.strip() for a in args.axes.split(",") if a.strip()]
    if (
        any(a not in AXES for a in axes)
        or args.slo <= 0
        or (args.jobs is not None and args.jobs < 1)
    ):
        parser.error(f"--axes takes {', '.join(AXES)}; --slo and --jobs must be positive")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = sensitivity(axes, slo=args.slo, workers=args.jobs)
    plots = _plot(result, out)
    words = ["python", "-m", "tieredkv.sim.sensitivity", *(sys.argv[1:] if argv is None else argv)]
    text = render(result, " ".join(words), plots)
    (out / "sensitivity.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
