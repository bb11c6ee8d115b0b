"""The page-fault benchmark runs end to end: every kind of mapping in a process of its own,
each with its figures, and a ratio against the private mapping the library uses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_faults import KINDS  # noqa: E402  (the benchmark's own list of kinds)


@pytest.mark.slow  # a benchmark, at its smallest: CI runs it
def test_bench_faults_measures_every_kind_of_mapping() -> None:
    done = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "bench_faults.py", "--mib", "8", "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "8 MiB per mapping, median of 1 processes per kind" in out
    row = re.compile(r"^(?P<kind>[a-z ,0-9]+?) +(?P<wall>\d+\.\d) +(?P<cpu>\d+\.\d) +(?P<f>\d+) ")
    rows = {m["kind"]: m for line in out.splitlines() if (m := row.match(line))}
    assert set(rows) == set(KINDS)
    # a private 8 MiB mapping touched page by page takes a fault per 4 KiB page
    assert int(rows["private"]["f"]) >= 2048
    for kind in KINDS:
        if kind != "private":
            assert re.search(rf"^ratio {re.escape(kind)} / private \(wall\): \d+\.\d\d$", out, re.M)
