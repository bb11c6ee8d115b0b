"""KV events for routers: a real vLLM engine (CPU) with ``kv_events_config`` on publishes,
through its ZMQ publisher, what the TieredKVConnector stores, per medium, under vLLM's own
block hashes (the ones a router computes from a prompt), and the same blocks again when
the SSD tier's copy lands. vLLM's prefix cache is off: every event is the connector's.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_support import require_vllm, tiny_model

require_vllm()

from tests.integration.identity_engine import Ask, Spec, run_engine  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

BLOCK = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_hashes(tokens: list[int]) -> list[Any]:
    """vLLM's block hashes of a plain prompt (its default sha256, its fixed seed), as a
    router computes them, in the form its events carry them."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    kv_cache_utils.init_none_hash(sha256)
    out: list[Any] = []
    parent = None
    for i in range(len(tokens) // BLOCK):
        parent = kv_cache_utils.hash_block_tokens(
            sha256, parent, tokens[i * BLOCK : (i + 1) * BLOCK]
        )
        external = kv_cache_utils.maybe_convert_block_hash(parent)
        out.append(external.hex() if isinstance(external, bytes) else external)
    return out


def test_stores_are_published_per_medium_under_vllms_block_hashes(tmp_path: Path) -> None:
    rng = random.Random(5)
    first = [rng.randrange(1, 500) for _ in range(79)]
    query = [rng.randrange(1, 500) for _ in range(30)]
    spec = Spec(
        model=str(tiny_model(tmp_path / "model")),
        extra={"host_bytes": 64 << 20, "ssd_path": str(tmp_path / "kv"), "fsync": False},
        conversations=[first],
        rounds=[[Ask(conv=0, keep=True)], [Ask(conv=0, query=query, keep=True)]],
        events_port=free_port(),
        gap=2.0,
    )
    result = run_engine(spec, tmp_path / "run")
    assert [a.cached for r in result.rounds for a in r] == [0, 64]
    turn1 = first + result.rounds[0][0].answer
    turn2 = result.prompts[0]
    h1, h2 = vllm_hashes(turn1[:64]), vllm_hashes(turn2[:96])
    assert h2[:2] == h1
    # turn 1's two full blocks in host memory, then on the SSD (its background copy),
    # then turn 2's new block (the third: 79 + 8 + 30 + 7 tokens have KV) in host memory;
    # what follows is the SSD copy being rewritten with turn 2 (removed, stored again)
    assert result.events[:3] == [
        ["stored", "CPU", "host", h1, None, turn1[:64]],
        ["stored", "STORAGE", "ssd", h1, None, turn1[:64]],
        ["stored", "CPU", "host", h2[2:3], h1[-1], turn2[64:96]],
    ]
    for event in result.events[3:]:
        assert event[1:3] == ["STORAGE", "ssd"]
