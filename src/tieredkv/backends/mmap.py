"""A file-backed memory map as a capacity tier.

One file of ``capacity`` bytes, mapped shared into the process and carved up like the host
arena. The kernel pages it in and out, so it can hold more than free RAM at memory speed
for the part that is resident. It is a volatile tier: the file is recreated at open and
removed at close (``keep_file=True`` leaves it for inspection); use the SSD tier for KV that
must survive a restart. Every copy runs in a worker thread, since touching a page that is
not resident is a blocking disk read.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from pathlib import Path
from typing import Any

from .._fork import reset_in_forked_child
from ..errors import TierIOError
from ._buffers import close_mapping
from ._locks import lock_or_refuse
from .arena import ArenaTier

__all__ = ["MmapTier"]


class MmapTier(ArenaTier):
    """A tier in a memory-mapped file.

    :param path: the backing file (created or truncated; its directory must exist; never a
        symbolic link, which would make the tier truncate the link's target). The tier
        holds an exclusive lock on it while open: a second tier on the same file, in this
        process or another, is refused (it would empty the first one's data)
    :param capacity: the byte budget and file size (rounded up to 4 KiB)
    :param name: the tier's name in metadata and events
    :param keep_file: leave the file in place at close
    :param max_threads: worker threads for copies
    """

    kind = "mmap"
    inline_copy_limit = 0

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity: int,
        *,
        name: str = "mmap",
        keep_file: bool = False,
        max_threads: int = 2,
    ) -> None:
        super().__init__(name, capacity, max_threads=max_threads)
        self.path = Path(path)
        self._keep = keep_file
        self._mmap: mmap.mmap | None = None
        self._fd: int | None = None  # (open while mapped: it holds the lock)

    def _acquire_buffer(self) -> memoryview:
        # not O_TRUNC: the file may be another open tier's, which the lock below finds out
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            hint = (
                "it is a symbolic link, which the tier never follows (it would truncate the "
                "link's target); pass the real path"
                if exc.errno == errno.ELOOP
                else "check the directory exists and is writable"
            )
            raise TierIOError(
                self.name, f"create its file {str(self.path)!r} ({hint})", exc
            ) from exc
        lock_or_refuse(
            fd,
            self.name,
            f"its file {str(self.path)!r}",
            "another tier has this file open, in this process or another; give each tier "
            "a file of its own",
        )
        try:
            os.ftruncate(fd, 0)  # what an earlier run left: never read
            # reserve the blocks now so a full disk fails here, not as SIGBUS on first write
            os.posix_fallocate(fd, 0, self._capacity)
            # mapped through a descriptor of its own: the map keeps a copy of it, which
            # must not hold the lock (a forked child keeps the map, and closes only ``fd``)
            map_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
            try:
                self._mmap = mmap.mmap(map_fd, self._capacity, flags=mmap.MAP_SHARED)
            finally:
                os.close(map_fd)
        except OSError as exc:
            self._remove_file()
            os.close(fd)
            raise TierIOError(
                self.name, f"map {self._capacity:,} bytes of {self.path}", exc
            ) from exc
        self._fd = fd
        reset_in_forked_child(self)
        return memoryview(self._mmap)

    def _after_fork(self) -> None:
        """In a child forked while the tier was open: close the child's copy of the file's
        descriptor, so that a long-lived child does not keep the file locked after the
        parent closed the tier (the tier is unusable in the child)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _remove_file(self) -> None:
        if not self._keep:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _release_buffer(self) -> None:
        if self._mmap is not None:
            mm, self._mmap = self._mmap, None
            close_mapping(mm, f"tier {self.name!r}", collect=True)
        self._remove_file()
        if self._fd is not None:  # the lock goes with it, once the file is gone
            fd, self._fd = self._fd, None
            os.close(fd)

    def _extra_stats(self) -> dict[str, Any]:
        return {"notes": (f"file-backed map at {self.path}",)}
