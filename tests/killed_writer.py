"""A writer process that a crash test SIGKILLs: started with the repository importable, and
the acknowledgements it printed read back whole (a line torn by the kill does not count)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]


def start_writer(
    writer: Path, args: list[str], err: IO[bytes], *, stdin: bool = False
) -> subprocess.Popen[bytes]:
    """Run ``writer`` with ``args`` in a fresh interpreter, its stdout piped, its stderr
    to ``err`` (and its stdin piped, with ``stdin``). The repository (for ``tests``) goes
    ahead of any path the caller set (``tieredkv`` may be importable only through it, e.g.
    PYTHONPATH=src without an install)."""
    return subprocess.Popen(
        [sys.executable, str(writer), *args],
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        stderr=err,
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
        },
    )


def complete_lines(rest: bytes) -> list[list[str]]:
    """The words of each whole line of what a killed writer left in its pipe (its last
    line, torn by the kill, is left out)."""
    lines = rest.decode(errors="replace").splitlines(keepends=True)
    return [line.split() for line in lines if line.endswith("\n")]
