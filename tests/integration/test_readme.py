"""The README's example runs as a reader would run it (by the docs test's own runner), and CI
runs the README's test command as a user's clone would."""

from __future__ import annotations

import re
from pathlib import Path

from tests.integration import test_docs

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def test_readme_example_runs(tmp_path: Path) -> None:
    assert "```python" in README.read_text()
    test_docs.test_page_code_runs(README, tmp_path)


def readme_test_command() -> str:
    """The README's command that installs and runs the tests (an indented command line)."""
    (command,) = [
        line.strip()
        for line in README.read_text().splitlines()
        if line.startswith("    python3 -m venv") and ".venv/bin/pytest" in line
    ]
    return command


def test_ci_runs_the_readmes_test_command_in_a_clone_named_tieredkv() -> None:
    """``git clone`` names the folder ``tieredkv``: CI clones into such a folder and runs the
    README's test command there, word for word."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_test_command() in ci.splitlines()
    clone = re.search(r'^git clone -q "\$checkout" "(\S+)"$', ci, re.M)
    assert clone is not None, "CI clones the checkout"
    assert clone.group(1).endswith("/tieredkv")
    cd = ci.index(f'cd "{clone.group(1)}"')
    assert cd < ci.index(readme_test_command()), "the tests run in the clone"
