"""The vLLM benchmark runs end to end on its quick workload (a 2-layer model, a few
turns), every row answers as recompute does, and it prints each ratio with its target.

The run is :func:`tests.bench_vllm_quick.bench_vllm_quick`'s, shared with
``test_bench_vllm_lmcache.py``, which checks its LMCache rows (they need the peer's
environment, which the project's does not hold: without it the run leaves them out).
Eight vLLM engines start one after another (two of them stop at start on the CPU backend),
in the runner's own process (``--in-process``: each starts in ~15 s instead of ~40), and with
the peer's environment three more, in vLLM's own processes (LMCache's connector fails
in-process), and two LMCache servers: 330 s on two cores with the peer (``pytest -m slow
-n 2 --durations=5`` of this file, its LMCache test's and the forks row's, 7 December 2026),
against 566 s with vLLM's processes for every engine in that day's slow half."""

from __future__ import annotations

import pytest

from tests.bench_vllm_quick import QuickRun
from tests.vllm_support import require_vllm

pytestmark = [pytest.mark.timeout(2400), pytest.mark.slow]  # CI runs it (`pytest -m slow`)
require_vllm()


def test_bench_vllm_quick_runs_and_prints_its_ratios(bench_vllm_quick: QuickRun) -> None:
    out = bench_vllm_quick.out
    assert bench_vllm_quick.status == 0, out  # 1: an answer differs
    for line in (
        "returning-turn TTFT, tieredkv bidaw / recompute:",
        "(target <= 0.2x)",
        "(target >= 1.25x)",
        "host hit ratio, Bidaw / LRU:",
        "answers: every row equals recompute",
        "--in-process: vLLM's engine core and worker run in the runner's process",
    ):
        assert line in out, out
    for row in (
        "vllm recompute",
        "vllm ideal",
        "vllm offloading",
        "vllm example",
        "tieredkv lru",
        "tieredkv bidaw",
        "tieredkv bidaw (exclusive)",
    ):
        assert f"\n{row} " in out, out
