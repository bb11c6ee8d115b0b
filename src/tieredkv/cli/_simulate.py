"""``tieredkv simulate``: serving systems simulated on one workload at one arrival rate."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ._args import Parser, policy, positive
from ._workload import (
    add_workload_command,
    check_common,
    check_size,
    check_traces,
    degenerate,
    setup,
)

if TYPE_CHECKING:
    from ..sim.forest import Forest

__all__ = ["DEFAULT_RATE", "add_simulate", "check_simulate", "simulate_command"]

DEFAULT_RATE = 25.0
"""Users per minute of a generated workload when ``--rate`` is not given."""


def add_simulate(sub: argparse._SubParsersAction[Parser]) -> None:
    """Add ``simulate`` to the ``tieredkv`` command's subparsers."""
    sim = add_workload_command(
        sub, "simulate", help="simulate serving systems on one workload at one arrival rate"
    )
    sim.add_argument(
        "--rate",
        type=float,
        help="users per minute (default 25; for a trace, the highest of its native rate / 2, "
        "/ 4, ... at which the ideal system meets the SLO)",
    )
    sim.add_argument(
        "--scheduler", help="replace every system's scheduler (fcfs, bidaw, or a registered one)"
    )
    sim.add_argument("--eviction", help="replace every system's eviction policy (lru, bidaw, ...)")
    sim.add_argument(
        "--inclusive",
        choices=["yes", "no"],
        help="force inclusive (write-through) or exclusive caching for every system",
    )
    sim.add_argument(
        "--predictive",
        choices=["yes", "no"],
        help="turn predictive prefetch (beyond the paper) on or off for every system",
    )
    sim.add_argument("--json", action="store_true", help="print the results as JSON lines")
    sim.add_argument("--no-progress", action="store_true", help="draw no progress bar")


def check_simulate(args: argparse.Namespace) -> None:
    from ..policies.registry import make_eviction, make_scheduler

    check_common(args)
    if args.rate is not None:  # None: the workload's default (a trace's native rate)
        positive(args.rate, "--rate")
    policy(make_scheduler, args.scheduler, "--scheduler")
    policy(make_eviction, args.eviction, "--eviction")
    check_size(args, [args.rate if args.rate is not None else DEFAULT_RATE], "--minutes/--rate")
    check_traces(args)


def simulate_command(args: argparse.Namespace) -> int:
    import msgspec

    from ..policies.registry import scheduler_parameters
    from ..sim.config import steady_state
    from ..sim.engine import simulate
    from ..sim.progress import ProgressBar
    from ..sim.saturation import PROBE_FACTOR, ideal_rate, saturation_note, workload_slo
    from ..sim.systems import get_system

    workload, config, names = setup(args)
    overrides: dict[str, object] = {}
    if args.scheduler:
        overrides["scheduler"] = args.scheduler
        if "window" not in scheduler_parameters(args.scheduler):
            overrides["prefetch_window"] = None  # CachedAttention's window is FCFS's
    if args.eviction:
        overrides["eviction"] = args.eviction
    if args.inclusive:
        overrides["inclusive"] = args.inclusive == "yes"
    if args.predictive:
        overrides["predictive_prefetch"] = args.predictive == "yes"
    native = workload.native_rate()
    config = steady_state(config, workload)
    chosen = ""
    if args.rate is not None:
        rate = args.rate
    elif native is None:
        rate = DEFAULT_RATE
    else:  # a trace: a rate where one GPU keeps up with it (the ideal meets the SLO)
        rate, _, met = ideal_rate(workload, config)
        chosen = (
            " (the highest of the trace's native rate / 2, / 4, ... at which the ideal "
            "system meets the SLO; --rate to choose)"
            if met
            else " (the trace's native rate / 256: even there the ideal system misses the SLO)"
        )
    few = degenerate(args, [rate])
    if few is not None:
        print(f"tieredkv simulate: {few}", file=sys.stderr)
    forest = workload.forest(rate)
    turns = forest.turns if forest is not None else workload.turns(rate)
    shared = None if forest is None else _shared_note(forest, config.model)
    slo = workload_slo(workload, turns)
    rows = []
    bar = ProgressBar("tieredkv simulate", enabled=not args.no_progress)
    for i, name in enumerate(names):
        system = get_system(name, **overrides)

        def progress(fraction: float, done: int = i) -> None:  # one bar over every system
            bar((done + fraction) / len(names))

        result = simulate(turns, system, config, progress=progress)
        if args.json:
            print(msgspec.json.encode(result).decode())
        rows.append(result)
    bar.close()
    note = None
    if rows and all(r.latency_mean > slo for r in rows):
        # does the table say anything about caching? ask the ideal system, here and lower
        ideal = next((r for r in rows if r.system == "ideal"), None)
        if ideal is None:
            ideal = simulate(turns, get_system("ideal"), config)
        if ideal.latency_mean > slo:
            low = rate / PROBE_FACTOR
            probe = (low, simulate(workload.turns(low), get_system("ideal"), config))
            note = saturation_note(ideal, slo, probe=probe)
    if args.json and note is not None:
        print(f"tieredkv simulate: {note}", file=sys.stderr)
    if args.json and shared is not None:
        print(f"tieredkv simulate: {shared}", file=sys.stderr)
    if not args.json:
        print(
            f"\n{workload.kind} workload, {rate:.4g} users/min{chosen}"
            + (f"; the trace carries {native:.2f}" if native else "")
            + f": {len(turns):,} turns of "
            f"{turns.users():,} users; {config.model} on {config.gpu}, {config.host_gb:g} GB "
            f"host memory, {config.ssd_gbps:g} GB/s SSD\n"
        )
        header = (
            f"{'system':16} {'mean':>8} {'P50':>8} {'P90':>8} {'P95':>8} {'P99':>8} "
            f"{'queue':>8} {'TTFT':>8} {'hit':>6} {'SSD rd GB':>10} {'GPU busy':>8}"
        )
        print(header)
        print("-" * len(header))
        for r in rows:
            hit = f"{r.host_hit_ratio:6.3f}" if r.accesses else f"{'-':>6}"
            print(
                f"{r.system:16} {r.latency_mean:8.2f} {r.latency_p50:8.2f} {r.latency_p90:8.2f} "
                f"{r.latency_p95:8.2f} {r.latency_p99:8.2f} {r.queueing_mean:8.2f} "
                f"{r.ttft_mean:8.2f} {hit} {r.ssd_read_bytes / 1e9:10.1f} {r.gpu_busy:8.2f}"
            )
        print(
            f"\nlatencies and queueing in seconds (SLO {slo:.3g} s); turns counted:",
            rows[0].turns if rows else 0,
        )
        if shared is not None:
            print(f"\n{shared[0].upper()}{shared[1:]}.")
        if note is not None:
            print(f"\n{note}.")
        if few is not None:
            print(f"\n{few[0].upper()}{few[1:]}.")
    return 0


def _shared_note(forest: Forest, model: str) -> str:
    """What storing shared history once would hold, against what this simulator stores."""
    from ..sim.costmodel import get_model

    per_token = get_model(model).kv_bytes_per_token
    stored = forest.total_tokens() * per_token
    unique = forest.unique_tokens() * per_token
    return (
        f"shared history: the conversations' final histories hold {stored / 1e9:,.1f} GB of "
        f"{model} KV, stored whole by every system here (the simulator does not share "
        f"history); their distinct ranges (the system prompt and forked turns once) hold "
        f"{unique / 1e9:,.1f} GB (the histories hold {stored / max(unique, 1):.2f}x that)"
    )
