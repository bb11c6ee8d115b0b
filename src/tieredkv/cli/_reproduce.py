"""``tieredkv reproduce``: the paper's experiments, and a report with plots."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from ._args import Invalid, Parser, at_least, positive, writable_folder
from ._workload import (
    add_workload_command,
    check_common,
    check_size,
    check_traces,
    degenerate,
    setup,
)

__all__ = ["add_reproduce", "check_reproduce", "reproduce_command"]


def add_reproduce(sub: argparse._SubParsersAction[Parser]) -> None:
    """Add ``reproduce`` to the ``tieredkv`` command's subparsers."""
    rep = add_workload_command(
        sub, "reproduce", help="run the paper's experiments and write a report with plots"
    )
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


def check_reproduce(args: argparse.Namespace) -> None:
    check_common(args)
    for rate in _rates(args.rates) or ():
        positive(rate, "every rate of --rates")
    if args.rate is not None:
        positive(args.rate, "--rate")
    if args.slo is not None:  # None: 5 s, stretched for long answers
        positive(args.slo, "--slo")
    if args.jobs is not None:
        at_least(args.jobs, 1, "--jobs")
    check_size(args, _swept(args), "--minutes/--rates/--rate")
    check_traces(args)
    _check_out(args.out)


def _rates(text: str | None) -> tuple[float, ...] | None:
    """The rates of ``--rates``; ``None`` when not given (the workload's default sweep)."""
    if text is None:
        return None
    try:
        rates = tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise Invalid(
            f"--rates must be numbers separated by commas, e.g. 10,20,30 (got {text!r})"
        ) from None
    if not rates:
        raise Invalid("--rates names no rate (give users per minute separated by commas)")
    return rates


def _swept(args: argparse.Namespace) -> list[float]:
    """The rates a generated workload runs at: the sweep and the reference rate."""
    from ..sim.report import SYNTHETIC_RATES

    rates = list(_rates(args.rates) or SYNTHETIC_RATES)
    return rates if args.rate is None else [*rates, args.rate]


def _check_out(out: str) -> None:
    """The report folder: created if missing, and a file can be written in it."""
    writable_folder(out, "--out", "a report")


def reproduce_command(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from ..sim.progress import ProgressBar
    from ..sim.report import (
        ReproduceOptions,
        reproduce,
        summary_note,
        summary_table,
        write_report,
    )

    workload, config, names = setup(args)
    rates = _rates(args.rates)
    native = workload.native_rate()
    if native is not None:
        print(f"the trace carries {native:.2f} users per minute", file=sys.stderr)
    few = degenerate(args, _swept(args))
    if few is not None:
        print(f"tieredkv reproduce: {few}", file=sys.stderr)
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
        print(
            "plots skipped: matplotlib is not installed (the plots extra: pip install -e "
            "'.[plots]' in a checkout, or pip install matplotlib)"
        )
    return 0
