"""Every Python code block in docs/tutorials and docs/how-to runs as a reader pastes it:
each block on its own (a block must be complete Python by itself: a reader pastes one at
a time), in the page's order, in one interpreter; and each page's install line names the
extras its code imports."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.redis_server import require_redis_server
from tests.vllm_support import require_vllm

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted([*DOCS.glob("tutorials/*.md"), *DOCS.glob("how-to/*.md")])
# a fence may be indented (inside a list item): a reader pastes what is between the fences
_BLOCK = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```", re.DOTALL | re.MULTILINE)
_JOINED: set[str] = set()
"""Pages run as one script of all their blocks joined (none: every block of every page runs
as pasted, one at a time)."""

# Each block runs on its own, in order, in one namespace, as pasted into a file run block
# by block or into a notebook; a traceback names the block.
_RUNNER = """\
import json, sys
if __name__ == "__main__":  # an engine that spawns processes re-imports this file
    blocks = json.load(open(sys.argv[1], encoding="utf-8"))
    namespace = {"__name__": "__main__"}
    for i, block in enumerate(blocks, 1):
        exec(compile(block, f"<block {i} of {len(blocks)}>", "exec"), namespace)
"""

# what a page's code imports -> the extra its install line must name
_EXTRAS = {
    "metrics": re.compile(r"^\s*(from|import) (tieredkv\.metrics|prometheus_client)\b", re.M),
    "redis": re.compile(r"^\s*(from|import) redis\b|\bRedisTier\b", re.M),
    "transformers": re.compile(r"^\s*(from|import) transformers\b", re.M),
    "plots": re.compile(r"^\s*(from|import) matplotlib\b", re.M),
    "vllm": re.compile(r"^\s*(from|import) vllm\b", re.M),
}


def blocks_of(page: Path) -> list[str]:
    """The page's Python blocks, as a reader copies them (the fence's indentation gone,
    nothing else changed)."""
    out = []
    for indent, body in _BLOCK.findall(page.read_text()):
        lines = body.splitlines(keepends=True)
        out.append("".join(line.removeprefix(indent) for line in lines))
    return out


def test_there_are_pages_with_code() -> None:
    assert any(blocks_of(p) for p in PAGES)


def test_a_block_that_is_not_python_by_itself_is_found(tmp_path: Path) -> None:
    """The runner refuses a block that only works glued to the one before (it would not
    run as pasted), and says which block it is."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nasync def main() -> None:\n    x = 1\n```\n\ntext\n\n"
        "```python\n    print(x)\n```\n"
    )
    result = _run(blocks_of(page), tmp_path)
    assert result.returncode != 0
    assert '"<block 2 of 2>", line 1' in result.stderr
    assert "IndentationError" in result.stderr


def _engine(page: Path) -> bool:
    """Whether the page starts a vLLM engine (tens of seconds: those run with ``-m slow``)."""
    return "from vllm import" in page.read_text()


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.slow) if _engine(p) else p for p in PAGES],
    ids=[p.name for p in PAGES],
)
def test_page_code_runs(page: Path, tmp_path: Path) -> None:
    blocks = blocks_of(page)
    if not blocks:
        pytest.skip("no python code on this page")
    if "redis-server" in page.read_text():
        require_redis_server()  # the page starts one (skipped locally without it, not in CI)
    # a page that starts a vLLM engine: vLLM and torch warn about their own deprecations
    # while it starts (not turned into errors here), and the start takes tens of seconds
    engine = _engine(page)
    if engine:
        require_vllm()
    if page.name in _JOINED:
        blocks = ["\n\n".join(blocks)]
    result = _run(blocks, tmp_path, engine=engine)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_the_install_line_names_the_extras_the_code_needs(page: Path) -> None:
    code = "\n".join(blocks_of(page))
    installs = " ".join(re.findall(r"pip install[^\n]*", page.read_text()))
    for extra, imports in _EXTRAS.items():
        if imports.search(code):
            named = re.search(
                rf"tieredkv\[[^\]]*\b{extra}\b[^\]]*\]|\.\[[^\]]*\b{extra}\b", installs
            )
            assert named, (
                f"{page.name}: its code needs tieredkv[{extra}]; say so in a pip install line"
            )


_INDEX_INSTALL = re.compile(r"pip install\b[^\n]*?(?<![\w./-])['\"]?tieredkv\b(?![\w/-])")
"""``pip install tieredkv`` / ``'tieredkv[extra]'``: a package index has no tieredkv."""


def test_no_page_installs_tieredkv_from_a_package_index() -> None:
    """tieredkv is installed from a checkout (``pip install -e '.[extra]'``) or from the
    wheel it builds (docs/how-to/install.md), never by name from an index."""
    pages = [
        DOCS.parent / "README.md",
        *sorted(DOCS.rglob("*.md")),
        *sorted((DOCS.parent / "src").rglob("*.py")),  # messages and docstrings
    ]
    found = [
        f"{page.relative_to(DOCS.parent)}: {m.group(0)}"
        for page in pages
        for m in _INDEX_INSTALL.finditer(page.read_text())
    ]
    assert found == []


def test_the_index_install_pattern_finds_what_fails_and_passes_what_works() -> None:
    for fails in (
        "pip install 'tieredkv[plots]'",
        "pip install tieredkv[redis]",
        "pip install tieredkv",
        'pip install -q "tieredkv[vllm,transformers]"',
    ):
        assert _INDEX_INSTALL.search(fails), fails
    for works in (
        "pip install -e '.[plots]'",
        "pip install 'dist/tieredkv-0.1.0-py3-none-any.whl[plots]'",
        "pip install -e .",
        "pip install build twine",
    ):
        assert not _INDEX_INSTALL.search(works), works


_FILE_BLOCK = re.compile(r"^```python (\S+)\n(.*?)^```", re.DOTALL | re.MULTILINE)
"""A block that is a file (its path after the language): the page says to save it there."""


def test_the_tier_contract_kit_runs_on_a_tier_in_a_folder_of_its_own(tmp_path: Path) -> None:
    """write-a-tier's separate folder, as a reader makes it from the page: its tier passes
    the contract kit (tieredkv.testing) when the page's command runs its tests."""
    page = DOCS / "how-to" / "write-a-tier.md"
    text = page.read_text()
    files = dict(_FILE_BLOCK.findall(text))
    assert sorted(files) == ["my-tier/my_tier.py", "my-tier/test_my_tier.py"]
    for name, body in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(body)
    assert "\n    python -m pytest my-tier -q\n" in text
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "my-tier", "-q", "-p", "no:cacheprovider", "-s"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    from tieredkv.testing import CHECKS

    assert f"{len(CHECKS)} checks passed" in result.stdout
    assert "1 passed" in result.stdout


def test_the_readme_and_reproduce_the_paper_give_the_same_timings() -> None:
    """The README gives one timing of its main command and links to the how-to, which
    gives that same figure, of that same day, among its timings."""
    readme = " ".join((DOCS.parent / "README.md").read_text().split())
    howto = " ".join((DOCS / "how-to" / "reproduce-the-paper.md").read_text().split())
    found = re.search(r"the whole command took ([0-9:]+) on 2 idle cores \(([^)]+)\)", readme)
    assert found is not None, "the README times its main command"
    took, day = found.groups()
    assert "(docs/how-to/reproduce-the-paper.md)" in readme
    assert f"On {day}," in howto
    assert f"from a fresh clone into `tieredkv/` took {took} " in howto


def test_the_api_reference_gives_each_cache_method_its_parts() -> None:
    """docs/reference/api.md, as a reference: each entry of the cache and the tiers gives
    the signature, then its parameters or returns, what it raises, and an example."""
    text = (DOCS / "reference" / "api.md").read_text()
    section = text[text.index("## The cache\n") : text.index("## The metadata channel")]
    tiers = text[text.index("## Tiers\n") : text.index("## Serving loop")]
    entries = re.split(r"^### ", section + tiers, flags=re.M)[1:]
    names = [e.split("\n", 1)[0] for e in entries]
    for method in ("append", "load", "load_into", "prefetch", "drop", "stats", "aclose"):
        assert f"`{method}`" in names
    for tier in ("HostMemoryTier", "SSDTier", "MmapTier", "register_tier"):
        assert f"`{tier}`" in names
    for entry in entries:
        if entry.startswith("Other methods"):
            continue
        assert "**Raises**" in entry, entry[:40]
        assert "**Example**" in entry, entry[:40]
        assert "**Parameters**" in entry or "**Returns**" in entry, entry[:40]


_ISSUE = re.compile(r"\bissues? #?\d+|\(#\d+\)", re.IGNORECASE)


def test_user_docs_cite_no_issue_numbers() -> None:
    """The docs say what the code does; a reader has no issue tracker to look things up in."""
    pages = [
        DOCS.parent / "README.md",
        *sorted(DOCS.rglob("*.md")),
        *sorted((DOCS.parent / "src").rglob("*.py")),  # messages and docstrings
    ]
    found = [
        f"{page.relative_to(DOCS.parent)}: {m.group(0)}"
        for page in pages
        for m in _ISSUE.finditer(page.read_text())
    ]
    assert found == []


def _run(
    blocks: list[str], tmp_path: Path, *, engine: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``blocks`` in a fresh interpreter, a page's run as a reader runs it: its own
    process and event loop, warnings as errors (but for a page that starts a vLLM engine)."""
    (tmp_path / "blocks.json").write_text(json.dumps(blocks), encoding="utf-8")
    (tmp_path / "runner.py").write_text(_RUNNER, encoding="utf-8")
    return subprocess.run(
        [
            sys.executable,
            *([] if engine else ["-W", "error"]),
            str(tmp_path / "runner.py"),
            str(tmp_path / "blocks.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600 if engine else 120,
        check=False,
        cwd=tmp_path,
    )
