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


def run(script: str, flags: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<script> <flags>`` in ``cwd``; it must exit 0."""
    done = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / script, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.parametrize(
    ("flags", "rows", "ratios"),
    [
        ([], ["held", "overlapped", "raw"], ["held / overlapped, time"]),
        (
            ["--same-files"],
            ["overlapped", "unverified", "into places", "raw", "raw pieces", "raw places"],
            [
                "raw pieces / raw, GB/s",
                "raw places / raw pieces, GB/s",
                "raw places / raw, GB/s",
                "into places / raw places, GB/s",
            ],
        ),
    ],
)
def test_bench_load_overlap_reads_every_way_and_prints_its_ratios(
    tmp_path: Path, flags: list[str], rows: list[str], ratios: list[str]
) -> None:
    done = run("bench_load_overlap.py", [*SMALL, *flags], tmp_path)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("3 turns x 2 tensors = 2 MiB turns")
    for row in rows:
        assert any(line.split()[: len(row.split())] == row.split() for line in lines[2:]), row
    for ratio in ratios:
        assert any(line.startswith(ratio) and "of 2)" in line for line in lines), ratio


def test_load_timeline_times_both_readers_within_their_calls(tmp_path: Path) -> None:
    """``benchmarks/_load_timeline.py`` (where a load's time goes beside raw reads of the same
    files into the same places): a row per reader, each figure inside its call."""
    done = run("_load_timeline.py", SMALL, tmp_path)
    rows = {}
    for line in done.stdout.splitlines():
        for mode in ("raw places", "load_into"):
            if line.startswith(mode):
                rows[mode] = [float(x) for x in line[len(mode) :].split()]
    assert set(rows) == {"raw places", "load_into"}, done.stdout
    for mode, (call, first_open, first_read, after, in_flight, mean) in rows.items():
        assert 0 <= first_open <= first_read < call, (mode, rows[mode])
        assert 0 <= after < call, (mode, rows[mode])
        assert 0 < in_flight <= call, (mode, rows[mode])
        assert 1 <= mean <= 8, (mode, rows[mode])  # --depth 8 raw reads, READ_DEPTH 8 loads


def test_scatter_pieces_reads_every_layout_and_checks_its_bytes(tmp_path: Path) -> None:
    """``benchmarks/_scatter_pieces.py`` (what the pieces a read lands in cost it): a row per
    layout, the contiguous one the reference (its own ratio 1), every read byte-checked."""
    done = run(
        "_scatter_pieces.py", ["--reps", "1", "--files", "2", "--dir", str(tmp_path)], tmp_path
    )
    lines = done.stdout.splitlines()
    assert lines[0].startswith("2 files of 8 MiB, 8 reads in flight, 1 reps;"), done.stdout
    rows = {line[:14].strip(): line for line in lines[1:]}
    layouts = ["contig 8M", "2M pieces", "512K pieces", "128K pieces", "128K strided"]
    assert list(rows) == layouts, done.stdout
    assert rows["contig 8M"].endswith("(paired median) 1.000"), done.stdout
    for line in rows.values():
        assert float(line.rsplit(" ", 1)[1]) > 0, line
    assert list(tmp_path.iterdir()) == [], "the files it wrote are left behind"


def test_stream_ab_loads_with_both_streams_and_prints_a_paired_ratio(tmp_path: Path) -> None:
    """``benchmarks/_stream_ab.py`` (this tree's span stream against another's, in one
    process), with this very tree as the other: a row per tree, each figure inside its
    call (every load is compared byte for byte: the script fails otherwise), and the
    paired ratio over both reps. A tree without the stream is refused, saying where it
    looked."""
    flags = ["--reps", "2", "--turns", "10", "--mib", "1", "--tensors", "2", "--dir"]
    done = run("_stream_ab.py", [*flags, str(tmp_path), "--other", str(ROOT)], tmp_path)
    lines = done.stdout.splitlines()
    assert lines[0].startswith("10 turns x 2 tensors = 1 MiB turns; 2 reps"), done.stdout
    assert lines[1].split() == [
        "median",
        "of",
        "2",
        "call",
        "first",
        "read",
        "next",
        "read",
        "after",
        "last",
    ], done.stdout
    for line, tree in zip(lines[2:4], ("this", "other"), strict=True):
        name, call, first, later, after = line.split()
        assert name == tree, done.stdout
        assert 0 < float(first) < float(call), line
        assert 0 < float(later) < float(call), line  # (10 reads: two after a slot freed)
        assert 0 <= float(after) < float(call), line
    assert "median of the reps' ratios" in lines[4], done.stdout
    assert lines[4].endswith("of 2)"), done.stdout
    assert list(tmp_path.iterdir()) == [], "the files it wrote are left behind"
    refused = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "_stream_ab.py", "--other", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode != 0
    assert f"--other {tmp_path}: no src/tieredkv/backends/ssd/stream.py there" in refused.stderr
