"""The ``tieredkv`` command: ``demo``, ``simulate``, ``reproduce``, ``costs``, ``fsck`` and
``inspect``.

One module per command (``_demo``, ``_simulate``, ``_reproduce``, ``_costs``; ``fsck`` and
``inspect`` are :mod:`tieredkv.fsck`'s), each adding its parser, checking its arguments
and running; ``_workload`` holds the options ``simulate`` and ``reproduce`` share, and
``_args`` the parser and the checks every command uses.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .._version import __version__
from ..errors import TieredKVError
from ._args import Invalid, Parser, glue_negative_values
from ._costs import add_costs, check_costs, costs_command
from ._demo import add_demo, check_demo, demo_command
from ._reproduce import add_reproduce, check_reproduce, reproduce_command
from ._simulate import add_simulate, check_simulate, simulate_command

if TYPE_CHECKING:
    import argparse

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv``, check every argument, then run a subcommand; returns the exit status.

    Every argument is checked before any work starts (names against the registries and
    presets, numbers against their ranges, trace files read and validated, the report
    folder written to): a bad one ends the command with a one-line error on standard
    error and exit status 2.
    """
    parser = Parser(
        prog="tieredkv",
        description="Tiered KV caching for multi-turn LLM serving (Bidaw, FAST'26).",
    )
    parser.add_argument("--version", action="version", version=f"tieredkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo(sub)
    add_simulate(sub)
    add_reproduce(sub)
    add_costs(sub)
    from ..fsck import add_commands, run_command

    add_commands(sub)
    words = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(glue_negative_values(words, sub.choices.values()))
    if args.command in ("fsck", "inspect"):
        return run_command(args)
    try:
        _VALIDATE[args.command](args)
    except Invalid as exc:
        parser.exit(2, f"tieredkv {args.command}: error: {exc}\n")
    try:
        if args.command == "demo":
            return demo_command(args)
        if args.command == "costs":
            return costs_command(args.model)
        if args.command == "simulate":
            return simulate_command(args)
        return reproduce_command(args, argv)
    except (ValueError, ModuleNotFoundError, OSError, TieredKVError) as exc:
        parser.exit(2, f"tieredkv {args.command}: error: {exc}\n")


_VALIDATE: dict[str, Callable[[argparse.Namespace], None]] = {
    "demo": check_demo,
    "costs": check_costs,
    "simulate": check_simulate,
    "reproduce": check_reproduce,
}
