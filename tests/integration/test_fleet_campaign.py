"""The fleet campaign (benchmarks/fleet_campaign.py), short and seeded, in the test command.

Three replica processes share one redis-server for 20 seconds of faults (longer, up to
60 s, on a loaded machine, until they have done 150 operations): the server is
SIGKILLed and restarted from its append-only file and empty, SIGSTOPped, loses
manifests; replicas are SIGKILLed and come back; leases expire; the replicas write the
same eight conversations at once. Then the checker compares every history served with
the acknowledged ones: no wrong history, no lost acknowledged turn beyond what the server
itself lost, no exception outside the contract. The long run is the script itself::

    .venv/bin/python benchmarks/fleet_campaign.py --duration 300 --seed 1
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.redis_server import require_redis_server

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fleet_campaign_finds_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    require_redis_server()
    spec = importlib.util.spec_from_file_location(
        "fleet_campaign", ROOT / "benchmarks" / "fleet_campaign.py"
    )
    assert spec is not None
    assert spec.loader is not None
    campaign = importlib.util.module_from_spec(spec)
    sys.modules["fleet_campaign"] = campaign
    try:
        spec.loader.exec_module(campaign)
        argv = ["--duration", "20", "--seed", "22", "--min-operations", "150"]
        argv += ["--keep", str(tmp_path / "run")]
        status = campaign.main(argv)
    finally:
        del sys.modules["fleet_campaign"]
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + out)
    assert status == 0, out
    assert "wrong histories: 0\n" in out
    assert "lost acknowledged turns: 0 " in out
    assert "unexpected exception types: 0\n" in out
    assert " 0 damaged," in out
    for kind in ("stall", "kill-aof", "kill-empty", "lose-manifest", "replica-kill"):
        assert f"{kind} " in out.split("faults:")[1].split("\n")[0], f"no {kind} fault"
    ops = int(out.split("operations: ")[1].split(" ")[0].replace(",", ""))
    assert ops >= 150, out
