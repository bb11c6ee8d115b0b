"""benchmarks/bench_forest_sim.py: the shared-prompt workload's seed and ``--bidaw-kwargs``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_forest_sim  # noqa: E402
from tieredkv.policies import LRU, AdaptiveBidaw  # noqa: E402


def run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    monkeypatch.setattr(bench_forest_sim, "BIDAW_KWARGS", {})
    argv = ["bench_forest_sim.py", "--gb", "4", "--mooncake", "/nonexistent", *args]
    monkeypatch.setattr(sys, "argv", argv)
    bench_forest_sim.main()
    return capsys.readouterr().out


def test_the_seed_makes_another_workload_and_bidaw_kwargs_reach_the_bidaw_rows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def header(out: str) -> str:
        return next(line for line in out.splitlines() if line.startswith("== shared prompt"))

    default = run(monkeypatch, capsys, "--policies", "lru")
    assert "(no Mooncake trace at /nonexistent: skipped)" in default
    zero = run(monkeypatch, capsys, "--policies", "lru", "--seed", "0")
    one = run(monkeypatch, capsys, "--policies", "lru", "--seed", "1")
    assert header(zero) == header(default)
    assert header(one) != header(zero)  # other conversations: other turns and bytes
    out = run(monkeypatch, capsys, "--policies", "bidaw", "--bidaw-kwargs", '{"rival_margin": 8}')
    assert [line.split()[1] for line in out.splitlines() if line.startswith("       4 ")] == [
        "bidaw"
    ]
    monkeypatch.setattr(bench_forest_sim, "BIDAW_KWARGS", {"smooth_delays": False})
    bidaw = bench_forest_sim.build("bidaw")
    assert isinstance(bidaw, AdaptiveBidaw)
    assert not bidaw.smooth_delays
    assert isinstance(bench_forest_sim.build("lru"), LRU)


@pytest.mark.parametrize(("bad", "says"), [('{"sample": 1}', "'sample'"), ("[1]", "not a JSON")])
def test_bad_bidaw_kwargs_say_what_to_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], bad: str, says: str
) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_forest_sim.py", "--bidaw-kwargs", bad])
    with pytest.raises(SystemExit):
        bench_forest_sim.main()
    err = capsys.readouterr().err
    assert "--bidaw-kwargs must be a JSON object" in err
    assert says in err
