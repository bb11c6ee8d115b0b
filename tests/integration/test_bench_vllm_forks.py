"""The vLLM benchmark's forks-off row runs end to end on the quick system-prompt workload:
with ``forks`` on, tieredkv stores the shared prompt once and each conversation's own
blocks; with it off, every conversation whole. Both rows answer as recompute does and the
benchmark prints the bytes stored with forks over without, below 1 (at this size vLLM's
pool keeps what the returning turns need, so neither row loads: serving forks is
``test_vllm_forks.py``'s).

Three vLLM engines start one after another, in the runner's process (``--in-process``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.benchmark_scripts import benchmark_script, table_row
from tests.vllm_support import require_vllm

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]  # CI runs it (`pytest -m slow`)
require_vllm()


def test_bench_vllm_forks_off_row_runs_and_stores_the_shared_prompt_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with benchmark_script("bench_vllm") as bench:
        keep = {"vllm recompute", "tieredkv bidaw", "tieredkv bidaw (no forks)"}
        skip = ",".join(r for r in bench.ROWS if r not in keep)
        # vLLM's pool holds one conversation (the smallest that serves the longest)
        argv = ["--quick", "--in-process", "--workloads", "system", "--dir", str(tmp_path)]
        argv += ["--skip", skip]
        argv += ["--pool-conversations", "1"]
        assert bench.main(argv) == 0  # 1: an answer differs
    out = capsys.readouterr().out
    assert "answers: every row equals recompute" in out, out
    # columns: TTFT mean, P99, turns/s, host hit, stored MiB, CPU-s/turn, cached, ...
    forks, whole = table_row(out, "tieredkv bidaw"), table_row(out, "tieredkv bidaw (no forks)")
    for cols in (forks, whole):
        assert cols[-1] == "equal", out
    m = re.search(r"tieredkv bidaw, forks on / off: bytes stored ([0-9.]+)x", out)
    assert m is not None, out
    assert float(m.group(1)) < 1.0, out  # the shared prompt stored once, not per conversation
    assert 0 < float(forks[4]) < float(whole[4]), out
