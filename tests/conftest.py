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


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the Redis servers the collected tests take ahead of them (a tier without a
    secret opens only on a server up for its settling period)."""
    from tests.redis_server import start_spares

    if not session.config.option.collectonly:
        start_spares(session.items)


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.redis_server import stop_spares

    stop_spares()
