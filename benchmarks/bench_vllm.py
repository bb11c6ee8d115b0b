"""tieredkv inside vLLM against vLLM's own options, on a multi-turn workload, on this CPU.

Run: ``.venv/bin/python benchmarks/bench_vllm.py`` (needs the ``vllm`` extra; with 8 users
it took 17 min on 2 cores shared with other work; the default is now 12 users, plus the
host-hit workload's three engines, whose ``--hits-only`` run alone took 11 min on 2 cores
shared with other work).
``--quick`` runs a 2-layer model on a few turns (what the test suite does, to prove the
benchmark runs).

The workload is the synthetic generator's (:class:`tieredkv.sim.synthetic.SyntheticWorkload`):
conversations with a first context (a system prompt / document) and turns of a query and
an answer, replayed one request at a time in the order of their arrival times (first turns
too: a user who arrives late starts late), where the gap before a user's next turn grows
with the previous answer's length (so reuse follows answer length, what Bidaw's eviction
predicts from). The model is a Llama config with random weights (default: 24 layers,
hidden 896, 14 heads, 2 KV heads, MLP 4864: about 0.4B parameters and 24 KiB of fp32 KV
per token, the shape of a 0.5B model), saved with ``save_pretrained``: nothing is
downloaded. vLLM's KV pool holds only a few conversations (``--pool-blocks``), as a GPU's
does against many users; tieredkv's host tier holds about a third of the histories
(``--host-fraction``), the rest goes to an SSD directory.

The host-hit target needs many users whose turns interleave, which the 0.4B model cannot
serve in minutes on this CPU; a hit ratio depends on the order and sizes of the accesses,
not on the model's compute, so it is measured on a second workload (``--hit-users`` users
of ``--hit-turns`` turns, host tier ``--hit-fraction`` of the histories) through the
2-layer model of ``--quick``: rows ``vllm recompute`` (the answers' reference),
``tieredkv lru`` and ``tieredkv bidaw``. Before its engines run, the benchmark prints what
the project's eviction-only replay (:func:`tieredkv.sim.replay.replay`) predicts for the
same turns and host budget (with the defaults: Bidaw 0.27, LRU 0.11). The shape matters:
8 users of 3 turns give 9 returning turns, too few to tell (the replay's ratio swings
from 0.5x to 2x with the settings); sending every first turn at once, as the previous
version of this benchmark did, takes Bidaw's advantage away (48 users of 3 turns: 0.42x
to 0.76x of LRU with a fifth to a third of the histories in host memory).

Rows (each its own engine, same turns, greedy; answers must all equal the recompute row's):

* ``vllm recompute``: vLLM alone, its prefix cache on (the baseline of every ratio);
* ``vllm offloading`` and ``vllm tiering-fs``: vLLM's OffloadingConnector with its CPU
  spec, and with its tiering spec over a file-system tier, if they run on the CPU backend
  (if not, the row says why, from the engine's own error: in vLLM 0.32 both stop with
  "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs");
* ``vllm example``: vLLM's ExampleConnector (safetensors files per prompt);
* ``tieredkv lru`` and ``tieredkv bidaw``: the TieredKVConnector with LRU / Bidaw eviction
  (Bidaw's disk-HRRN load order in both).

Columns: returning-turn TTFT mean and P99 (seconds, vLLM's own first-token latency),
throughput (turns per second of the run), tieredkv's host hit ratio (loads served from
host memory over all loads, from the worker's ``tieredkv.metrics``), and each TTFT and
throughput as a ratio to the recompute row measured in the same run. Targets (printed
with each ratio): returning-turn TTFT <= 0.2x recompute; tieredkv bidaw >= 1.25x better
than the best vLLM-native option that ran; Bidaw's host hit ratio >= 1.3x LRU's.
"""

from __future__ import annotations

import argparse
import re
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vllm_support import Result, Spec, answers, run_engine, tiny_model

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


class Workload:
    """Turns in arrival order: ``firsts[c]`` (context + first query), ``first_rounds[c]``
    (how many returning turns arrived before it) and, per returning turn,
    ``(conversation, query tokens)``, with every turn's answer length; ``turns`` is the
    same stream as the simulator's :class:`~tieredkv.sim.trace.Turns` (the context counted
    in the first query), for :func:`predicted_hit_ratios`."""

    def __init__(
        self, args: argparse.Namespace, users: int | None = None, turns: int | None = None
    ) -> None:
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
        self.firsts: list[list[int]] = []
        self.first_answers: list[int] = []
        self.first_rounds: list[int] = []
        self.rounds: list[dict[int, list[int]]] = []
        self.round_answers: list[dict[int, int]] = []
        queries = []
        for turn in iter_turns(synth):
            query = rng.integers(1, args.vocab - 1, size=max(1, turn.query)).tolist()
            if turn.index == 0:
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
        pool_blocks=args.pool_blocks,
        kv_space_gib=args.kv_space_gib,
    )


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    """fp32 KV bytes per token of the benchmark's model."""
    return int(args.layers * 2 * args.kv_heads * (args.hidden // args.heads) * 4)


def histories_bytes(wl: Workload, args: argparse.Namespace) -> int:
    """KV bytes of every conversation's final history (fp32)."""
    return int(sum(_final_tokens(wl)) * kv_bytes_per_token(args))


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
    errors = [line.strip() for line in output.splitlines() if "Error" in line]
    return errors[-1] if errors else output[-300:]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^tieredkv_{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def summarize(result: Result) -> dict[str, float]:
    returning = [t.ttft for t in result.turns if t.round >= 0]
    ttft = np.asarray(returning) if returning else np.asarray([np.nan])
    out = {
        "ttft_mean": float(ttft.mean()),
        "ttft_p99": float(np.percentile(ttft, 99)),
        "throughput": len(result.turns) / result.run_seconds,
        "cached_fraction": sum(t.cached for t in result.turns if t.round >= 0)
        / max(1, sum(t.prompt_tokens for t in result.turns if t.round >= 0)),
        "host_hit": float("nan"),
    }
    if result.metrics:  # loads the worker's cache served, and how many from host memory
        loads = metric(result.metrics[0], "loads_total")
        if loads > 0:
            out["host_hit"] = metric(result.metrics[0], "hits_total") / loads
    return out


QUICK_MODEL = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, a few turns")
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument("--rate", type=float, default=1.0, help="new users per second")
    parser.add_argument("--context", type=int, default=384, help="first-turn context tokens")
    parser.add_argument("--query", type=int, default=25, help="median query tokens")
    parser.add_argument("--answer", type=int, default=12, help="median answer tokens")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=4864)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--pool-blocks", type=int, default=0, help="vLLM KV blocks (0: auto)")
    parser.add_argument("--host-fraction", type=float, default=0.33)
    parser.add_argument(
        "--hit-users",
        type=int,
        default=24,
        help="users of the host-hit workload (run on the 2-layer model); 0: the main rows'",
    )
    parser.add_argument("--hit-turns", type=int, default=6, help="turns per hit-workload user")
    parser.add_argument(
        "--hits-only", action="store_true", help="run only the host-hit workload's rows"
    )
    parser.add_argument(
        "--hit-fraction", type=float, default=0.25, help="host tier / histories, hit workload"
    )
    parser.add_argument(
        "--max-model-len", type=int, default=0, help="0: the longest conversation's tokens"
    )
    parser.add_argument("--kv-space-gib", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (SSD tier)")
    parser.add_argument(
        "--skip", default="", help="rows to leave out, comma-separated (e.g. 'vllm example')"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.users, args.turns, args.context, args.hit_users = 4, 3, 96, 0
        vars(args).update(QUICK_MODEL)
        args.vocab, args.answer = 512, 8
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        work = Path(tmp)
        wl = Workload(args)
        host = max(1 << 20, int(histories_bytes(wl, args) * args.host_fraction))
        rows = {} if args.hits_only else run_rows(args, wl, work / "main", host, skip)
        hits = None
        if args.hit_users:
            hit_args = argparse.Namespace(**{**vars(args), **QUICK_MODEL, "max_model_len": 0})
            hit_args.pool_blocks = 0
            hit_wl = Workload(hit_args, users=args.hit_users, turns=args.hit_turns)
            hit_host = max(1 << 16, int(histories_bytes(hit_wl, hit_args) * args.hit_fraction))
            only = {"vllm offloading", "vllm tiering-fs", "vllm example"}
            hits = run_rows(hit_args, hit_wl, work / "hits", hit_host, skip | only)
            predicted = predicted_hit_ratios(hit_wl, hit_args, hit_host)
        else:
            predicted = predicted_hit_ratios(wl, args, host)
        return report(rows, hits, predicted)


def run_rows(
    args: argparse.Namespace,
    wl: Workload,
    work: Path,
    host: int,
    skip: set[str],
) -> dict[str, tuple[Result | None, str]]:
    """Each row's engine over the workload (a model built in ``work`` from ``args``)."""
    longest = max(_final_tokens(wl))
    if args.max_model_len == 0:
        args.max_model_len = (longest // BS + 2) * BS
    if args.pool_blocks == 0:  # three of the longest conversations, as a small GPU holds
        args.pool_blocks = 3 * (args.max_model_len // BS)
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
        f"workload: {len(wl.firsts)} conversations, {len(wl.rounds)} returning turns, "
        f"histories {histories_bytes(wl, args) / 2**20:.1f} MiB of KV ({args.layers}-layer "
        f"model); vLLM pool {args.pool_blocks} blocks of {BS} tokens; tieredkv host tier "
        f"{host / 2**20:.1f} MiB, the rest on SSD ({work})",
        flush=True,
    )
    rows: dict[str, tuple[Result | None, str]] = {}

    def run(name: str, connector: str | None, extra: dict[str, Any]) -> None:
        if name in skip:
            return
        for attempt in range(3):
            # the port is free when picked, but the engine may take it for a socket of its
            # own before the worker's metrics server binds it: then pick another
            port = free_port()
            spec = spec_for(args, wl, model, connector, extra)
            if connector == "tieredkv":
                spec.extra = {**extra, "metrics_port": port}
                spec.metrics_urls = [f"http://127.0.0.1:{port}/metrics"]
            began = time.monotonic()
            try:
                result = run_engine(
                    spec, work / f"{name.replace(' ', '-')}-{attempt}", timeout=3600
                )
                break
            except RuntimeError as exc:
                if "Address already in use" in str(exc) and attempt < 2:
                    print(f"{name}: port {port} was taken, again with another", flush=True)
                    continue
                rows[name] = (None, why_not(str(exc)))
                print(f"{name}: did not run: {rows[name][1]}", flush=True)
                return
        rows[name] = (result, "")
        print(f"{name}: ran in {time.monotonic() - began:.0f} s", flush=True)

    run("vllm recompute", None, {})
    run(
        "vllm offloading",
        "offloading",
        {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": host},
    )
    run(
        "vllm tiering-fs",
        "offloading",
        {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": host,
            "secondary_tiers": [{"type": "fs", "root_dir": str(work / "tiering-fs")}],
        },
    )
    run("vllm example", "example", {"shared_storage_path": str(work / "example")})
    for policy in ("lru", "bidaw"):
        run(
            f"tieredkv {policy}",
            "tieredkv",
            {
                "host_bytes": host,
                "ssd_path": str(work / f"kv-{policy}"),
                "ssd_bytes": 64 << 30,
                "eviction": policy,
                "scheduler": "bidaw",
            },
        )
    return rows


def report(
    rows: dict[str, tuple[Result | None, str]],
    hits: dict[str, tuple[Result | None, str]] | None,
    predicted: dict[str, float],
) -> int:
    """Print the table and the ratios; 0 if every row answered as recompute did."""
    stats, lossless = table(rows) if rows or hits is None else ({}, True)
    if stats is None:
        return 1
    bidaw = stats.get("tieredkv bidaw")
    if bidaw is not None:
        base = stats["vllm recompute"]
        ratio = bidaw["ttft_mean"] / base["ttft_mean"]
        print(f"returning-turn TTFT, tieredkv bidaw / recompute: {ratio:.3f}x (target <= 0.2x)")
        natives = [n for n in stats if n.startswith("vllm ")]
        best = min(natives, key=lambda n: stats[n]["ttft_mean"])
        gain = stats[best]["ttft_mean"] / bidaw["ttft_mean"]
        print(
            f"returning-turn TTFT, best vLLM-native option ({best}) / tieredkv bidaw: "
            f"{gain:.2f}x (target >= 1.25x)"
        )
    if hits is not None:
        print("\nhost-memory pressure (the host-hit workload, a 2-layer model):")
        hit_stats, hit_lossless = table(hits)
        lossless &= hit_lossless and hit_stats is not None
    else:
        hit_stats = stats
    bidaw, lru = (hit_stats or {}).get("tieredkv bidaw"), (hit_stats or {}).get("tieredkv lru")
    b_sim, l_sim = predicted["bidaw"], predicted["lru"]
    sim_text = f"{b_sim / l_sim:.2f}x" if l_sim > 0 else "n/a"
    print(
        f"host hit ratio, replay's prediction, Bidaw / LRU: {b_sim:.3f} / {l_sim:.3f} = {sim_text}"
    )
    if bidaw is not None and lru is not None:
        b, lr = bidaw["host_hit"], lru["host_hit"]
        ratio_text = f"{b / lr:.2f}x" if lr > 0 else "n/a (LRU had no host hits)"
        print(f"host hit ratio, Bidaw / LRU: {b:.3f} / {lr:.3f} = {ratio_text} (target >= 1.3x)")
    print("answers: " + ("every row equals recompute" if lossless else "SOME ROW DIFFERS"))
    return 0 if lossless else 1


def table(
    rows: dict[str, tuple[Result | None, str]],
) -> tuple[dict[str, dict[str, float]] | None, bool]:
    """Print the rows, each against the recompute row; their summaries and whether every
    row answered as recompute did (``None``: the recompute row did not run)."""
    base_result = rows.get("vllm recompute", (None, ""))[0]
    if base_result is None:
        print("the recompute row did not run: no ratios")
        return None, False
    ref = answers(base_result)
    base = summarize(base_result)
    stats = {name: summarize(r) for name, (r, _) in rows.items() if r is not None}
    lossless = True
    print()
    print(
        f"{'row':<17} {'TTFT mean':>10} {'TTFT P99':>9} {'turns/s':>8} {'host hit':>9} "
        f"{'cached':>7} {'TTFT x':>7} {'P99 x':>7} {'thru x':>7}  answers"
    )
    for name, (result, why) in rows.items():
        if result is None:
            print(f"{name:<17} did not run: {why}")
            continue
        s = stats[name]
        same = answers(result) == ref
        lossless &= same
        print(
            f"{name:<17} {s['ttft_mean']:>9.3f}s {s['ttft_p99']:>8.3f}s {s['throughput']:>8.3f} "
            f"{s['host_hit']:>9.2f} {s['cached_fraction']:>7.2f} "
            f"{s['ttft_mean'] / base['ttft_mean']:>7.3f} {s['ttft_p99'] / base['ttft_p99']:>7.3f} "
            f"{s['throughput'] / base['throughput']:>7.2f}  {'equal' if same else 'DIFFERENT'}"
        )
    print()
    return stats, lossless


if __name__ == "__main__":
    sys.exit(main())
