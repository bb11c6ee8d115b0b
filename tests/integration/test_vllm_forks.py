"""A system prompt shared by several conversations, through a real vLLM engine (CPU).

Each conversation starts with the same 128-token system prompt and a message of its own,
and arrives after the previous one's first turn is stored. The connector serves the
prompt from the first conversation's stored history; with ``forks`` on, each later
conversation is stored as a fork of the first (its own blocks only), so the SSD tier
holds the prompt once; with ``forks`` off, each conversation stores it again. Answers
are the same as recomputing everything, either way.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.vllm_support import (
    IN_PROCESS,
    Result,
    Spec,
    answers,
    require_vllm,
    run_engine,
    tiny_model,
)

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]  # engine starts: `pytest -m slow`
require_vllm()

BS = 32
N = 4  # conversations
SYSTEM = 128  # tokens: 4 blocks
OWN = 70  # tokens of each conversation's first message
ROUNDS = N  # conversation c's first prompt runs just before round c
KV_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # layers * (K, V) * kv heads * head dim * fp32


def spec(model: Path, connector: str | None, extra: dict[str, object]) -> Spec:
    rng = random.Random(3)
    system = [rng.randrange(1, 500) for _ in range(SYSTEM)]
    firsts = [[*system, *(rng.randrange(1, 500) for _ in range(OWN))] for _ in range(N)]
    queries = [
        {c: [rng.randrange(1, 500) for _ in range(40)] for c in range(N) if c <= r}
        for r in range(ROUNDS)
    ]
    return Spec(
        model=str(model),
        connector=connector,
        extra=extra,
        conversations=firsts,
        queries=queries,
        first_rounds=list(range(N)),
        gap=0.5,  # the previous turns are reported stored before the next prompts arrive
    )


def tiered(kv: Path, forks: bool) -> dict[str, object]:
    return {"host_bytes": 8 << 20, "ssd_path": str(kv), "ssd_bytes": 64 << 20, "forks": forks}


def stored_bytes(kv: Path) -> int:
    """Bytes of the segment files on the SSD tier (every turn is written there)."""
    return sum(f.stat().st_size for f in kv.rglob("*.seg"))


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm-forks")
    tiny_model(path / "model")
    return path


@pytest.fixture(scope="module")
def recompute(work: Path) -> Result:
    return run_engine(spec(work / "model", None, {}), work / "recompute", env=IN_PROCESS)


@pytest.fixture(scope="module")
def forked(work: Path) -> Result:
    return run_engine(
        spec(work / "model", "tieredkv", tiered(work / "kv-forks", True)), work / "forks"
    )


@pytest.fixture(scope="module")
def whole(work: Path) -> Result:
    return run_engine(
        spec(work / "model", "tieredkv", tiered(work / "kv-whole", False)), work / "whole"
    )


def test_shared_prompt_conversations_answer_like_recompute(
    recompute: Result, forked: Result, whole: Result
) -> None:
    ref = answers(recompute)
    assert len(ref) == N + N * (N + 1) // 2
    assert answers(forked) == ref
    assert answers(whole) == ref
    for result in (forked, whole):
        for t in result.turns:
            if t.round < 0 and t.conversation > 0:
                assert t.cached >= SYSTEM, t  # the prompt came from the first conversation
            elif t.round >= 0:
                assert t.cached > 0, t


def test_forks_store_the_shared_prompt_once(work: Path, forked: Result, whole: Result) -> None:
    on, off = stored_bytes(work / "kv-forks"), stored_bytes(work / "kv-whole")
    # each later conversation's first turn leaves out the prompt's 4 blocks of KV (and
    # their token ids, 8 bytes each), less what page alignment of a segment file rounds
    prompt = SYSTEM * (KV_PER_TOKEN + 8)
    saved = off - on
    print(f"segment bytes on the SSD tier: forks on {on}, off {off}")
    assert (N - 1) * (prompt - 4096) <= saved <= (N - 1) * (prompt + 4096), (on, off)
