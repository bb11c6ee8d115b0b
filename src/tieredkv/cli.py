"""The ``tieredkv`` command."""

from __future__ import annotations

import argparse
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


if __name__ == "__main__":
    sys.exit(main())
