"""One run of the vLLM benchmark (``benchmarks/bench_vllm.py --quick``) that two tests
check: ``test_bench_vllm.py`` (vLLM's own options and tieredkv's rows, the ratios and their
targets) and ``test_bench_vllm_lmcache.py`` (the LMCache rows, through the peer's
environment). Every row runs once, on the quick chat workload with vLLM's pool one
conversation (``--pool-blocks 10``: the longest takes 9 blocks, so the caches serve), in
the session-scoped :func:`bench_vllm_quick` fixture: the rows both tests need (vLLM
alone, tieredkv's Bidaw rows) start their engines once, not twice.

Without the peer's environment the run leaves the LMCache rows out and the LMCache test
skips, saying how to create it; with ``CI=true`` the environment is created first (or the
creation ``.ci/run`` started in the background is waited for), and a failure to create it
fails the LMCache test (the other rows still run and are checked).
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.benchmark_scripts import benchmark_script

__all__ = ["QuickRun", "bench_vllm_quick", "peer_env"]

ROOT = Path(__file__).resolve().parents[1]
LMCACHE_ROWS = "lmcache cpu,lmcache disk"


@dataclass(frozen=True)
class QuickRun:
    """The benchmark's exit status and output; ``peer_problem``: why its LMCache rows did
    not run (``None``: they ran)."""

    status: int
    out: str
    peer_problem: str | None


def peer_env() -> Path:
    """Where the LMCache peer's environment is (``TIEREDKV_LMCACHE_ENV``, or its default)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import peer_lmcache

    return Path(os.environ.get("TIEREDKV_LMCACHE_ENV", str(peer_lmcache.DEFAULT_ENV)))


def _peer_problem(env: Path) -> str | None:
    """Why the LMCache rows cannot run (``None``: they can). With ``CI=true``, the
    environment is created first (5-10 min), or its creation waited for."""
    import peer_lmcache

    if os.environ.get("CI") == "true":
        try:
            peer_lmcache.create(env)  # CI runs the peer, never skips it
        except Exception as exc:  # the LMCache test fails saying so; the rest still runs
            return f"creating the LMCache peer environment at {env} failed: {exc}"
    if not peer_lmcache.is_ready(env):
        return (
            f"the LMCache peer environment is not at {env}: create it with "
            f"`python3 benchmarks/peer_lmcache.py create --peer-env {env}` (5-10 min)"
        )
    return None


@pytest.fixture(scope="session")
def bench_vllm_quick(tmp_path_factory: pytest.TempPathFactory) -> QuickRun:
    """The quick benchmark's run, every row (the LMCache rows where the peer's environment
    is ready), vLLM's pool one conversation."""
    env = peer_env()
    problem = _peer_problem(env)
    # vLLM's engines in the runner's process (LMCache's excepted): each starts in ~15 s, not
    # ~40; the connector's split across vLLM's processes is test_vllm_connector.py's
    argv = ["--quick", "--in-process", "--dir", str(tmp_path_factory.mktemp("bench-vllm"))]
    argv += ["--pool-blocks", "10"]  # one conversation (the longest takes 9 blocks)
    if problem is None:
        argv += ["--peer-env", str(env)]
    else:
        argv += ["--skip", LMCACHE_ROWS]
    out = io.StringIO()
    with benchmark_script("bench_vllm") as bench, contextlib.redirect_stdout(out):
        status = bench.main(argv)
    return QuickRun(status=status, out=out.getvalue(), peer_problem=problem)
