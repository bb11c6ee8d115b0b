"""``--bidaw-kwargs``: the constructor arguments of a benchmark's ``bidaw`` rows, given as
JSON on the command line (``bench_retention.py``, ``bench_forest_sim.py``)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tieredkv.policies import make_eviction

__all__ = ["add_bidaw_kwargs", "parse_bidaw_kwargs"]


def add_bidaw_kwargs(parser: argparse.ArgumentParser) -> None:
    """Add ``--bidaw-kwargs`` to ``parser``."""
    parser.add_argument(
        "--bidaw-kwargs",
        default="{}",
        help='keyword arguments (JSON) for the bidaw rows\' AdaptiveBidaw, e.g. {"samples": 4096}',
    )


def parse_bidaw_kwargs(parser: argparse.ArgumentParser, text: str) -> dict[str, Any]:
    """The keyword arguments ``text`` gives, once a ``bidaw`` policy was made with them;
    otherwise ``parser`` exits saying what to fix."""
    try:
        kwargs = json.loads(text)
        if not isinstance(kwargs, dict):
            raise TypeError("not a JSON object")
        make_eviction("bidaw", **kwargs)
    except (ValueError, TypeError) as exc:
        parser.error(
            f"--bidaw-kwargs must be a JSON object of AdaptiveBidaw's keyword arguments "
            f"(got {text!r}: {exc})"
        )
    return kwargs
