"""``tieredkv fsck`` and ``tieredkv inspect`` on real, damaged SSD tier directories."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest

from tests.faults import FaultInjector
from tests.segments import Segment, SegmentFactory, forge, store
from tieredkv.backends import SSDTier
from tieredkv.backends.ssd import segment_file_name
from tieredkv.cli import main
from tieredkv.fsck import Damaged, FsckReport, NotATierDirectoryError, check_directory

CAPACITY = 64 << 20
SECRET = bytes(range(100, 132))
WRITING_SITES = ("pwrite", "replace", "rename", "unlink", "mkdir", "ftruncate", "fsync", "rmdir")


async def run(argv: list[str]) -> int:
    """``tieredkv ARGV`` in a worker thread (it does blocking I/O, and --repair runs its
    own event loop)."""
    return await anyio.to_thread.run_sync(main, argv)


async def check(root: Path, secret: bytes | None = None) -> FsckReport:
    return await anyio.to_thread.run_sync(lambda: check_directory(root, secret=secret))


def rel(s: Segment) -> str:
    return "segments/" + segment_file_name(s.key)


def snapshot(root: Path) -> dict[str, tuple[bool, bytes, int]]:
    """Every entry under ``root``: whether a link, its bytes (files), its mtime."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        data = p.read_bytes() if p.is_file() and not p.is_symlink() else b""
        out[str(p.relative_to(root))] = (p.is_symlink(), data, st.st_mtime_ns)
    return out


@pytest.fixture
async def damaged(tmp_path: Path, seg: SegmentFactory) -> tuple[Path, dict[str, Segment]]:
    """A tier directory with sessions a (3 turns), b (2), c (1) and d (1), then damaged:
    a/2's header lies (valid CRC), b/1 has a flipped body byte, c/0 is truncated, d's
    segments/xx is replaced by a link to a directory outside holding d/0; plus a leftover
    in tmp/."""
    root, outside = tmp_path / "ssd", tmp_path / "outside"
    outside.mkdir()
    segs = {
        f"{n}{i}": seg(session=n, seq=i, tokens=20 + 10 * i, seed=ord(n) + i)
        for n, turns in (("a", 3), ("b", 2), ("c", 1), ("d", 1))
        for i in range(turns)
    }
    async with SSDTier(root, CAPACITY) as tier:
        for s in segs.values():
            await store(tier, s)
    a2 = root / rel(segs["a2"])
    a2.write_bytes(forge(a2.read_bytes(), token_dim=5))
    b1 = root / rel(segs["b1"])
    raw = bytearray(b1.read_bytes())
    raw[-100] ^= 0x10
    b1.write_bytes(bytes(raw))
    c0 = root / rel(segs["c0"])
    c0.write_bytes(c0.read_bytes()[:4096])  # of 8192
    d0 = root / rel(segs["d0"])
    (outside / d0.name).write_bytes(d0.read_bytes())
    xx = d0.parent
    for p in xx.iterdir():
        (outside / p.name).write_bytes(p.read_bytes())
        p.unlink()
    xx.rmdir()
    xx.symlink_to(outside)
    (root / "tmp" / "interrupted.tmp").write_bytes(b"x" * 100)
    return root, segs


def link_of(segs: dict[str, Segment]) -> str:
    """The segments/xx that the fixture replaced by a link."""
    return rel(segs["d0"]).rsplit("/", 1)[0]


def expected_damage(root: Path, segs: dict[str, Segment]) -> list[str]:
    return sorted([rel(segs["a2"]), rel(segs["b1"]), rel(segs["c0"]), link_of(segs)])


async def test_check_finds_every_damaged_file_read_only(
    damaged: tuple[Path, dict[str, Segment]],
) -> None:
    """The check lists each damaged file with its problem, sums the good ones per session,
    and changes nothing: no write-type os call is made (each would fail) and every file,
    link and mtime is as before."""
    root, segs = damaged
    before = snapshot(root)
    with FaultInjector() as faults:
        for site in WRITING_SITES:
            faults.fail_always(site)
        report = await check(root)
        assert all(faults.calls[site] == 0 for site in WRITING_SITES)
    assert snapshot(root) == before
    assert [d.path for d in report.damaged] == expected_damage(root, segs)
    problems = {d.path: d.problem for d in report.damaged}
    assert "token_dim" in problems[rel(segs["a2"])] or "rank" in problems[rel(segs["a2"])]
    assert problems[rel(segs["b1"])] == "body checksum mismatch"
    assert "bytes" in problems[rel(segs["c0"])]
    assert "symbolic link" in problems[link_of(segs)]
    assert not report.clean
    summary = {s.session: (s.turns, s.tokens, s.bytes, s.stray) for s in report.sessions}
    assert summary == {
        "a": (2, 20 + 30, segs["a0"].length + segs["a1"].length, 0),
        "b": (1, 20, segs["b0"].length, 0),
    }
    assert report.segments == 3
    assert report.leftovers == 1
    assert report.quarantined == 0


async def test_cli_fsck_inspect_and_repair(
    damaged: tuple[Path, dict[str, Segment]], capsys: pytest.CaptureFixture[str]
) -> None:
    """fsck exits 1 and names each damaged file; inspect prints the sessions table and
    exits 0; fsck --repair moves the damage (the link, not its target) to quarantine/ and
    exits 0; a tier then opens the directory with exactly the good segments."""
    root, segs = damaged
    assert await run(["fsck", str(root)]) == 1
    out = capsys.readouterr().out
    for path in expected_damage(root, segs):
        assert f"damaged: {path}:" in out
    assert out.rstrip().endswith("NOT clean")
    assert await run(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "| 'a' | 2 | 50 |" in out
    assert "| 'b' | 1 | 20 |" in out
    assert "4 damaged file(s)" in out
    assert await run(["fsck", "--repair", str(root)]) == 0
    out = capsys.readouterr().out
    assert (
        "repair: moved 4 file(s) to quarantine/ (nothing stored was deleted; 1 unfinished "
        "write(s) in tmp/, never acknowledged, removed)" in out
    )
    assert list((root / "tmp").iterdir()) == []
    assert out.rstrip().endswith("clean")
    assert sorted(p.is_symlink() for p in (root / "quarantine").iterdir()) == [
        False,
        False,
        False,
        True,
    ]
    assert (root.parent / "outside" / Path(rel(segs["d0"])).name).exists()
    assert await run(["fsck", str(root)]) == 0
    async with SSDTier(root, CAPACITY) as tier:
        assert sorted(tier.keys()) == sorted(segs[k].key for k in ("a0", "a1", "b0"))


async def test_repair_refuses_a_directory_in_use(
    damaged: tuple[Path, dict[str, Segment]], capsys: pytest.CaptureFixture[str]
) -> None:
    """While a tier has the directory open, fsck still checks it (read-only) but --repair
    fails (exit 1), moves nothing, and says the fix: close the cache, then repair (issue
    26: it advised giving each process its own directory, which fixes nothing here)."""
    root, _ = damaged
    async with SSDTier(root, CAPACITY):
        before = sorted(os.listdir(root / "quarantine"))
        assert await run(["fsck", "--repair", str(root)]) == 1
        err = capsys.readouterr().err
        assert err == (
            f"tieredkv fsck: repair failed: cannot repair {str(root)!r} while a cache has it "
            f"open: close the cache (or stop the process that has it open), then run "
            f"`tieredkv fsck --repair` again; `tieredkv fsck` without --repair checks it "
            f"read-only while it is open\n"
        )
        assert "own directory" not in err
        assert sorted(os.listdir(root / "quarantine")) == before
    assert await run(["fsck", "--repair", str(root)]) == 0  # closed: the repair runs


async def test_fsck_with_the_secret(tmp_path: Path, seg: SegmentFactory) -> None:
    """Given the secret, fsck checks MACs and incarnations: clean with the right secret,
    every file damaged with another, and a rolled-back segment refuses its session."""
    root = tmp_path / "ssd"
    old, new = seg(session="s", seq=1, seed=1), seg(session="s", seq=1, seed=2)
    first = seg(session="s", seq=0, seed=3)
    async with SSDTier(root, CAPACITY, secret=SECRET) as tier:
        for s in (first, old):
            await store(tier, s)
        saved = (root / rel(old)).read_bytes()
        for s in (first, old):
            await tier.delete(s.key)
        for s in (first, new):
            await store(tier, s)
    good = tmp_path / "good.key"
    good.write_bytes(SECRET)
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(b"w" * 32)
    assert await run(["fsck", str(root), "--secret-file", str(good)]) == 0
    assert await run(["fsck", str(root), "--secret-file", str(wrong)]) == 1
    assert await run(["fsck", str(root)]) == 0  # without the secret: CRCs and hashes only
    (root / rel(new)).write_bytes(saved)
    assert await run(["fsck", str(root)]) == 0  # the rollback is invisible to checksums
    report = await check(root, SECRET)
    assert report.damaged == [
        Damaged(rel(s), "its session's files carry different incarnations (a rollback?)")
        for s in sorted((first, new), key=rel)
    ]


@pytest.mark.parametrize("case", ["missing", "a-file", "no-segments", "short-secret", "no-secret"])
def test_bad_arguments_exit_2(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A path that is not a tier's directory, or an unusable secret file: exit status 2
    and a one-line error, no traceback."""
    (tmp_path / "ssd" / "segments").mkdir(parents=True)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "short.key").write_bytes(b"short")
    argv = {
        "missing": [str(tmp_path / "nowhere")],
        "a-file": [str(tmp_path / "afile")],
        "no-segments": [str(tmp_path)],
        "short-secret": [str(tmp_path / "ssd"), "--secret-file", str(tmp_path / "short.key")],
        "no-secret": [str(tmp_path / "ssd"), "--secret-file", str(tmp_path / "none.key")],
    }[case]
    for command in ("fsck", "inspect"):
        assert main([command, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tieredkv {command}: error: ")
        assert len(err.strip().splitlines()) == 1
    with pytest.raises(NotATierDirectoryError):
        check_directory(tmp_path) if case == "no-segments" else check_directory(
            tmp_path / "nowhere"
        )


@pytest.fixture
async def gapped(tmp_path: Path, seg: SegmentFactory) -> tuple[Path, dict[str, Segment]]:
    """Session a with 3 turns whose turn 1 has a damaged header (a CRC that fails), session
    b with 3 turns whose turn 1 was deleted (a gap), session c whole."""
    root = tmp_path / "ssd"
    segs = {f"{n}{i}": seg(session=n, seq=i, seed=ord(n) + i) for n in "abc" for i in range(3)}
    async with SSDTier(root, CAPACITY) as tier:
        for s in segs.values():
            await store(tier, s)
    a1 = root / rel(segs["a1"])
    raw = bytearray(a1.read_bytes())
    raw[40] ^= 0xFF
    a1.write_bytes(bytes(raw))
    (root / rel(segs["b1"])).unlink()
    return root, segs


async def test_fsck_is_not_clean_while_it_lists_unrecovered_segments(
    gapped: tuple[Path, dict[str, Segment]], capsys: pytest.CaptureFixture[str]
) -> None:
    """Good segments after a gap are not recoverable: the check counts them, names each
    truncated session with what it keeps of what was stored, and says NOT clean, exit 1
    (issue 22 case 14: before, it listed them and said "clean")."""
    root, _ = gapped
    report = await check(root)
    summary = {s.session: (s.turns, s.stray, s.damaged, s.truncated) for s in report.sessions}
    assert summary == {"a": (1, 1, 1, True), "b": (1, 1, 0, True), "c": (3, 0, 0, False)}
    assert report.stray == 2
    assert not report.clean
    assert await run(["fsck", str(root)]) == 1
    out = capsys.readouterr().out
    assert (
        "  truncated: session 'a' comes back with 1 of 3 stored turn(s) (1 damaged, 1 after "
        "a gap or of another schema: not recovered)" in out
    )
    assert (
        "  truncated: session 'b' comes back with 1 of 2 stored turn(s) (0 damaged, 1 after "
        "a gap or of another schema: not recovered)" in out
    )
    assert "'c'" not in out
    assert out.rstrip().splitlines()[-1] == "NOT clean"


async def test_repair_moves_unrecoverable_segments_aside_and_says_what_each_session_keeps(
    gapped: tuple[Path, dict[str, Segment]], capsys: pytest.CaptureFixture[str]
) -> None:
    """--repair moves the damaged file and both strays to quarantine/ (byte for byte,
    nothing deleted), says which sessions now keep fewer turns than were stored, and only
    then says clean; a tier then finds exactly the recoverable turns."""
    root, segs = gapped
    assert await run(["fsck", "--repair", str(root)]) == 0
    out = capsys.readouterr().out
    lines = out.rstrip().splitlines()
    assert "repair: moved 3 file(s) to quarantine/ (nothing stored was deleted)" in lines
    assert "repair: session 'a' now keeps 1 of 3 stored turn(s)" in lines
    assert "repair: session 'b' now keeps 1 of 2 stored turn(s)" in lines
    assert lines[-1] == "clean"
    moved = sorted(p.read_bytes() for p in (root / "quarantine").iterdir())
    damaged_a1 = (root / "quarantine").glob(Path(rel(segs["a1"])).name + ".*")
    assert moved == sorted([next(damaged_a1).read_bytes(), segs["a2"].data, segs["b2"].data])
    async with SSDTier(root, CAPACITY) as tier:
        assert sorted(tier.keys()) == sorted(segs[k].key for k in ("a0", "b0", "c0", "c1", "c2"))
    assert await run(["fsck", str(root)]) == 0


async def test_an_unreadable_file_is_reported_not_damaged_and_repair_moves_nothing(
    tmp_path: Path, seg: SegmentFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file whose reads fail with EIO every time is listed as unreadable (not damaged:
    nothing proves its bytes wrong) and the check is NOT clean; --repair fails, since the
    tier's open fails on it, and moves nothing. Once it reads again, all is clean."""
    root = tmp_path / "ssd"
    segs = [seg(session="a", seq=i, seed=i) for i in range(3)]
    async with SSDTier(root, CAPACITY) as tier:
        for s in segs:
            await store(tier, s)
    name = Path(rel(segs[0])).name
    with FaultInjector() as faults:
        faults.fail_matching("open", name, 10_000)
        report = await check(root)
        assert report.damaged == []
        assert [d.path for d in report.unreadable] == [rel(segs[0])]
        assert "Input/output error" in report.unreadable[0].problem
        assert not report.clean
        assert await run(["fsck", "--repair", str(root)]) == 1
        captured = capsys.readouterr()
        assert f"  unreadable: {rel(segs[0])}: cannot be read" in captured.out
        assert "repair failed" in captured.err
        assert "nothing was moved or deleted" in captured.err
    assert list((root / "quarantine").iterdir()) == []
    assert await run(["fsck", str(root)]) == 0


async def test_fsck_says_what_it_could_not_read_or_import(
    damaged: tuple[Path, dict[str, Segment]],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A directory whose listing fails (EIO), and a Redis URL without the redis extra:
    exit 2 with a line saying what to do, never a traceback."""
    root, _ = damaged
    for n in (1, 2):  # the tier's directory, then segments/
        with FaultInjector(modules=("tieredkv.fsck",)) as faults:
            faults.fail_nth("listdir", n)
            assert await run(["fsck", str(root)]) == 2
        err = capsys.readouterr().err
        assert f"tieredkv fsck: error: {str(root)!r} could not be read:" in err
        assert "Input/output error" in err
    monkeypatch.setitem(sys.modules, "tieredkv.fsck_redis", None)  # (import fails)
    assert await run(["fsck", "redis://127.0.0.1:1/0", "--prefix", "p"]) == 2
    err = capsys.readouterr().err
    assert "checking a Redis tier needs the redis client (the redis extra: pip install" in err
