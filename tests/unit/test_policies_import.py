"""Policies are pure: importing them must not pull in asyncio (or anything that does)."""

from __future__ import annotations

import subprocess
import sys


def test_importing_policies_loads_no_asyncio() -> None:
    code = "import sys, tieredkv.policies; assert 'asyncio' not in sys.modules, 'asyncio loaded'"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_importing_the_replay_and_workload_loads_no_asyncio() -> None:
    code = (
        "import sys, tieredkv.sim.replay, tieredkv.sim.synthetic; "
        "assert 'asyncio' not in sys.modules, 'asyncio loaded'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
