"""``tieredkv demo``: a two-tier cache taking and serving a few conversations."""

from __future__ import annotations

import argparse
import contextlib
import math
import tempfile
from pathlib import Path

from ._args import Invalid, Parser, at_least, positive, writable_folder

__all__ = ["add_demo", "check_demo", "demo_command"]


def add_demo(sub: argparse._SubParsersAction[Parser]) -> None:
    """Add ``demo`` to the ``tieredkv`` command's subparsers."""
    p = sub.add_parser("demo", help="a two-tier cache taking and serving a few conversations")
    p.add_argument(
        "--conversations", type=int, default=5, help="conversations taking turns (default 5)"
    )
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    p.add_argument("--host-mb", type=float, default=6.0, help="host tier budget in MiB (default 6)")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the KV and the turn lengths (default 0)"
    )
    p.add_argument(
        "--keep",
        metavar="DIR",
        help="keep the SSD tier's files in DIR (a new or empty folder) for a later "
        "'tieredkv fsck DIR' or 'tieredkv inspect DIR' (default: a temporary folder, removed)",
    )
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="draw no progress bar (a demo of 100 turns or more draws one, with the time "
        "left, on standard error)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port (0: any free one) during the demo and "
        "after it, until Ctrl-C (needs tieredkv[metrics])",
    )


def check_demo(args: argparse.Namespace) -> None:
    at_least(args.conversations, 1, "--conversations")
    at_least(args.turns, 1, "--turns")
    positive(args.host_mb, "--host-mb")
    at_least(args.seed, 0, "--seed")
    if args.keep is not None:
        _check_keep(args.keep)
    if args.metrics_port is not None:
        if not 0 <= args.metrics_port <= 65535:
            raise Invalid(f"--metrics-port must be in 0-65535 (got {args.metrics_port})")
        try:
            import prometheus_client  # noqa: F401
        except ModuleNotFoundError:
            raise Invalid(
                "--metrics-port needs prometheus-client (the metrics extra: pip install -e "
                "'.[metrics]' in a checkout, or pip install prometheus-client)"
            ) from None


def _check_keep(folder: str) -> None:
    """The folder ``demo --keep`` leaves its SSD tier in: new or empty, and writable."""
    writable_folder(folder, "--keep", "the SSD tier's files", empty=True)


def demo_command(args: argparse.Namespace) -> int:
    import anyio

    from ..demo import run_demo

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
                    progress=not args.no_progress,
                )
            )
        except KeyboardInterrupt:
            return 130  # Ctrl-C: the cache and the metrics endpoint were closed on the way out
    return 0
