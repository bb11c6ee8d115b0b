"""The on-disk layout of an SSD tier's directory, shared by the tier and ``tieredkv fsck``.

Under the directory::

    LOCK                      flock-ed while a process has the tier open (never a symlink)
    segments/ab/<hash>.<seq>.seg   one segment; <hash> = BLAKE2b-128 of the session key
    tmp/                      segments being written (removed at open)
    quarantine/               damaged segments moved aside, never served

File names derive from a hash of the session key, so no key (``/``, ``..``, NUL, 10 kB of
text, any script) can escape or break the directory; the key itself lives in the segment
header, which is how the index is rebuilt after a restart. In authenticated mode every
segment of a session carries the session's *incarnation*, and a session whose files carry
more than one is refused whole (:func:`mixed_incarnations`).

Reading here never follows a symbolic link: a file is opened relative to its
subdirectory's descriptor with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat

from ...errors import CorruptSegmentError
from ...payload import ALIGN, PREFIX, SegmentHeader, check_header_mac, parse_header
from ..base import SegmentKey

__all__ = [
    "LOCK",
    "MIXED_INCARNATIONS",
    "O_DIR",
    "O_DIRECT",
    "READ_FLAGS",
    "SUBDIRS",
    "by_session",
    "file_parts",
    "mixed_incarnations",
    "name_digest",
    "name_seq",
    "pread_full",
    "preadv_full",
    "pwrite_full",
    "read_header_at",
    "segment_file_name",
    "session_digest",
]

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
"""How a segment file is opened to be checked: never through a link, never waiting (a FIFO
named like a segment would block an open without ``O_NONBLOCK``)."""
"""How a subdirectory is opened: never through a symbolic link."""
SUBDIRS = ("segments", "tmp", "quarantine")
LOCK = "LOCK"

MIXED_INCARNATIONS = "its session's files carry different incarnations (a rollback?)"
"""Why every file of a session with more than one incarnation is refused."""


def segment_file_name(key: SegmentKey) -> str:
    """Relative path of a segment's file: ``<2 hex>/<32 hex>.<seq>.seg``."""
    digest = hashlib.blake2b(key[0].encode("utf-8"), digest_size=16).hexdigest()
    return f"{digest[:2]}/{digest}.{key[1]}.seg"


def file_parts(key: SegmentKey) -> tuple[str, str]:
    """A segment's subdirectory under ``segments/`` and its file name there."""
    xx, name = segment_file_name(key).split("/")
    return xx, name


def name_digest(name: str) -> str:
    """The session digest a file name starts with (what names a session's files, even
    when a header is unreadable garbage)."""
    return name.partition(".")[0]


def name_seq(name: str) -> int | None:
    """The segment number in a file name ``<digest>.<seq>.seg``, or ``None`` (for a name
    whose ``seq`` is not ASCII digits: ``str.isdigit`` alone accepts ``²``, which ``int``
    refuses)."""
    seq = name.partition(".")[2].removesuffix(".seg")
    return int(seq) if seq.isascii() and seq.isdigit() else None


def session_digest(session: str) -> str:
    """The digest that starts the file names of ``session``'s segments."""
    return name_digest(file_parts((session, 0))[1])


def by_session(headers: list[SegmentHeader]) -> dict[str, list[SegmentHeader]]:
    """Headers grouped by session, each group in the order given."""
    groups: dict[str, list[SegmentHeader]] = {}
    for h in headers:
        groups.setdefault(h.session, []).append(h)
    return groups


def mixed_incarnations(group: list[SegmentHeader]) -> bool:
    """Whether one session's files carry more than one incarnation: one of them is a stale
    copy, and which one cannot be told, so a tier and fsck refuse them all."""
    return len({h.incarnation for h in group}) > 1


def pwrite_full(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` (``pwrite`` may write less than asked)."""
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Read ``len(view)`` bytes at ``offset``; fewer only at the end of the file.

    Releases ``view`` when done (pass a view of its own: ``view[:]``).
    """
    got = 0
    with view:
        while got < len(view):
            n = os.preadv(fd, [view[got:]], offset + got)
            if n == 0:
                break
            got += n
            if got % ALIGN:  # the file ends here (O_DIRECT cannot continue unaligned)
                break
    return got


def preadv_full(fd: int, views: list[memoryview], offset: int) -> int:
    """Read ``sum(len(v) for v in views)`` bytes at ``offset`` into ``views`` in order (one
    ``preadv`` where it reads them all); fewer only at the end of the file. The views stay
    the caller's (none is released)."""
    total = sum(len(v) for v in views)
    rest = views
    got = 0
    while got < total:
        n = os.preadv(fd, rest, offset + got)
        if n == 0:
            break
        got += n
        if got < total and got % ALIGN:  # the file ends here
            break
        while n and rest:  # skip what this call filled
            if n >= len(rest[0]):
                n -= len(rest[0])
                rest = rest[1:]
            else:
                rest = [rest[0][n:], *rest[1:]]
                n = 0
    return got


def read_header_at(
    sub: int, name: str, rel: str, key: bytes | None = None
) -> tuple[SegmentHeader, int, bytes]:
    """Read and check the header of file ``name`` in the directory ``sub`` (a descriptor;
    never through a symlink) whose path under ``segments/`` is ``rel``: its CRC, its
    contents against the file's size, that ``rel`` is its key's name, and with ``key``
    (from :func:`~tieredkv.payload.derive_key`) its MAC. Returns the header, the file's
    size and its prefix.

    What was read and found wrong (and a symbolic link, which is never read through) is a
    :class:`~tieredkv.errors.CorruptSegmentError`. An I/O error is raised as the
    :class:`OSError` it is: it proves nothing about the file (try again, see
    :func:`~tieredkv._retry.retry_io`).
    """
    try:
        # (O_NONBLOCK: opening a FIFO named like a segment must not wait for a writer)
        fd = os.open(name, READ_FLAGS, dir_fd=sub)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptSegmentError(rel, "a symbolic link (a tier never follows one)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptSegmentError(
                rel, "not a regular file (a tier writes nothing else under segments/)"
            )
        size = st.st_size
        head = os.pread(fd, ALIGN, 0)
        if len(head) >= PREFIX.size:
            _, hlen, _, _ = PREFIX.unpack_from(head, 0)
            need = PREFIX.size + hlen
            if need > len(head) and need <= size:
                head = os.pread(fd, need, 0)
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        with contextlib.suppress(OSError):  # Linux closes the descriptor even then
            os.close(fd)
    header, _ = parse_header(memoryview(head), rel, size)
    if segment_file_name((header.session, header.seq)) != rel:
        raise CorruptSegmentError(rel, "file name does not match its header")
    if key is not None:
        check_header_mac(header, key, rel)
    return header, size, head[: PREFIX.size]
