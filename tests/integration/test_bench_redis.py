"""The Redis benchmark runs end to end in its quick mode against its own redis-server:
every load checked byte for byte (a mismatch makes it fail), and it prints the tier's,
the cache's and the raw client's figures with their CPU time, the host tier beside a
plain copy, and each ratio with its target."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.redis_server import require_redis_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a benchmark, quick mode: CI runs it
def test_bench_redis_quick_prints_every_figure_and_ratio() -> None:
    require_redis_server()
    done = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "bench_redis.py", "--quick", "--no-check"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr  # an AssertionError if a load differed
    out = done.stdout
    assert "every load byte-checked" in out
    figure = r" +\d+\.\d ms +(\d+\.\d\d) GB/s +(\d+\.\d{3}) CPU-s/GB$"
    for label in (
        "RedisTier write",
        "cache append",
        r"raw SET \(pipelined\)",
        "RedisTier read",
        "cache load",
        r"raw GET \(pipelined\)",
        r"cache\.load_into",
        r"dst\.copy_\(src\)",
    ):
        m = re.search(rf"^    {label}{figure}", out, re.M)
        assert m is not None, label
        assert float(m[1]) > 0
        assert float(m[2]) > 0
    for label, target in (
        ("RedisTier write / raw SET", 0.9),
        ("cache append / raw SET", 0.9),
        ("RedisTier read / raw GET", 0.9),
        ("cache load / raw GET", 0.9),
        ("host load_into / copy", 0.8),
    ):
        assert re.search(rf"^ratio {label} +\d+\.\d\dx  \(target >= {target}: ", out, re.M)
