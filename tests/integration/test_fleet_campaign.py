"""The fleet campaign (benchmarks/fleet_campaign.py), short and seeded, in the test command.

Replica processes share one redis-server while it is SIGKILLed and restarted (from its
append-only file, or empty), SIGSTOPped, and loses manifests; replicas are SIGKILLed and
come back; leases expire; the replicas write the same eight conversations at once, and
flush several times at once; they fork each other's conversations (inside a turn, at its
end, forks of forks) and drop conversations, parents of live forks among them. Each tier
layout the Redis how-to describes runs, with and without ``secret=`` (and with it, one
more replica without the secret). Then the checker
compares every history served with the acknowledged ones: no wrong history, no lost
acknowledged turn beyond what the server itself lost, no exception outside the contract,
no operation past its bound (no hang), no history damaged by a misconfigured replica.

The default suite runs one short campaign (the three-tier layout with a secret and a
replica without it); the slow half runs every layout both ways. The long run is the
script itself::

    .venv/bin/python benchmarks/fleet_campaign.py --duration 300 --seed 1 \\
        --layout host+ssd+redis --secret --unkeyed-replica
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmark_scripts import benchmark_script
from tests.redis_server import require_redis_server

ROOT = Path(__file__).resolve().parents[2]


def run_campaign(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the campaign with ``argv``; its report, checked for a clean result."""
    require_redis_server()
    with benchmark_script("fleet_campaign") as campaign:
        status = campaign.main([*argv, "--keep", str(tmp_path / "run")])
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + out)
    assert status == 0, out
    assert "wrong histories: 0\n" in out
    assert "lost acknowledged turns: 0 " in out
    assert "unexpected exception types: 0\n" in out
    assert " 0 damaged," in out
    longest = float(out.split("longest operation: ")[1].split(" ")[0])
    assert longest < 30, out
    return out


def operations(out: str) -> int:
    return int(out.split("operations: ")[1].split(" ")[0].replace(",", ""))


def test_a_short_campaign_of_the_three_tier_layout_finds_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Host + SSD + Redis with a secret, two replicas and one without the secret, a few
    seconds of faults: clean, and the replica without the secret was refused."""
    argv = ["--duration", "3", "--seed", "5", "--replicas", "2", "--min-operations", "30"]
    argv += ["--layout", "host+ssd+redis", "--secret", "--unkeyed-replica"]
    argv += ["--fault-every", "0.5", "1.5"]
    out = run_campaign(tmp_path, capsys, argv)
    assert operations(out) >= 30, out
    refused = int(out.split("without the secret refused: ")[1].split("\n")[0])
    assert refused > 0, out


LAYOUTS = ["host+redis", "ssd+redis", "host+ssd+redis", "full-host+redis"]


@pytest.mark.slow
@pytest.mark.parametrize("secret", [False, True], ids=["plain", "secret"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fleet_campaign_finds_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str, secret: bool
) -> None:
    argv = ["--duration", "20", "--seed", "22", "--min-operations", "150", "--layout", layout]
    if secret:
        argv += ["--secret", "--unkeyed-replica"]
    out = run_campaign(tmp_path, capsys, argv)
    for kind in ("stall", "kill-aof", "kill-empty", "lose-manifest", "replica-kill"):
        assert f"{kind} " in out.split("faults:")[1].split("\n")[0], f"no {kind} fault"
    assert operations(out) >= 150, out
    assert "concurrent flushes: 0;" not in out, out
    assert "forks made: 0;" not in out, out
    assert "loads of a fork served: 0;" not in out, out
