"""Check an SSD tier's directory offline: ``tieredkv fsck DIR`` and ``tieredkv inspect DIR``
(``tieredkv fsck redis://... --prefix P`` checks a Redis tier: :mod:`tieredkv.fsck_redis`).

:func:`check_directory` reads every segment file of a :class:`~tieredkv.backends.SSDTier`
directory and verifies it as the tier would before serving it: the header's CRC, its
contents against the file's length, the file's name against the key in the header, the
body's xxh3 hash and, given the tier's secret, both MACs and that each session's files
share one incarnation. It opens nothing for writing, creates nothing and follows no
symbolic link (a linked subdirectory or file is reported as damaged, never read through),
so it can run on a directory a tier has open, or on a copy.

A file that cannot be read (an I/O error, after retries) is reported as *unreadable*, not
damaged: nothing proves its bytes wrong, and a tier's open fails (moving nothing) until it
reads. A good segment no cache would recover (after a gap in its session's turns, or with
another schema: a cache's open deletes it) is a *stray*. The directory is *clean* only
with no damaged, unreadable or stray file; a session with a damaged or stray segment is
listed as one whose history comes back shorter than what was stored.

Forks: a fork's first stored turn names the turns it inherits, stored under other
conversations' keys. A reference to a turn the directory lacks (a *dangling* reference) is
damage: no cache recovers the fork. A conversation that left while forks still listed its
turns has a retirement marker; its turns no fork references any more are *reclaimable*
(a cache's open deletes them, and the marker with the last of them), not damage.

:func:`repair_directory` takes the tier's lock (so no tier may have the directory open),
opens the directory as an :class:`~tieredkv.backends.SSDTier` would and reads every
segment back: the tier's own checks move what is damaged to ``quarantine/``, and the
strays are moved there too (never deleted).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import os
import sys
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._retry import retry_io, tries
from .backends.ssd.layout import (
    MIXED_INCARNATIONS,
    O_DIR,
    READ_FLAGS,
    SUBDIRS,
    by_session,
    mixed_incarnations,
    name_digest,
    pread_full,
    read_header_at,
    segment_file_name,
    session_digest,
)
from .errors import (
    CorruptSegmentError,
    InvalidArgumentError,
    InvalidTypeError,
    TieredKVError,
    TierIOError,
    UnknownFormatError,
)
from .payload import (
    SegmentHeader,
    check_body_mac,
    derive_key,
    header_schema,
    is_retirement,
    segment_id,
    verify_segment,
)

__all__ = [
    "Damaged",
    "DirectoryInUseError",
    "FsckReport",
    "NotATierDirectoryError",
    "SessionSummary",
    "check_directory",
    "repair_directory",
    "run_command",
]


class NotATierDirectoryError(TieredKVError, ValueError):
    """The path is not an SSD tier's directory (missing, not a directory, no segments/)."""


class DirectoryInUseError(TieredKVError, OSError):
    """A repair was asked for a directory that a tier (a cache) has open."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        super().__init__(
            errno.EWOULDBLOCK,
            f"cannot repair {str(directory)!r} while a cache has it open: close the cache (or "
            f"stop the process that has it open), then run `tieredkv fsck --repair` again; "
            f"`tieredkv fsck` without --repair checks it read-only while it is open",
        )

    def __str__(self) -> str:
        return str(self.args[1])


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
    :param damaged: the session's files that fail verification (matched by file name)
    """

    session: str
    turns: int = 0
    tokens: int = 0
    bytes: int = 0
    stray: int = 0
    damaged: int = 0

    @property
    def truncated(self) -> bool:
        """Whether the session has stored segments past the turns a cache recovers."""
        return bool(self.stray or self.damaged)


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
    :param unreadable: files that could not be read (I/O errors, after retries): not shown
        to be damaged, and a tier's open fails until they read
    :param retired: conversations that left while forks still list some of their turns
        (kept for those forks only)
    :param reclaimable: good files no conversation needs (turns of a retired conversation
        that no fork references, or a marker with no such turn left): a cache's open
        deletes them
    :param reclaimable_bytes: their total size
    """

    directory: Path
    segments: int = 0
    bytes: int = 0
    sessions: list[SessionSummary] = field(default_factory=list)
    damaged: list[Damaged] = field(default_factory=list)
    leftovers: int = 0
    quarantined: int = 0
    unreadable: list[Damaged] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    reclaimable: int = 0
    reclaimable_bytes: int = 0

    @property
    def stray(self) -> int:
        """Good segments no cache would recover (after a gap, or of another schema)."""
        return sum(s.stray for s in self.sessions)

    @property
    def clean(self) -> bool:
        """Whether every file verified and every good segment is recoverable (leftovers in
        ``tmp/`` do not count: a tier removes them)."""
        return not (self.damaged or self.unreadable or self.stray)


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
        for sub in SUBDIRS:
            try:
                dirs[sub] = os.open(sub, O_DIR, dir_fd=root)
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
            sub = os.open(xx, O_DIR, dir_fd=segments)
        except OSError as exc:
            report.damaged.append(Damaged(f"segments/{xx}", _not_a_directory(exc)))
            continue
        try:
            for name in sorted(os.listdir(sub)):
                if not name.endswith(".seg"):
                    continue
                rel = f"{xx}/{name}"
                try:
                    header = retry_io(functools.partial(_verify_file, sub, name, rel, key))
                except FileNotFoundError:
                    continue  # removed meanwhile
                except UnknownFormatError as exc:  # not damage: --repair leaves it
                    report.unreadable.append(Damaged(f"segments/{rel}", exc.detail))
                    continue
                except CorruptSegmentError as exc:
                    report.damaged.append(Damaged(f"segments/{rel}", exc.detail))
                    continue
                except OSError as exc:
                    report.unreadable.append(
                        Damaged(f"segments/{rel}", f"cannot be read ({exc.strerror}; {tries()})")
                    )
                    continue
                headers.append(header)
        finally:
            os.close(sub)
    return headers


def _verify_file(sub: int, name: str, rel: str, key: bytes | None) -> SegmentHeader:
    """Read one whole file and verify it as a tier does before serving it
    (:class:`CorruptSegmentError` if it is wrong, :class:`OSError` if it cannot be read)."""
    header, size, _ = read_header_at(sub, name, rel, key)  # CRC, contents, name, MAC
    fd = os.open(name, READ_FLAGS, dir_fd=sub)
    try:
        data = bytearray(size)
        got = pread_full(fd, memoryview(data), 0)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    if got < size:
        raise CorruptSegmentError(rel, f"file ends at {got} of {size} bytes (truncated)")
    if verify_segment(memoryview(data), rel) != header:  # and the body's xxh3
        raise CorruptSegmentError(rel, "the file changed while it was being checked")
    if key is not None:
        check_body_mac(memoryview(data), header, key, rel)
    return header


def _summarize(headers: list[SegmentHeader], authenticated: bool, report: FsckReport) -> None:
    damaged_names = [name_digest(d.path.rsplit("/", 1)[-1]) for d in report.damaged]
    groups = by_session(headers)
    refs, dangling = _references(groups)
    for session in sorted(groups):
        group = sorted(groups[session], key=lambda h: h.seq)
        if authenticated and mixed_incarnations(group):
            report.damaged.extend(
                Damaged(f"segments/{segment_file_name((h.session, h.seq))}", MIXED_INCARNATIONS)
                for h in group
            )
            continue
        for h in group:
            report.segments += 1
            report.bytes += h.length
        if any(is_retirement(h) for h in group):
            turns = [h for h in group if not is_retirement(h)]
            needed = [h for h in turns if (h.session, h.seq) in refs]
            if needed:
                report.retired.append(session)
            spare = [h for h in turns if h not in needed] if needed else group
            report.reclaimable += len(spare)
            report.reclaimable_bytes += sum(h.length for h in spare)
            continue
        summary = SessionSummary(session)
        kept, strays = _recoverable(group, refs)
        summary.bytes = sum(h.length for h in group)
        summary.damaged = damaged_names.count(session_digest(session))
        if session in dangling:
            first = kept[0]
            report.damaged.append(
                Damaged(f"segments/{segment_file_name((session, first.seq))}", dangling[session])
            )
            summary.damaged += 1
            strays = kept[1:] + strays
            kept = []
        summary.turns = len(kept)
        summary.tokens = sum(h.tokens for h in kept)
        summary.stray = len(strays)
        report.sessions.append(summary)
    report.damaged.sort(key=lambda d: d.path)


def _references(
    groups: dict[str, list[SegmentHeader]],
    unread: AbstractSet[tuple[str, int]] = frozenset(),
) -> tuple[set[tuple[str, int]], dict[str, str]]:
    """The turns forks reference (that the directory holds), and each fork with a dangling
    reference (one to a turn the directory lacks), with what is wrong. A turn in
    ``unread`` (there, but it could not be read this time) is no dangling reference."""
    good = {(h.session, h.seq): h for group in groups.values() for h in group}
    refs: set[tuple[str, int]] = set()
    dangling: dict[str, str] = {}
    for session, group in groups.items():
        own = [h for h in group if not is_retirement(h)]
        if not own or any(is_retirement(h) for h in group):
            continue
        first = min(own, key=lambda h: h.seq)
        for i, (owner, seq, take) in enumerate(first.base):
            if (owner, seq) in unread:
                refs.add((owner, seq))
                continue
            h = good.get((owner, seq))
            if h is None or is_retirement(h) or not 0 < take <= h.tokens:
                dangling[session] = (
                    f"a dangling reference: this fork's first turn lists turn {seq} of "
                    f"{owner!r}, which the directory does not hold (no cache recovers the fork)"
                )
                break
            if first.base_ids and segment_id(h) != first.base_ids[i]:
                dangling[session] = (
                    f"a dangling reference: this fork's first turn lists turn {seq} of "
                    f"{owner!r}, and the directory holds another history's turn under that "
                    f"key (no cache recovers the fork)"
                )
                break
            refs.add((owner, seq))
    return refs, dangling


def _recoverable(
    group: list[SegmentHeader], refs: AbstractSet[tuple[str, int]] = frozenset()
) -> tuple[list[SegmentHeader], list[SegmentHeader]]:
    """One session's good segments (in seq order) split into what a cache recovers (its
    turns without a gap, with the first one's schema: from 0, or for a fork from the first
    turn after those it inherits) and the strays (a turn a fork references is neither: a
    cache keeps it for the fork)."""
    kept: list[SegmentHeader] = []
    strays: list[SegmentHeader] = []
    group = [h for h in group if not is_retirement(h)]
    first = group[0].seq if group and group[0].base else 0
    schema = header_schema(group[0]) if group else None
    for h in group:
        if h.seq == first + len(kept) and header_schema(h) == schema:
            kept.append(h)
        elif (h.session, h.seq) not in refs:
            strays.append(h)
    return kept, strays


def repair_directory(
    directory: str | os.PathLike[str], *, secret: bytes | None = None
) -> FsckReport:
    """Quarantine every damaged file, as a tier opening the directory and reading every
    segment back would, and every stray (a good segment no cache would recover: a cache's
    open would delete it); return the check made afterwards. Nothing is deleted.

    :raises DirectoryInUseError: if a tier has the directory open (close it first)
    :raises ~tieredkv.errors.TierIOError: if a header cannot be read (nothing is moved),
        or a subdirectory is a symbolic link (remove it by hand: a repair never follows one)
    """
    import anyio

    from ._checks import MAX_COUNT
    from .backends.ssd import SSDTier

    async def reread() -> None:
        tier = SSDTier(directory, MAX_COUNT, secret=secret, name="fsck")
        try:
            headers = await tier.open()
        except TierIOError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise
            raise DirectoryInUseError(directory) from None
        async with tier:
            by_session: dict[str, list[SegmentHeader]] = {}
            unread: set[str] = set()
            unread_turns: set[tuple[str, int]] = set()
            for h in sorted(headers, key=lambda h: (h.session, h.seq)):
                buf = bytearray(h.length)
                try:  # a damaged one is quarantined by the read
                    await tier.read([(h.session, h.seq)], [memoryview(buf)])
                except CorruptSegmentError:
                    continue
                except TierIOError:  # reported by the check that follows
                    unread.add(h.session)
                    unread_turns.add((h.session, h.seq))
                    continue
                by_session.setdefault(h.session, []).append(h)
            refs, dangling = _references(by_session, unread_turns)
            for session, group in by_session.items():
                if session in unread:  # what follows an unreadable turn may be whole
                    continue
                if session in dangling:
                    for h in group:
                        await tier.quarantine((h.session, h.seq), dangling[session])
                    continue
                if any(is_retirement(h) for h in group):
                    continue  # reclaimable at most: a cache's open deletes what is spare
                for h in _recoverable(group, refs)[1]:
                    await tier.quarantine(
                        (h.session, h.seq),
                        "no cache would recover it (after a gap in its session's turns, or "
                        "of another schema)",
                    )

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
    where = f"tieredkv {args.command}"
    if args.command == "fsck" and args.directory.startswith(("redis://", "rediss://", "unix://")):
        try:
            from .fsck_redis import run_redis_command
        except ImportError as exc:
            print(
                f"{where}: error: checking a Redis tier needs the redis client (the redis "
                f"extra: pip install -e '.[redis]' in a checkout, or pip install redis): {exc}",
                file=sys.stderr,
            )
            return 2
        return run_redis_command(args)
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
    except OSError as exc:  # (a directory that cannot be listed, say)
        print(
            f"{where}: error: {args.directory!r} could not be read: {exc}; check the "
            f"device (dmesg) and the permissions, then run it again",
            file=sys.stderr,
        )
        return 2
    if args.command == "inspect":
        _print_sessions(report)
        return 0
    _print_report(report)
    if args.repair and not report.clean:
        try:
            after = repair_directory(args.directory, secret=secret)
        except (DirectoryInUseError, TierIOError) as exc:
            print(f"{where}: repair failed: {exc}", file=sys.stderr)
            return 1
        moved = after.quarantined - report.quarantined
        unfinished = (
            f"; {report.leftovers} unfinished write(s) in tmp/, never acknowledged, removed"
            if report.leftovers
            else ""
        )
        print(
            f"repair: moved {moved} file(s) to quarantine/ (nothing stored was deleted{unfinished})"
        )
        for s in report.sessions:
            if s.truncated:
                kept = next((a.turns for a in after.sessions if a.session == s.session), 0)
                print(
                    f"repair: session {_shown(s.session)} now keeps {kept} of "
                    f"{s.turns + s.stray + s.damaged} stored turn(s)"
                )
        report = after
        _print_report(report)
    return 0 if report.clean else 1


def _shown(session: str) -> str:
    return repr(session if len(session) <= 60 else session[:57] + "...")


def _print_report(report: FsckReport) -> None:
    print(
        f"{report.directory}: {report.segments} good segment(s) in {len(report.sessions)} "
        f"session(s), {report.bytes:,} bytes; {len(report.damaged)} damaged; "
        f"{len(report.unreadable)} unreadable; {report.leftovers} leftover(s) in tmp/; "
        f"{report.quarantined} in quarantine/"
    )
    for d in report.damaged:
        print(f"  damaged: {d.path}: {d.problem}")
    for d in report.unreadable:
        print(f"  unreadable: {d.path}: {d.problem} (not shown to be damaged; a tier's open fails)")
    if report.retired:
        print(
            f"  {len(report.retired)} dropped conversation(s) whose turns forks still list "
            f"(kept for them)"
        )
    if report.reclaimable:
        print(
            f"  reclaimable: {report.reclaimable} file(s), {report.reclaimable_bytes:,} bytes "
            f"no conversation needs (a cache's open deletes them)"
        )
    for s in report.sessions:
        if s.truncated:
            print(
                f"  truncated: session {_shown(s.session)} comes back with {s.turns} of "
                f"{s.turns + s.stray + s.damaged} stored turn(s) ({s.damaged} damaged, "
                f"{s.stray} after a gap or of another schema: not recovered)"
            )
    print("clean" if report.clean else "NOT clean")


def _print_sessions(report: FsckReport) -> None:
    print("| session | turns | tokens | bytes | stray |")
    print("|---|---|---|---|---|")
    for s in report.sessions:
        print(f"| {_shown(s.session)} | {s.turns} | {s.tokens:,} | {s.bytes:,} | {s.stray} |")
    print(
        f"{len(report.sessions)} session(s), {report.segments} segment(s), {report.bytes:,} "
        f"bytes; {len(report.damaged)} damaged file(s) (run tieredkv fsck)"
    )
