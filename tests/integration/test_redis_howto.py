"""The Redis how-to (docs/how-to/share-kv-with-redis.md) as a reader pastes it: every
Python block is top-level code that compiles on its own, and the page, run twice in a row
against one server that keeps its data (the reader's own, through ``TIEREDKV_REDIS_URL``),
passes both times: a second run never finds the first run's history. (tests/
integration/test_docs.py runs it once, against the throwaway server it starts.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.redis_server import RedisServer, own_aof_server

__all__ = ["own_aof_server"]  # the fixture, used below

PAGE = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "share-kv-with-redis.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def test_every_block_is_top_level_code() -> None:
    blocks = _BLOCK.findall(PAGE.read_text())
    assert len(blocks) >= 4
    for i, block in enumerate(blocks):
        assert not block[:1].isspace(), f"block {i} starts indented"
        compile(block, f"block {i}", "exec")  # each pastes on its own


@pytest.mark.slow  # the page twice against its own server: CI runs it
def test_the_page_runs_twice_against_a_server_that_keeps_data(
    own_aof_server: RedisServer, tmp_path: Path
) -> None:
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(_BLOCK.findall(PAGE.read_text())))
    env = {**os.environ, "TIEREDKV_REDIS_URL": own_aof_server.url}
    for run in range(2):
        result = subprocess.run(
            [sys.executable, "-W", "error", str(script)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=env,
        )
        assert result.returncode == 0, f"run {run}: {result.stdout}{result.stderr}"
        assert "8 42" in result.stdout
        assert "refused: StaleWriterError" in result.stdout
