"""The README's example runs as a reader would run it (by the docs test's own runner)."""

from __future__ import annotations

from pathlib import Path

from tests.integration import test_docs

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_example_runs(tmp_path: Path) -> None:
    assert "```python" in README.read_text()
    test_docs.test_page_code_runs(README, tmp_path)
