"""Waiting for a child a test forked, without hanging the test run if the child hangs."""

from __future__ import annotations

import os
import signal
import time

import pytest

__all__ = ["wait_child"]


def wait_child(pid: int, why: str, seconds: float = 30) -> int:
    """The exit code of child ``pid``; fails the test with ``why`` (killing the child) if it
    has not exited within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(why)
