"""docs/reference/api.md says where each public name is imported from; check that it is so,
and that the ``tieredkv`` row is exactly what ``tieredkv`` exports."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import tieredkv

API = Path(__file__).resolve().parents[2] / "docs" / "reference" / "api.md"
_ROW = re.compile(r"^\| `(tieredkv[\w.]*)`(?: \(extra `\w+`\))? \| (.+) \|$", re.MULTILINE)


def _table() -> dict[str, list[str]]:
    found = _ROW.findall(API.read_text())
    rows = {module: re.findall(r"`(\w+)`", names) for module, names in found}
    assert len(rows) > 10, "the import table of api.md was not found"
    return rows


TABLE = _table()


@pytest.mark.parametrize("module", sorted(TABLE))
def test_every_listed_name_imports_from_where_api_md_says(module: str) -> None:
    if module.startswith("tieredkv.integrations."):
        pytest.importorskip("transformers")
    if module == "tieredkv.integrations.vllm":
        pytest.importorskip("vllm")  # the connector's names import it
    if module == "tieredkv.metrics":
        pytest.importorskip("prometheus_client")
    imported = importlib.import_module(module)
    missing = [name for name in TABLE[module] if not hasattr(imported, name)]
    assert missing == [], f"api.md lists {missing} under {module}, which has no such names"


def test_the_tieredkv_row_is_exactly_what_tieredkv_exports() -> None:
    listed = TABLE["tieredkv"]
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(tieredkv.__all__)
    for name in listed:  # the lazy exports resolve, and are the objects of their modules
        assert getattr(tieredkv, name) is not None
    assert tieredkv.ServingEngine is importlib.import_module("tieredkv.serve").ServingEngine
    assert tieredkv.Scheduler is importlib.import_module("tieredkv.policies").Scheduler
