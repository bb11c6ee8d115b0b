"""The vLLM benchmark runs end to end on its quick workload (a 2-layer model, a few
turns), every row answers as recompute does, and it prints each ratio with its target.

Eight vLLM engines start one after another (two of them stop at start on the CPU backend):
about six to ten minutes on two cores (9.7 at a load of 5-8). The LMCache rows need the
peer's environment, which the project's does not hold: ``test_bench_vllm_lmcache.py`` runs
them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.vllm_support import require_vllm

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]  # CI runs it (`pytest -m slow`)
require_vllm()


def test_bench_vllm_quick_runs_and_prints_its_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location(
        "bench_vllm", ROOT / "benchmarks" / "bench_vllm.py"
    )
    assert spec is not None
    assert spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_vllm"] = bench
    try:
        spec.loader.exec_module(bench)
        argv = ["--quick", "--dir", str(tmp_path), "--skip", "lmcache cpu,lmcache disk"]
        assert bench.main(argv) == 0  # 1: an answer differs
    finally:
        del sys.modules["bench_vllm"]
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
