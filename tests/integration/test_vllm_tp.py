"""The TieredKVConnector under tensor parallelism: a real vLLM engine on the CPU backend
with ``tensor_parallel_size=2`` (two worker processes, each holding half of the KV heads),
the tiny random Llama of the other vLLM tests.

Each worker stores and loads its own shard (under ``ssd_path/rank0`` and ``rank1``), the
scheduler side keeps one index; a returning turn is served from both shards and answers
as the same prompt computed from scratch (under a ``cache_salt`` no one else uses); a
restart serves the stored turns again from the SSD tier. vLLM's CPU backend binds each
worker's threads to CPU cores; with one NUMA node it needs them named
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``: rank 0 on core 0, rank 1 on core 1).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.vllm_support import require_vllm, tiny_model

require_vllm()

from tests.integration.identity_engine import Ask, Result, Spec, run_engine  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def conversation(rounds: int, rng: random.Random) -> list[list[Ask]]:
    """A conversation's turns, each also asked from scratch (a salt no one else uses)."""
    out = []
    for r in range(rounds):
        q = [rng.randrange(1, 500) for _ in range(30)] if r else []
        out.append([Ask(conv=0, query=q, keep=True), Ask(conv=0, query=q, salt=f"ref-{r}")])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result, Result]:
    root = tmp_path_factory.mktemp("vllm-tp")
    model = tiny_model(root / "model")
    rng = random.Random(3)
    extra = {"host_bytes": 64 << 20, "ssd_path": str(root / "kv"), "fsync": False}
    first = [rng.randrange(1, 500) for _ in range(79)]
    spec = Spec(
        model=str(model),
        extra=extra,
        conversations=[first],
        rounds=conversation(3, rng),
        tensor_parallel_size=2,
    )
    one = run_engine(spec, root / "run1", BIND)
    again = Spec(
        model=str(model),
        extra=extra,
        conversations=one.prompts,
        rounds=conversation(2, rng)[1:],
        tensor_parallel_size=2,
    )
    return root, one, run_engine(again, root / "run2", BIND)


def test_each_rank_stores_its_shard_and_returning_turns_are_served(
    runs: tuple[Path, Result, Result],
) -> None:
    root, one, _ = runs
    assert [[a.cached for a in r] for r in one.rounds] == [[0, 0], [64, 0], [96, 0]]
    for served, scratch in one.rounds:
        assert served.answer == scratch.answer
    for rank in ("rank0", "rank1"):  # each worker wrote its own shard
        segments = [p for p in (root / "kv" / rank).rglob("*") if p.is_file()]
        assert sum(p.stat().st_size for p in segments) > 0, rank
    assert len(list((root / "kv" / "index").glob("*.json"))) >= 1  # one index, rank 0's


def test_a_restart_under_tensor_parallelism_serves_from_both_shards(
    runs: tuple[Path, Result, Result],
) -> None:
    _, _, two = runs
    [(served, scratch)] = [tuple(r) for r in two.rounds]
    assert served.cached >= 96
    assert served.answer == scratch.answer
