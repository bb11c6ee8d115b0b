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
replica without it); the slow half runs every layout both ways: the ten campaigns run as
processes of their own, :data:`AT_ONCE` at a time (each spends half its time waiting on
its faults: restarts, stalls, leases), started together when the first of them is asked
for, and each test checks its own campaign's report. The long run is the script itself::

    .venv/bin/python benchmarks/fleet_campaign.py --duration 300 --seed 1 \\
        --layout host+ssd+redis --secret --unkeyed-replica
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
    check_report(status, out)
    return out


def check_report(status: int, out: str) -> None:
    """A campaign's exit status and report say it found nothing."""
    assert status == 0, out
    assert "wrong histories: 0\n" in out
    assert "lost acknowledged turns: 0 " in out
    assert "unexpected exception types: 0\n" in out
    assert " 0 damaged," in out
    longest = float(out.split("longest operation: ")[1].split(" ")[0])
    assert longest < 30, out


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


LAYOUTS = ["host+redis", "ssd+redis", "host+ssd+redis", "full-host+redis", "host+redis+ssd"]
"""Every layout of the script. (``host+redis+ssd``'s 150-second campaign of seed 6005 found
a fork committed again from SSD over a new history's turn under its parent's key, after an
empty restart: ``tests/integration/test_redis_adopt.py`` pins the fix.)"""
CAMPAIGNS = [(layout, secret) for layout in LAYOUTS for secret in (False, True)]
AT_ONCE = 4
"""Campaigns running at once in the slow half (each has its own redis-server and three or
four replica processes; eight at once on two cores would starve their replicas' starts)."""
LIMIT = 600.0
"""Seconds one campaign may run (20 s of faults, up to 60 s more on a loaded machine until
it has done its operations, then its checks: about 30 s alone)."""


def campaign_argv(layout: str, secret: bool) -> list[str]:
    argv = ["--duration", "20", "--seed", "22", "--min-operations", "150", "--layout", layout]
    if secret:
        argv += ["--secret", "--unkeyed-replica"]
    return argv


def _run(argv: list[str]) -> tuple[int, str]:
    """The campaign script in a process of its own (warnings are errors there, as in the
    test process): its exit status and output. Past :data:`LIMIT` its process group (its
    replicas and redis-server too) is killed."""
    script = ROOT / "benchmarks" / "fleet_campaign.py"
    proc = subprocess.Popen(
        [sys.executable, "-W", "error", str(script), *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -1, f"{out}\nthe campaign ran past {LIMIT:.0f} s: killed"
    return proc.returncode, out


@pytest.fixture(scope="module")
def campaigns(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[tuple[str, bool], Future[tuple[int, str]]]]:
    """The campaign of every layout, both ways, that this session's tests ask for, started
    together (:data:`AT_ONCE` at a time): each one's exit status and output, when done."""
    require_redis_server()
    root = tmp_path_factory.mktemp("fleet")
    asked = {
        (item.callspec.params["layout"], item.callspec.params["secret"])
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.originalname == "test_fleet_campaign_finds_nothing"
    }
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        futures = {
            (layout, secret): pool.submit(
                _run,
                [*campaign_argv(layout, secret), "--keep", str(root / f"{layout}-{secret}")],
            )
            for layout, secret in CAMPAIGNS
            if (layout, secret) in asked
        }
        try:
            yield futures
        finally:
            for future in futures.values():
                future.cancel()  # (those not started; a running one ends by LIMIT)


@pytest.mark.slow
@pytest.mark.timeout(2 * LIMIT + 120)  # (the first waits for its turn, as the rest run)
@pytest.mark.parametrize("secret", [False, True], ids=["plain", "secret"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fleet_campaign_finds_nothing(
    campaigns: dict[tuple[str, bool], Future[tuple[int, str]]],
    capsys: pytest.CaptureFixture[str],
    layout: str,
    secret: bool,
) -> None:
    status, out = campaigns[(layout, secret)].result()
    with capsys.disabled():
        print("\n" + out)
    check_report(status, out)
    for kind in ("stall", "kill-aof", "kill-empty", "lose-manifest", "replica-kill"):
        assert f"{kind} " in out.split("faults:")[1].split("\n")[0], f"no {kind} fault"
    assert operations(out) >= 150, out
    assert "concurrent flushes: 0;" not in out, out
    assert "forks made: 0;" not in out, out
    assert "loads of a fork served: 0;" not in out, out
