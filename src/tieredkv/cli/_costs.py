"""``tieredkv costs``: the cost efficiency of caching K/V or the activation, per model."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ._args import Parser, preset

__all__ = ["add_costs", "check_costs", "costs_command"]


def add_costs(sub: argparse._SubParsersAction[Parser]) -> None:
    """Add ``costs`` to the ``tieredkv`` command's subparsers."""
    p = sub.add_parser(
        "costs",
        help="cost efficiency (FLOPs saved per MB) of caching K/V or the activation, per model",
    )
    p.add_argument(
        "--model", action="append", help="a model preset (repeatable; default: every preset)"
    )


def check_costs(args: argparse.Namespace) -> None:
    from ..sim.costmodel import get_model

    for name in args.model or ():
        preset(get_model, name, "--model")


def costs_command(names: Sequence[str] | None) -> int:
    """Print the storage-efficient tensor table: bytes per token and GFLOP saved per MB of
    each tensor, and the codec the transformers adapter would pick ("auto")."""
    from ..sim.costmodel import MODELS, cost_efficiency, get_model

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
