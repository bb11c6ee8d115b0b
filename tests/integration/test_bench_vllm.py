"""The vLLM benchmark runs end to end on its quick workload (a 2-layer model, a few
turns), every row answers as recompute does, and it prints each ratio with its target.

Eight vLLM engines start one after another (two of them stop at start on the CPU backend):
about six to ten minutes on two cores (9.7 at a load of 5-8). The LMCache rows need the
peer's environment, which the project's does not hold: ``test_bench_vllm_lmcache.py`` runs
them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmark_scripts import benchmark_script
from tests.vllm_support import require_vllm

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]  # CI runs it (`pytest -m slow`)
require_vllm()


def test_bench_vllm_quick_runs_and_prints_its_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with benchmark_script("bench_vllm") as bench:
        argv = ["--quick", "--dir", str(tmp_path), "--skip", "lmcache cpu,lmcache disk"]
        assert bench.main(argv) == 0  # 1: an answer differs
    out = capsys.readouterr().out
    for line in (
        "returning-turn TTFT, tieredkv bidaw / recompute:",
        "(target <= 0.2x)",
        "(target >= 1.25x)",
        "host hit ratio, Bidaw / LRU:",
        "answers: every row equals recompute",
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
