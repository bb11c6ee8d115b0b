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
replica without it); the slow half runs every layout both ways, two campaigns at a time
(each the script in a process of its own: most of a campaign's 20 s is waiting between
faults, so two overlap on two cores; each still runs its 20 s of faults and its minimum
of operations). The long run is the script itself::

    .venv/bin/python benchmarks/fleet_campaign.py --duration 300 --seed 1 \\
        --layout host+ssd+redis --secret --unkeyed-replica
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_server import require_redis_server

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "fleet_campaign.py"


def run_campaign(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the campaign with ``argv`` in this process; its report, checked for a clean
    result."""
    require_redis_server()
    spec = importlib.util.spec_from_file_location("fleet_campaign", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    campaign = importlib.util.module_from_spec(spec)
    sys.modules["fleet_campaign"] = campaign
    try:
        spec.loader.exec_module(campaign)
        status = campaign.main([*argv, "--keep", str(tmp_path / "run")])
    finally:
        del sys.modules["fleet_campaign"]
    out = capsys.readouterr().out
    with capsys.disabled():
        print("\n" + out)
    return checked(status, out)


def checked(status: int, out: str) -> str:
    """A campaign's report (``out``, its exit ``status``), checked for a clean result."""
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
AT_ONCE = 2
"""Campaigns of the slow half that run at the same time."""


def slow_argv(layout: str, secret: bool) -> list[str]:
    argv = ["--duration", "20", "--seed", "22", "--min-operations", "150", "--layout", layout]
    if secret:
        argv += ["--secret", "--unkeyed-replica"]
    return argv


class Campaigns:
    """The slow half's campaigns, each the script in a process (and process group) of its
    own, started in the order their tests run, :data:`AT_ONCE` at a time: a test waits for
    its own campaign, which started while an earlier test's ran."""

    def __init__(self, keys: list[tuple[str, bool]], root: Path) -> None:
        self.keys = keys
        self.root = root
        self.procs: dict[tuple[str, bool], subprocess.Popen[bytes]] = {}

    def _work(self, key: tuple[str, bool]) -> Path:
        layout, secret = key
        return self.root / f"{layout}-{'secret' if secret else 'plain'}"

    def _start(self, key: tuple[str, bool]) -> None:
        layout, secret = key
        work = self._work(key)
        work.mkdir()
        with (work / "report.txt").open("wb") as out:
            self.procs[key] = subprocess.Popen(
                [
                    sys.executable,
                    "-W",  # warnings are errors, as they were inside the test's process
                    "error",
                    str(SCRIPT),
                    *slow_argv(layout, secret),
                    "--keep",
                    str(work / "run"),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,  # its replicas and redis-server end with it
            )

    def report(self, key: tuple[str, bool]) -> tuple[int, str]:
        """Start ``key``'s campaign (and the next ones, up to :data:`AT_ONCE` running) if
        not started; wait for it; its exit status and report."""
        if key not in self.keys:
            self.keys.append(key)
        for k in self.keys[self.keys.index(key) :]:
            running = sum(p.poll() is None for p in self.procs.values())
            if k not in self.procs and (k == key or running < AT_ONCE):
                self._start(k)
        proc = self.procs[key]
        status = proc.wait()
        return status, (self._work(key) / "report.txt").read_text()

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:  # (a test that failed early, an interrupted session)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def campaigns(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Campaigns]:
    require_redis_server()
    keys = [
        (str(item.callspec.params["layout"]), bool(item.callspec.params["secret"]))
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.originalname == "test_fleet_campaign_finds_nothing"
    ]
    runner = Campaigns(keys, tmp_path_factory.mktemp("fleet"))
    try:
        yield runner
    finally:
        runner.close()


@pytest.mark.slow
@pytest.mark.timeout(600)  # the earlier test's campaign and this one's overlap
@pytest.mark.parametrize("secret", [False, True], ids=["plain", "secret"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fleet_campaign_finds_nothing(
    campaigns: Campaigns, capsys: pytest.CaptureFixture[str], layout: str, secret: bool
) -> None:
    status, out = campaigns.report((layout, secret))
    with capsys.disabled():
        print("\n" + out)
    out = checked(status, out)
    for kind in ("stall", "kill-aof", "kill-empty", "lose-manifest", "replica-kill"):
        assert f"{kind} " in out.split("faults:")[1].split("\n")[0], f"no {kind} fault"
    assert operations(out) >= 150, out
    assert "concurrent flushes: 0;" not in out, out
    assert "forks made: 0;" not in out, out
    assert "loads of a fork served: 0;" not in out, out
