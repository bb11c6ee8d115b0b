"""Every Python code block in docs/tutorials and docs/how-to runs, in order, per page."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.redis_server import require_redis_server
from tests.vllm_support import require_vllm

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted([*DOCS.glob("tutorials/*.md"), *DOCS.glob("how-to/*.md")])
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def test_there_are_pages_with_code() -> None:
    assert any(_BLOCK.search(p.read_text()) for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_code_runs(page: Path, tmp_path: Path) -> None:
    blocks = _BLOCK.findall(page.read_text())
    if not blocks:
        pytest.skip("no python code on this page")
    if "redis-server" in page.read_text():
        require_redis_server()  # the page starts one (skipped locally without it, not in CI)
    # a page that starts a vLLM engine: vLLM and torch warn about their own deprecations
    # while it starts (not turned into errors here), and the start takes tens of seconds
    engine = "from vllm import" in page.read_text()
    if engine:
        require_vllm()
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(blocks))
    # a subprocess: a page runs as a reader would run it, with its own event loop
    result = subprocess.run(
        [sys.executable, *([] if engine else ["-W", "error"]), str(script)],
        capture_output=True,
        text=True,
        timeout=600 if engine else 120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
