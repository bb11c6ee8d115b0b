"""The API benchmark runs end to end on a small history, checks every system's bytes, and
prints each ratio with its target (what the README's benchmark list promises)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_api_runs_and_prints_its_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location("bench_api", ROOT / "benchmarks" / "bench_api.py")
    assert spec is not None
    assert spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_api"] = bench
    try:
        spec.loader.exec_module(bench)
        argv = ["--dir", str(tmp_path), "--turns", "2", "--tensors", "4", "--rounds", "1"]
        assert bench.main(argv) == 0  # 1 if any system read back different bytes
    finally:
        del sys.modules["bench_api"]
    out = capsys.readouterr().out
    for label in (
        "load / raw O_DIRECT read",
        "load_into / raw O_DIRECT read",
        "load / safetensors load_file",
        "append / raw O_DIRECT write+fsync",
        "append / safetensors save_file+fsync",
        "new cache: load / raw read",
        "new cache: append / raw write",
    ):
        assert f"ratio {label}" in out
    assert list(tmp_path.iterdir()) == []  # its files are removed
