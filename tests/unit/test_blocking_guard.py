"""The autouse ``no_blocking_io`` guard (tests/conftest.py) tells tieredkv's frames from others
by package, not by a path: a clone named ``tieredkv`` holds pytest itself (in its ``.venv``)
under a ``/tieredkv/`` directory, and the guard must not take pytest's calls for the library's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tieredkv.fsck import NotATierDirectoryError, check_directory


async def test_a_blocking_call_by_tieredkv_on_the_loop_is_recorded(
    no_blocking_io: list[str], tmp_path: Path
) -> None:
    with pytest.raises(NotATierDirectoryError):
        check_directory(tmp_path)  # tieredkv's fsck opens the directory: os.open on the loop
    # the directory and each subdirectory it looks for: every one recorded, in fsck.py
    assert no_blocking_io
    assert all(v.startswith("os.open on the event loop:") for v in no_blocking_io)
    assert all("tieredkv/fsck.py" in v.replace(os.sep, "/") for v in no_blocking_io)
    no_blocking_io.clear()  # recorded as it should be: not this test's failure


async def test_code_under_a_tieredkv_directory_that_is_not_the_package_is_not_recorded(
    no_blocking_io: list[str], tmp_path: Path
) -> None:
    # a module of another package whose file lies under .../tieredkv/.venv/..., as pytest's
    # own do in a clone named tieredkv
    where = tmp_path / "tieredkv" / ".venv" / "lib" / "site-packages" / "other.py"
    source = "def scan(path):\n    return sorted(e.name for e in os.scandir(path))\n"
    namespace: dict[str, object] = {"__name__": "other", "os": os}
    exec(compile(source, str(where), "exec"), namespace)
    (tmp_path / "a").touch()
    assert namespace["scan"](tmp_path) == ["a"]  # type: ignore[operator]
    assert no_blocking_io == []


def test_a_blocking_call_off_the_loop_is_not_recorded(
    no_blocking_io: list[str], tmp_path: Path
) -> None:
    with pytest.raises(NotATierDirectoryError):
        check_directory(tmp_path)
    assert no_blocking_io == []
