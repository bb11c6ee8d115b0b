"""Check an SSD tier's directory offline: ``tieredkv fsck DIR`` and ``tieredkv inspect DIR``
(``tieredkv fsck redis://... --prefix P`` checks a Redis tier: :mod:`tieredkv.fsck_redis`).

:func:`check_directory` reads every segment file of a :class:`~tieredkv.backends.SSDTier`
directory and verifies it as the tier would before serving it: the header's CRC, its
contents against the file's length, the file's name against the key in the header, the
body's xxh3 hash and, given the tier's secret, both MACs and that each session's files
share one incarnation. It opens nothing for writing, creates nothing and follows no
symbolic link (a linked subdirectory or file is reported as damaged, never read through),
so it can run on a directory a tier has open, or on a copy.

With ``repair=True`` it takes the tier's lock (so no tier may have the directory open) and
opens the directory as an :class:`~tieredkv.backends.SSDTier` would, reading every segment
back: the tier's own checks move what is damaged to ``quarantine/`` (never deleting it).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import (
    CorruptSegmentError,
    InvalidArgumentError,
    InvalidTypeError,
    TieredKVError,
    TierIOError,
)
from .payload import (
    SegmentHeader,
    check_body_mac,
    derive_key,
    header_schema,
    verify_segment,
)

__all__ = [
    "Damaged",
    "FsckReport",
    "NotATierDirectoryError",
    "SessionSummary",
    "check_directory",
    "repair_directory",
    "run_command",
]

_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SUBDIRS = ("segments", "tmp", "quarantine")


class NotATierDirectoryError(TieredKVError, ValueError):
    """The path is not an SSD tier's directory (missing, not a directory, no segments/)."""


@dataclass(frozen=True)
class Damaged:
    """A file (or link) that a tier would not serve, and why.

    :param path: relative to the tier's directory
    :param problem: what is wrong with it
    """

    path: str
    problem: str


@dataclass
class SessionSummary:
    """What one session has in the directory.

    :param session: the session key
    :param turns: segments 0, 1, ... present without a gap (what a cache recovers)
    :param tokens: tokens in those turns
    :param bytes: bytes of all of the session's good files
    :param stray: good files after a gap or with another schema (a cache removes them)
    """

    session: str
    turns: int = 0
    tokens: int = 0
    bytes: int = 0
    stray: int = 0


@dataclass
class FsckReport:
    """The result of :func:`check_directory`.

    :param directory: the directory checked
    :param segments: good segment files
    :param bytes: their total size
    :param sessions: per session key, in key order
    :param damaged: files a tier would quarantine, in path order
    :param leftovers: files in ``tmp/`` (interrupted writes; a tier deletes them at open)
    :param quarantined: files already in ``quarantine/``
    """

    directory: Path
    segments: int = 0
    bytes: int = 0
    sessions: list[SessionSummary] = field(default_factory=list)
    damaged: list[Damaged] = field(default_factory=list)
    leftovers: int = 0
    quarantined: int = 0

    @property
    def clean(self) -> bool:
        """Whether every file verified (leftovers and strays do not count as damage)."""
        return not self.damaged


def check_directory(
    directory: str | os.PathLike[str], *, secret: bytes | None = None
) -> FsckReport:
    """Verify every segment file under an SSD tier's ``directory``, read-only.

    :param secret: the tier's secret, to check MACs and incarnations as well
    :raises NotATierDirectoryError: if ``directory`` is not an SSD tier's directory
    :raises ~tieredkv.errors.InvalidArgumentError: for a secret shorter than 16 bytes
    """
    key = None if secret is None else derive_key(secret)
    report = FsckReport(Path(directory))
    try:
        root = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise NotATierDirectoryError(
            f"{str(directory)!r} cannot be opened as a directory ({exc.strerror}); pass an SSD "
            f"tier's directory"
        ) from exc
    try:
        with _subdirs(root, report) as dirs:
            if "segments" not in dirs:
                if not any(d.path == "segments" for d in report.damaged):
                    raise NotATierDirectoryError(
                        f"{str(directory)!r} has no segments/ directory: it is not an SSD "
                        f"tier's directory"
                    )
                return report
            headers = _check_segments(dirs["segments"], key, report)
            if "tmp" in dirs:
                report.leftovers = len(os.listdir(dirs["tmp"]))
            if "quarantine" in dirs:
                report.quarantined = len(os.listdir(dirs["quarantine"]))
    finally:
        os.close(root)
    _summarize(headers, key is not None, report)
    return report


@contextlib.contextmanager
def _subdirs(root: int, report: FsckReport) -> Iterator[dict[str, int]]:
    """Descriptors of the tier's subdirectories that exist and are not links."""
    dirs: dict[str, int] = {}
    try:
        for sub in _SUBDIRS:
            try:
                dirs[sub] = os.open(sub, _O_DIR, dir_fd=root)
            except FileNotFoundError:
                continue
            except OSError as exc:
                report.damaged.append(Damaged(sub, _not_a_directory(exc)))
        yield dirs
    finally:
        for fd in dirs.values():
            os.close(fd)


def _not_a_directory(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a symbolic link or not a directory (a tier never follows one)"
    return f"cannot be opened ({exc.strerror})"


def _check_segments(segments: int, key: bytes | None, report: FsckReport) -> list[SegmentHeader]:
    headers: list[SegmentHeader] = []
    for xx in sorted(os.listdir(segments)):
        try:
            sub = os.open(xx, _O_DIR, dir_fd=segments)
        except OSError as exc:
            report.damaged.append(Damaged(f"segments/{xx}", _not_a_directory(exc)))
            continue
        try:
            for name in sorted(os.listdir(sub)):
                if not name.endswith(".seg"):
                    continue
                rel = f"{xx}/{name}"
                try:
                    header = _verify_file(sub, name, rel, key)
                except CorruptSegmentError as exc:
                    report.damaged.append(Damaged(f"segments/{rel}", exc.detail))
                    continue
                headers.append(header)
        finally:
            os.close(sub)
    return headers


def _verify_file(sub: int, name: str, rel: str, key: bytes | None) -> SegmentHeader:
    """Read one whole file and verify it as a tier does before serving it."""
    from .backends.ssd import read_header_at

    header, size, _ = read_header_at(sub, name, rel, key)  # CRC, contents, name, MAC
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sub)
        try:
            data = bytearray(size)
            view = memoryview(data)
            got = 0
            while got < size:
                n = os.preadv(fd, [view[got:]], got)
                if n == 0:
                    break
                got += n
            view.release()
        finally:
            os.close(fd)
    except OSError as exc:
        raise CorruptSegmentError(rel, f"cannot be read ({exc.strerror})") from exc
    if got < size:
        raise CorruptSegmentError(rel, f"file ends at {got} of {size} bytes (truncated)")
    if verify_segment(memoryview(data), rel) != header:  # and the body's xxh3
        raise CorruptSegmentError(rel, "the file changed while it was being checked")
    if key is not None:
        check_body_mac(memoryview(data), header, key, rel)
    return header


def _summarize(headers: list[SegmentHeader], authenticated: bool, report: FsckReport) -> None:
    from .backends.ssd import segment_file_name

    by_session: dict[str, list[SegmentHeader]] = {}
    for h in headers:
        by_session.setdefault(h.session, []).append(h)
    for session in sorted(by_session):
        group = sorted(by_session[session], key=lambda h: h.seq)
        if authenticated and len({h.incarnation for h in group}) > 1:
            report.damaged.extend(
                Damaged(
                    f"segments/{segment_file_name((h.session, h.seq))}",
                    "its session's files carry different incarnations (a rollback?)",
                )
                for h in group
            )
            continue
        summary = SessionSummary(session)
        schema = header_schema(group[0])
        for h in group:
            summary.bytes += h.length
            report.segments += 1
            report.bytes += h.length
            if h.seq == summary.turns and header_schema(h) == schema:
                summary.turns += 1
                summary.tokens += h.tokens
            else:
                summary.stray += 1
        report.sessions.append(summary)
    report.damaged.sort(key=lambda d: d.path)


def repair_directory(
    directory: str | os.PathLike[str], *, secret: bytes | None = None
) -> FsckReport:
    """Quarantine every damaged file, as a tier opening the directory and reading every
    segment back would; return the check made afterwards.

    :raises ~tieredkv.errors.TierIOError: if a tier has the directory open, or a
        subdirectory is a symbolic link (remove it by hand: a repair never follows one)
    """
    import anyio

    from .backends.ssd import SSDTier
    from .payload import MAX_COUNT

    async def reread() -> None:
        async with SSDTier(directory, MAX_COUNT, secret=secret, name="fsck") as tier:
            stored = list(tier.keys())
            for key in stored:
                buf = bytearray(tier.length(key))
                # a damaged one is quarantined by the read; an unreadable one stays (and is
                # reported by the check that follows)
                with contextlib.suppress(CorruptSegmentError, TierIOError):
                    await tier.read_into(key, memoryview(buf))

    anyio.run(reread)
    return check_directory(directory, secret=secret)


# -- the command line ----------------------------------------------------------------------


def add_commands(sub: argparse._SubParsersAction[Any]) -> None:
    """Add ``fsck`` and ``inspect`` to the ``tieredkv`` command's subparsers."""
    fsck = sub.add_parser(
        "fsck",
        help="verify an SSD tier's directory or a Redis tier's prefix offline (read-only "
        "unless --repair)",
        description="Verify every segment file of an SSD tier's directory, or every "
        "conversation a Redis tier keeps under --prefix: exit status 0 if it is clean, 1 if "
        "not, 2 for bad arguments.",
    )
    fsck.add_argument(
        "directory", help="the SSD tier's directory, or a Redis tier's server URL (with --prefix)"
    )
    fsck.add_argument("--prefix", help="with a redis:// URL: the Redis tier's key prefix")
    fsck.add_argument(
        "--repair",
        action="store_true",
        help="move damaged files to quarantine/ (no tier may have the directory open); "
        "the exit status then says whether the directory is clean afterwards",
    )
    inspect = sub.add_parser(
        "inspect", help="list the sessions an SSD tier's directory holds (read-only)"
    )
    inspect.add_argument("directory", help="the SSD tier's directory")
    for p in (fsck, inspect):
        p.add_argument(
            "--secret-file",
            help="a file whose bytes are the tier's secret (checks MACs and incarnations)",
        )


def run_command(args: argparse.Namespace) -> int:
    """Run ``tieredkv fsck`` or ``tieredkv inspect``; returns the exit status."""
    if args.command == "fsck" and args.directory.startswith(("redis://", "rediss://", "unix://")):
        from .fsck_redis import run_redis_command

        return run_redis_command(args)
    where = f"tieredkv {args.command}"
    try:
        secret = None
        if args.secret_file is not None:
            try:
                secret = Path(args.secret_file).read_bytes()
            except OSError as exc:
                raise NotATierDirectoryError(
                    f"cannot read the secret file {args.secret_file!r} ({exc.strerror})"
                ) from exc
        report = check_directory(args.directory, secret=secret)
    except (NotATierDirectoryError, InvalidArgumentError, InvalidTypeError) as exc:
        print(f"{where}: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "inspect":
        _print_sessions(report)
        return 0
    _print_report(report)
    if args.repair and not report.clean:
        try:
            after = repair_directory(args.directory, secret=secret)
        except TierIOError as exc:
            print(f"{where}: repair failed: {exc}", file=sys.stderr)
            return 1
        moved = after.quarantined - report.quarantined
        print(f"repair: moved {moved} file(s) to quarantine/")
        report = after
        _print_report(report)
    return 0 if report.clean else 1


def _print_report(report: FsckReport) -> None:
    print(
        f"{report.directory}: {report.segments} good segment(s) in {len(report.sessions)} "
        f"session(s), {report.bytes:,} bytes; {len(report.damaged)} damaged; "
        f"{report.leftovers} leftover(s) in tmp/; {report.quarantined} in quarantine/"
    )
    for d in report.damaged:
        print(f"  damaged: {d.path}: {d.problem}")
    stray = sum(s.stray for s in report.sessions)
    if stray:
        print(f"  {stray} good segment(s) after a gap or with another schema (not recovered)")
    print("clean" if report.clean else "NOT clean")


def _print_sessions(report: FsckReport) -> None:
    print("| session | turns | tokens | bytes | stray |")
    print("|---|---|---|---|---|")
    for s in report.sessions:
        shown = s.session if len(s.session) <= 60 else s.session[:57] + "..."
        print(f"| {shown!r} | {s.turns} | {s.tokens:,} | {s.bytes:,} | {s.stray} |")
    print(
        f"{len(report.sessions)} session(s), {report.segments} segment(s), {report.bytes:,} "
        f"bytes; {len(report.damaged)} damaged file(s) (run tieredkv fsck)"
    )
