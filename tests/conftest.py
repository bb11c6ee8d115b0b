"""Shared fixtures. The autouse ``no_blocking_io`` fixture fails any test in which tieredkv
performs a blocking file-system call on the event loop's thread."""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

# the ``seg`` fixture: real segments for tier tests; ``bench_vllm_quick``: the quick vLLM
# benchmark's run, shared by two tests
pytest_plugins = ["tests.segments", "tests.bench_vllm_quick"]

_BLOCKING = (
    "open",
    "read",
    "write",
    "pread",
    "pwrite",
    "preadv",
    "pwritev",
    "fsync",
    "fdatasync",
    "replace",
    "rename",
    "unlink",
    "mkdir",
    "scandir",
    "listdir",
    "posix_fallocate",
    "ftruncate",
)


def _in_library(module: object) -> bool:
    """Whether a frame's module (its globals' ``__name__``) is tieredkv's own code. By package
    name, not by path: a clone named ``tieredkv`` puts pytest's own files (in its ``.venv``)
    under a ``/tieredkv/`` directory too. ``tieredkv.testing`` is the tier contract kit, test
    code that inspects a tier's files directly."""
    if not isinstance(module, str):
        return False
    if module == "tieredkv.testing" or module.startswith("tieredkv.testing."):
        return False
    return module == "tieredkv" or module.startswith("tieredkv.")


def _caller_in_tieredkv() -> list[str] | None:
    caller = sys._getframe(2)  # the frame that called the guarded os function
    frame: FrameType | None = caller
    while frame is not None:
        if _in_library(frame.f_globals.get("__name__")):
            return traceback.format_list(traceback.extract_stack(caller)[-6:])
        frame = frame.f_back
    return None


@pytest.fixture(autouse=True)
def no_blocking_io(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Record tieredkv's blocking os.* calls made on a thread that runs an event loop."""
    violations: list[str] = []

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if asyncio._get_running_loop() is not None:
                where = _caller_in_tieredkv()
                if where is not None:
                    violations.append(f"os.{name} on the event loop:\n" + "".join(where))
            return fn(*args, **kwargs)

        return guarded

    for name in _BLOCKING:
        if hasattr(os, name):
            monkeypatch.setattr(os, name, wrap(name, getattr(os, name)))
    yield violations
    if violations:
        pytest.fail(
            f"tieredkv blocked the event loop {len(violations)} time(s); first:\n{violations[0]}",
            pytrace=False,
        )


@pytest.fixture
def ssd_dir(tmp_path: Path) -> Path:
    """A directory for an SSD tier (on the same filesystem as the test's tmp_path)."""
    d = tmp_path / "ssd"
    d.mkdir()
    return d


def pytest_report_header() -> str:
    return f"tieredkv tests on Python {sys.version.split()[0]}"


SHARED_RUNS = {
    "tests/integration/test_bench_vllm_lmcache.py": "tests/integration/test_bench_vllm.py"
}
"""Test files whose tests take a session-scoped fixture's run with another file's (here the
quick vLLM benchmark's, :mod:`tests.bench_vllm_quick`): pytest-xdist runs them in the
other's process, so the run happens once."""


def _xdist_unit(nodeid: str) -> str:
    """The work unit of a test under pytest-xdist: its file (or the one it shares a run
    with), so that a module-scoped fixture (a vLLM engine's run, a Redis server) starts
    once, in one process, as without xdist."""
    path = nodeid.split("::", 1)[0]
    return SHARED_RUNS.get(path, path)


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hook: without it, never called)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scheduler for ``-n``: its ``loadscope`` one (each worker takes a
    whole work unit at a time, the units with the most tests first), the units by
    :func:`_xdist_unit`. (``--dist loadgroup`` with ``xdist_group`` marks would say the
    same, but pytest-xdist 3.8 marks a test's group in its node id in a way pytest 9.2
    ignores, so every test is then a unit of its own.)"""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped,import-not-found,unused-ignore]

    class ByFile(LoadScopeScheduling):  # type: ignore[misc]  # (an untyped base)
        def _split_scope(self, nodeid: str) -> str:
            return _xdist_unit(nodeid)

    return ByFile(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the Redis servers the collected tests take ahead of them (a tier without a
    secret opens only on a server up for its settling period)."""
    from tests.redis_server import start_spares

    if not session.config.option.collectonly:
        start_spares(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.redis_server import stop_spares

    stop_spares()
