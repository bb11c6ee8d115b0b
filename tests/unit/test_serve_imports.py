"""The serving loop depends on the adapter interface, not on a model library; the
transformers adapter loads transformers only when it is used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).resolve().parents[1] / "integration" / "engine_without_transformers.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, check=False, timeout=120
    )


def test_the_serving_loop_serves_another_librarys_adapter_with_no_transformers(
    tmp_path: Path,
) -> None:
    """Cached and no-cache (``recompute``) runs through an adapter that is not the
    transformers one, with transformers blocked: the same answers, histories restored."""
    result = _run(str(CHILD), str(tmp_path))
    assert result.returncode == 0, result.stderr
    ok, restored = result.stdout.split()
    assert ok == "ok"
    assert int(restored) > 0


def test_the_transformers_adapter_imports_without_transformers_and_says_what_to_install() -> None:
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None  # not installed\n"
        "from tieredkv.integrations.transformers import TransformersAdapter\n"
        "from tieredkv.integrations.transformers import TransformersMissingError\n"
        "try:\n"
        "    TransformersAdapter(object())\n"
        "except TransformersMissingError as exc:\n"
        "    print(exc)\n"
    )
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr
    assert "pip install -e '.[transformers]'" in result.stdout
