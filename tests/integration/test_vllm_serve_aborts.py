"""``vllm serve`` with the TieredKVConnector, driven by the ``openai`` client's streams, a
share of which the client closes early.

Conversations whose histories the connector stores on the SSD (a host tier of 1 MiB)
send their turns as streamed completions, several at once, each prompt twice (a client
that retries); a third of the streams are closed after their first chunk or at once
(vLLM aborts those requests: while they wait for their SSD load, load, or compute). The
server must stay healthy and keep serving, every stream that was read to its end must have
all its tokens, and every answer to one prompt must be the same, whether it was computed
or served from the connector (greedy decoding: the connector never changes an answer).
After an idle moment the server shuts down, and the connector's two sides must hold
nothing for any request (``tests.vllm_support.leaks``).

The server starts in about a minute on two cores; the run takes about 20 s.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.vllm_support import (
    connector_logging,
    connector_states,
    free_port,
    leaks,
    require_vllm,
    start_server,
    tiny_model,
    wait_healthy,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # a server start: `pytest -m slow`
require_vllm()

BS = 32
MAX_TOKENS = 8


def test_streams_closed_early_leave_the_server_serving(tmp_path: Path) -> None:
    from openai import OpenAI

    model = str(tiny_model(tmp_path / "model"))
    port = free_port()
    config = {
        "kv_connector": "TieredKVConnector",
        "kv_connector_module_path": "tieredkv.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "host_bytes": 1 << 20,
            "ssd_path": str(tmp_path / "kv"),
            "ssd_bytes": 128 << 20,
        },
    }
    log_path = tmp_path / "serve.log"
    connector_log = tmp_path / "connector.log"  # the connector's own log, DEBUG
    log = log_path.open("w")
    server = start_server(
        model,
        port,
        config,
        log,
        block_size=BS,
        max_model_len=2048,
        # vLLM's default, 0, kills the engine's processes right after asking them to stop
        # (its process manager's wait for them ends at once): the worker then logs its
        # state at shutdown only if it wins that race (CI, 4 Dec, twice: "worker: logged
        # nothing at shutdown"). With a timeout the engine drains (no request is left by
        # then) and closes the connector before it exits
        extra=["--shutdown-timeout", "120"],
        env={
            "VLLM_LOGGING_CONFIG_PATH": str(connector_logging(connector_log)),
            # a grace for the engine's processes to shut down cleanly and log their
            # state (vLLM's default, 5 s, is short on a loaded machine)
            "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "120",
        },
    )
    try:
        wait_healthy(server, port, log_path)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        rng = random.Random(3)

        def stream(prompt: list[int], close_after: int | None) -> list[int] | None:
            """The answer's token ids, or ``None`` for a stream closed after
            ``close_after`` chunks."""
            out: list[int] = []
            with client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                stream=True,
                extra_body={"return_token_ids": True, "min_tokens": MAX_TOKENS},
            ) as chunks:
                for n, chunk in enumerate(chunks):
                    if close_after is not None and n >= close_after:
                        return None  # leaving the block closes the stream: vLLM aborts
                    extra = chunk.choices[0].model_extra if chunk.choices else None
                    if extra and extra.get("token_ids"):
                        out.extend(extra["token_ids"])
            return out

        system = [rng.randrange(1, 500) for _ in range(64)]
        histories = [
            [*system, *(rng.randrange(1, 500) for _ in range(40 + 9 * c))] for c in range(8)
        ]
        answers: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        closed = completed = 0
        with ThreadPoolExecutor(16) as pool:
            for _ in range(5):
                jobs = []
                for h in histories:
                    for _ in range(2):  # the prompt twice, as a client that retries
                        close = rng.choice([None, None, 0, 1])
                        jobs.append((tuple(h), pool.submit(stream, list(h), close)))
                for prompt, job in jobs:
                    answer = job.result()
                    if answer is None:
                        closed += 1
                        continue
                    completed += 1
                    assert len(answer) == MAX_TOKENS, answer
                    answers.setdefault(prompt, set()).add(tuple(answer))
                for c, h in enumerate(histories):
                    done = answers.get(tuple(h))
                    if done:  # the conversation goes on with its answer
                        histories[c] = [
                            *h,
                            *next(iter(done)),
                            *(rng.randrange(1, 500) for _ in range(30)),
                        ]
        print({"streams": closed + completed, "closed_early": closed, "prompts": len(answers)})
        assert closed > 0
        assert completed > 0
        differing = {p: a for p, a in answers.items() if len(a) > 1}
        assert differing == {}, f"{len(differing)} prompts got different answers"
        # still healthy, still serving
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert r.status == 200
        assert stream(histories[0], None) is not None
        text = log_path.read_text()
        assert "EngineDeadError" not in text, text[-4000:]
        assert "AssertionError" not in text, text[-4000:]
        # nothing leaks: after an idle moment, the server shuts down and the connector's
        # two sides hold nothing for any request
        time.sleep(2.0)
        # the API server alone: it stops the engine with one SIGTERM and waits for it up to
        # --shutdown-timeout (a SIGINT to the whole group would also reach the engine
        # directly, whose handler vLLM resets to the default while it shuts down)
        began = time.monotonic()
        server.send_signal(signal.SIGINT)
        server.wait(timeout=300)
        print({"shutdown_s": round(time.monotonic() - began, 1)})
        side, worker = connector_states(connector_log, 30.0)
        assert leaks(side, worker) == {}, (side, worker, log_path.read_text()[-4000:])
        # the state covers every request the engine saw (at most those sent)
        assert completed < side["finished"] <= closed + completed + 1, side
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()
