"""The scripts under ``benchmarks/`` loaded as modules, for the tests that run them, and a
row of the tables they print."""

from __future__ import annotations

import contextlib
import importlib.util
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

__all__ = ["benchmark_script", "table_row"]

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def benchmark_script(script: str, name: str | None = None) -> Iterator[ModuleType]:
    """``benchmarks/<script>.py`` as a module named ``name`` (default: ``script``), in
    ``sys.modules`` while in use (its dataclasses look their module up there)."""
    name = name or script
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{script}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def table_row(out: str, name: str) -> list[str]:
    """The columns of row ``name`` of the table in ``out`` (its line starts with the name
    and a TTFT in seconds)."""
    lines = [line for line in out.splitlines() if re.match(rf"{re.escape(name)} +[0-9.]+s ", line)]
    assert len(lines) == 1, out
    return lines[0][len(name) :].split()
