"""The API benchmark runs end to end in its quick mode: every system in a process of its
own, every read checked byte for byte against what was written (the benchmark exits 1
otherwise), and it prints each figure with its CPU time, each ratio with its target, and
the peer's stand-alone figure beside its in-round one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip(
    "safetensors", reason="the API benchmark needs the bench extra: pip install -e '.[bench]'"
)


@pytest.mark.slow  # a benchmark, quick mode: CI runs it
def test_bench_api_quick_runs_every_system_and_prints_its_ratios(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            ROOT / "benchmarks" / "bench_api.py",
            "--quick",
            "--no-drop",
            "--dir",
            tmp_path,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr  # 1 if any system read back other bytes
    out = done.stdout
    assert "every read byte-checked" in out
    assert "reads made cold by fadvise" in out
    assert "; 0 s settle before each child and the open cache's load;" in out  # (--quick)
    figure = re.compile(r"^(?P<name>[a-z0-9_ ]+?) +(?P<gbps>\d+\.\d\d) +(?P<cpu>\d+\.\d{3}) +\d+ ")
    rows = {m["name"]: m for line in out.splitlines() if (m := figure.match(line))}
    for system, ops in (
        ("tieredkv", ("append", "load", "load_into")),
        ("new cache", ("append", "load", "load_into")),
        ("raw", ("append", "load")),
        ("safetensors", ("append", "load")),
        ("safetensors 1 thread", ("append", "load")),
        ("safetensors alone", ("append", "load")),
    ):
        for op in ops:
            row = rows[f"{system} {op}"]
            assert float(row["cpu"]) > 0  # every child did real work (GB/s may round to 0.00)
    for cache in ("open cache", "new cache"):
        for label in (
            "load / safetensors (best)",
            "load / raw O_DIRECT",
            "append / safetensors (best)",
            "append / raw O_DIRECT",
            "load_into / raw O_DIRECT",
        ):
            # the ratio of the medians, then the median of the per-round ratios
            pattern = rf"^ratio {cache}: {re.escape(label)} +\d+\.\d\d +\d+\.\d\d  \(target >= "
            assert re.search(pattern, out, re.M), label
    for op in ("append", "load"):
        assert re.search(
            rf"^peer  safetensors {op}: alone \d+\.\d\d GB/s, in the rounds", out, re.M
        )
    assert re.search(r"^cpu   tieredkv load +\d+\.\d{3}  CPU-s/GB", out, re.M)
    assert list(tmp_path.iterdir()) == []  # its files are removed


@pytest.mark.parametrize("settle", ["-1", "nan"])
def test_a_settle_that_is_not_a_pause_is_refused_saying_so(settle: str) -> None:
    done = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "bench_api.py", "--quick", "--settle", settle],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert f"--settle must be 0 or more seconds, not {float(settle)}" in done.stderr
