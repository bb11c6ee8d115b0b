"""Run requests with LoRA adapters and cache salts through a real vLLM engine (CPU) with
the TieredKVConnector, in a fresh interpreter, and report each request's answer and how
many of its tokens were served from a cache.

``python tests/integration/identity_engine.py SPEC.json OUT.json``: the spec (a
:class:`Spec`) names the model directory, the connector's config, the adapters and the
rounds; each round's requests run one after another, after a pause that lets the
previous round's turns be stored. A request's prompt is its conversation's prompt plus its query;
with ``keep`` the conversation continues with that prompt and the answer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec


class Ask(msgspec.Struct, kw_only=True):
    """One request.

    :param conv: the conversation it continues (its index in ``Spec.conversations``)
    :param query: token ids appended to the conversation's prompt
    :param lora: the adapter's name (a key of ``Spec.adapters``), or ``None``
    :param salt: the request's ``cache_salt``, or ``None``
    :param keep: the conversation continues with this request's prompt and answer
    """

    conv: int
    query: list[int] = []
    lora: str | None = None
    salt: str | None = None
    keep: bool = False


class Spec(msgspec.Struct, kw_only=True):
    """One engine's run (block size 32, greedy answers of ``max_tokens`` tokens)."""

    model: str
    extra: dict[str, Any]
    conversations: list[list[int]]
    rounds: list[list[Ask]]
    adapters: dict[str, str] = {}
    max_tokens: int = 8
    gap: float = 1.0
    tensor_parallel_size: int = 1
    events_port: int = 0


class Answer(msgspec.Struct, kw_only=True):
    """One request's outcome: its answer and ``num_cached_tokens``."""

    answer: list[int]
    cached: int


class Result(msgspec.Struct, kw_only=True):
    """Per round, per request, its outcome; and each conversation's prompt at the end."""

    rounds: list[list[Answer]]
    prompts: list[list[int]]
    events: list[Any] = []


def run(spec: Spec) -> Result:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.lora.request import LoRARequest

    llm = LLM(
        model=spec.model,
        skip_tokenizer_init=True,
        dtype="float32",
        gpu_memory_utilization=0.15,
        enable_prefix_caching=False,
        enable_lora=bool(spec.adapters),
        max_lora_rank=8,
        max_loras=2,
        kv_transfer_config=KVTransferConfig(
            kv_connector="TieredKVConnector",
            kv_connector_module_path="tieredkv.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=spec.extra,
        ),
        block_size=32,
        max_model_len=2048,
        enforce_eager=True,
        seed=0,
        tensor_parallel_size=spec.tensor_parallel_size,
        distributed_executor_backend="mp" if spec.tensor_parallel_size > 1 else None,
        kv_events_config=None
        if not spec.events_port
        else KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=f"tcp://*:{spec.events_port}",  # "*": vLLM binds it
            topic="kv",
        ),
    )
    events = Subscriber(spec.events_port) if spec.events_port else None
    adapters = {
        name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(spec.adapters.items())
    }
    params = SamplingParams(
        max_tokens=spec.max_tokens,
        min_tokens=spec.max_tokens,
        ignore_eos=True,
        temperature=0.0,
        detokenize=False,
    )
    prompts = [list(p) for p in spec.conversations]
    out: list[list[Answer]] = []
    for asks in spec.rounds:
        answers = []
        ran = []
        for ask in asks:
            # one request at a time: in a batch that mixed adapters (or an adapter and
            # none), vLLM's CPU backend answered differently than to the same requests
            # alone, even to requests the connector did not serve
            prompt: Any = {"prompt_token_ids": prompts[ask.conv] + ask.query}
            if ask.salt is not None:
                prompt["cache_salt"] = ask.salt
            lora = None if ask.lora is None else adapters[ask.lora]
            (result,) = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
            ran.append((ask, prompt, result))
        for ask, prompt, result in ran:
            answer = list(result.outputs[0].token_ids)
            answers.append(Answer(answer=answer, cached=int(result.num_cached_tokens or 0)))
            if ask.keep:
                prompts[ask.conv] = prompt["prompt_token_ids"] + answer
        out.append(answers)
        time.sleep(spec.gap)  # the turns just answered are stored in the background
    time.sleep(spec.gap)
    del llm
    return Result(rounds=out, prompts=prompts, events=events.stop() if events else [])


class Subscriber:
    """Every KV event vLLM publishes on ``tcp://127.0.0.1:PORT`` (topic ``kv``), as
    decoded by a router: ``[type, medium, ownership, block hashes, parent, token ids]``."""

    def __init__(self, port: int) -> None:
        import threading

        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.connect(f"tcp://127.0.0.1:{port}")
        self._sock.setsockopt(zmq.SUBSCRIBE, b"kv")
        self._sock.setsockopt(zmq.RCVTIMEO, 100)
        self.events: list[Any] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(1.0)  # the subscription reaches the publisher

    def _run(self) -> None:
        import zmq
        from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._done.is_set():
            try:
                _, _, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            for e in decoder.decode(payload).events:
                if isinstance(e, BlockStored):
                    hashes = [_hex(h) for h in e.block_hashes]
                    parent = _hex(e.parent_block_hash)
                    event = ["stored", e.medium, e.ownership, hashes, parent, e.token_ids]
                    self.events.append(event)
                elif isinstance(e, BlockRemoved):
                    hashes = [_hex(h) for h in e.block_hashes]
                    self.events.append(["removed", e.medium, e.ownership, hashes, None, []])

    def stop(self) -> list[Any]:
        self._done.set()
        self._thread.join()
        self._sock.close(linger=0)
        self._ctx.term()
        return self.events


def _hex(h: bytes | int | None) -> str | int | None:
    return h.hex() if isinstance(h, bytes) else h


def run_engine(spec: Spec, work: Path, env: dict[str, str] | None = None) -> Result:
    """Run the spec's engine in a fresh interpreter (this script) and return its result.

    :raises RuntimeError: if the engine failed (its output's tail is in the message)
    """
    work.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = work / "spec.json", work / "result.json"
    spec_path.write_bytes(msgspec.json.encode(spec))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(spec_path), str(out_path)],
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stdout + proc.stderr)[-12000:]
        raise RuntimeError(f"the vLLM engine run failed (exit {proc.returncode}):\n{tail}")
    return msgspec.json.decode(out_path.read_bytes(), type=Result)


def main(argv: list[str]) -> int:
    spec = msgspec.json.decode(Path(argv[0]).read_bytes(), type=Spec)
    Path(argv[1]).write_bytes(msgspec.json.encode(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
