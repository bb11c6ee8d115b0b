"""The load-overlap benchmark runs end to end at a small size, in both modes: every load and
raw read is compared byte for byte (the benchmark raises otherwise), and it prints a row per
way of reading and the paired ratios."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# outputs of 3 MiB: the pool's, aligned, so the load reads straight into them
SMALL = ["--reps", "2", "--turns", "3", "--mib", "2", "--tensors", "2"]


@pytest.mark.parametrize(
    ("flags", "rows", "ratios"),
    [
        ([], ["held", "overlapped", "raw"], ["held / overlapped, time"]),
        (
            ["--same-files"],
            ["overlapped", "unverified", "into places", "raw", "raw places"],
            ["raw places / raw, GB/s", "into places / raw places, GB/s"],
        ),
    ],
)
def test_bench_load_overlap_reads_every_way_and_prints_its_ratios(
    tmp_path: Path, flags: list[str], rows: list[str], ratios: list[str]
) -> None:
    done = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "bench_load_overlap.py", *SMALL, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("3 turns x 2 tensors = 2 MiB turns")
    for row in rows:
        assert any(line.split()[: len(row.split())] == row.split() for line in lines[2:]), row
    for ratio in ratios:
        assert any(line.startswith(ratio) and "of 2)" in line for line in lines), ratio
