"""An SSD tier's open directory: descriptors that never follow a link, the lock, quarantine.

Nothing under the directory is reached through a symbolic link: the subdirectories are
opened once with ``O_NOFOLLOW`` and every file is then named relative to a subdirectory's
descriptor (``dir_fd``), so a ``tmp/`` or ``segments/ab`` replaced by a link cannot make
the tier write, read or delete outside the directory. A symlinked ``segments``, ``tmp``,
``quarantine`` or ``LOCK`` fails the open; a symlinked ``segments/ab`` or segment file is
moved to ``quarantine/`` (the link, never its target).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from pathlib import Path

from ...errors import TierIOError
from .._locks import lock_or_refuse
from ..base import SegmentKey
from .layout import LOCK, O_DIR, O_DIRECT, SUBDIRS, file_parts

__all__ = ["TierDirectory", "full_hint", "unlink_quietly"]

_log = logging.getLogger(__name__)


def unlink_quietly(name: str, dir_fd: int) -> None:
    """Remove ``name`` from the directory ``dir_fd`` if it can be; never raises."""
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


def full_hint(exc: OSError, directory: Path, capacity: int) -> str | None:
    """What to do about a full filesystem (or quota), naming the directory; else None."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return (
        f"the filesystem holding {str(directory)!r} is full (or its quota is used "
        f"up): free space there, or give the tier a capacity below the space it has "
        f"free (its capacity is {capacity:,} bytes)"
    )


class TierDirectory:
    """The directory of one SSD tier, while the tier has it open.

    Holds the descriptors of ``segments/``, ``tmp/``, ``quarantine/`` and each
    ``segments/xx`` it has used, and the ``LOCK`` file's descriptor (its ``flock`` keeps
    another tier out). :attr:`direct` says whether segment files are opened with O_DIRECT
    (decided by the probe at open).

    :param directory: the tier's directory
    :param tier: the tier's name, for messages
    """

    def __init__(self, directory: Path, tier: str) -> None:
        self.path = directory
        self.tier = tier
        self.direct = False
        self.io_align = 1
        """The alignment of file offsets, lengths and memory addresses that reads here need:
        1 with buffered I/O; with O_DIRECT, the smallest the probe found to work (512 on
        most SSDs, else 4096)."""
        self._fds: dict[str, int] = {}
        """Descriptors of the subdirectories: segments, tmp, quarantine and each segments/xx."""
        self._lock = threading.Lock()
        self._lock_fd: int | None = None

    def fd(self, sub: str) -> int:
        """The descriptor of ``segments``, ``tmp`` or ``quarantine`` (open only)."""
        return self._fds[sub]

    @property
    def file_flags(self) -> int:
        """The flag that segment files are opened with besides the access mode: O_DIRECT
        where the probe found it works, else 0."""
        return O_DIRECT if self.direct else 0

    # -- open and close ------------------------------------------------------------------
    def open(self) -> None:
        """Create what is missing, refuse links, open the subdirectories and take the lock.

        :raises ~tieredkv.errors.TierIOError: the directory cannot be used (naming what
            to fix), or another tier has it open; nothing is left open then
        """
        root: int | None = None
        try:
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                root = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                self._refuse_links(root)
                made = [_mkdir(sub, root) for sub in SUBDIRS]
                for sub in SUBDIRS:
                    self._fds[sub] = os.open(sub, O_DIR, dir_fd=root)
                if any(made):  # their entries are durable before a file in them is
                    os.fsync(root)
                flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                lock_fd = os.open(LOCK, flags, 0o644, dir_fd=root)
            except TierIOError:
                raise
            except OSError as exc:
                raise TierIOError(
                    self.tier,
                    f"use directory {str(self.path)!r} (it must be a writable directory; "
                    f"fix its permissions or pass another one)",
                    exc,
                ) from exc
            lock_or_refuse(
                lock_fd,
                self.tier,
                repr(str(self.path)),
                "another SSDTier has this directory open (a cache in this process or "
                "another, or `tieredkv fsck --repair`): close it first, or give each cache "
                "its own directory",
            )
            self._lock_fd = lock_fd
        except BaseException:
            self.close()
            raise
        finally:
            if root is not None:
                os.close(root)

    def _refuse_links(self, root: int) -> None:
        for sub in (*SUBDIRS, LOCK):
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISLNK(os.stat(sub, dir_fd=root, follow_symlinks=False).st_mode):
                    raise TierIOError(
                        self.tier,
                        f"use {str(self.path / sub)!r}: it is a symbolic link, and the "
                        f"tier never follows one (remove the link)",
                        OSError(errno.ELOOP, "a symbolic link"),
                    )

    def close(self) -> None:
        """Close every descriptor; the lock goes with its file's."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # also releases the flock
            self._lock_fd = None
        with self._lock:
            fds = list(self._fds.values())
            self._fds.clear()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def forget_in_child(self) -> None:
        """In a child this process forked: close the child's copies of the descriptors, the
        lock's among them (the lock stays the parent's while it keeps its own), taking no
        lock (a parent's thread may have held one at the fork)."""
        self._lock = threading.Lock()
        fds = [*self._fds.values(), *([] if self._lock_fd is None else [self._lock_fd])]
        self._fds.clear()
        self._lock_fd = None
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- files ---------------------------------------------------------------------------
    def subdir(self, xx: str, *, create: bool) -> int:
        """The descriptor of ``segments/xx``, opened without following a symlink."""
        with self._lock:
            fd = self._fds.get(xx)
            if fd is None:
                parent = self._fds["segments"]
                if create and _mkdir(xx, parent):  # durable before a file in it is
                    os.fsync(parent)
                try:
                    fd = os.open(xx, O_DIR, dir_fd=parent)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    raise OSError(
                        exc.errno,
                        f"segments/{xx} is a symbolic link or not a directory (the tier never "
                        f"follows a link; remove it)",
                    ) from None
                self._fds[xx] = fd
            return fd

    def remove_leftovers(self) -> None:
        """Delete the tier's own files in tmp/: writes a crash interrupted (``*.tmp``) and
        direct-I/O probes (``probe-*``), links included, never their targets (unlink
        removes the link itself). Anything else there is not the tier's: it is left,
        with a warning."""
        tmp = self._fds["tmp"]
        for name in os.listdir(tmp):
            if not (name.endswith(".tmp") or name.startswith("probe-")):
                _log.warning(
                    "tier %r: tmp/%s is not a file this tier writes: left as it is (the "
                    "tier's folder is for the tier alone; move it elsewhere)",
                    self.tier,
                    name,
                )
                continue
            try:
                os.unlink(name, dir_fd=tmp)
            except OSError as exc:  # harmless: never read, only space
                _log.warning("tier %r: could not remove tmp/%s: %s", self.tier, name, exc)

    def unlink_segment(self, key: SegmentKey) -> None:
        """Remove ``key``'s file (gone already is fine)."""
        xx, name = file_parts(key)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.subdir(xx, create=False))

    # -- quarantine ----------------------------------------------------------------------
    def quarantine_key(self, key: SegmentKey, why: str) -> None:
        """Move ``key``'s file to quarantine/ (see :meth:`quarantine_entry`)."""
        xx, name = file_parts(key)
        try:
            sub = self.subdir(xx, create=False)
        except OSError as exc:
            _log.warning("tier %r: segments/%s cannot be opened (%s)", self.tier, xx, exc)
            return
        self.quarantine_entry(sub, name, why)

    def quarantine_entry(self, parent: int, name: str, why: str, *, keep: bool = False) -> None:
        """Move ``name`` (in the directory ``parent``) to quarantine/; a link moves as a link.

        If it cannot be moved it is deleted (it failed verification: it can never be
        served), unless ``keep`` (it could not be read, and may be whole: the next open
        looks at it again; it is not indexed meanwhile).
        """
        dest = f"{name}.{time.time_ns()}"
        try:
            os.replace(name, dest, src_dir_fd=parent, dst_dir_fd=self._fds["quarantine"])
        except FileNotFoundError:
            return
        except OSError as exc:
            if keep:
                _log.warning(
                    "tier %r: could not move %s aside (%s); leaving it (%s)",
                    self.tier,
                    name,
                    exc,
                    why,
                )
                return
            _log.warning("tier %r: could not move %s aside (%s); deleting it", self.tier, name, exc)
            unlink_quietly(name, parent)
            return
        _log.warning("tier %r: moved damaged %s to quarantine/%s (%s)", self.tier, name, dest, why)


def _mkdir(name: str, parent: int) -> bool:
    """Make the directory ``name`` in ``parent`` (a descriptor) unless it exists; whether
    it was made (its entry in ``parent`` is then to be fsynced)."""
    try:
        os.mkdir(name, 0o755, dir_fd=parent)
    except FileExistsError:
        return False
    return True
