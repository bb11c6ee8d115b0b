"""What the benchmarks measure around one timed call: wall seconds, the CPU seconds of the
whole process (user + system, every thread: ``RUSAGE_SELF``) and its page faults; and how
they make a file's pages cold."""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass
class Took:
    """One timed call: wall and CPU seconds, minor and major page faults."""

    wall: float = 0.0
    cpu: float = 0.0
    minflt: int = 0
    majflt: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextlib.contextmanager
def measured() -> Iterator[Took]:
    """Time the block: its :class:`Took` is filled in when the block ends."""
    took = Took()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    try:
        yield took
    finally:
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        took.wall = t1 - t0
        took.cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        took.minflt = r1.ru_minflt - r0.ru_minflt
        took.majflt = r1.ru_majflt - r0.ru_majflt


def drop_caches() -> bool:
    """Write back, then drop the machine's clean page cache (root only); ``False`` where not
    permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
    except OSError:
        return False
    return True


def evict_files(root: Path) -> int:
    """``fsync`` and ``posix_fadvise(DONTNEED)`` every file under ``root``, so that no page
    of theirs stays cached; the number of files."""
    n = 0
    for path in root.rglob("*"):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        n += 1
    return n


def cold(root: Path, drop: bool) -> str:
    """Make ``root``'s files cold: always ``posix_fadvise``, and ``drop_caches`` too when
    ``drop`` (and permitted); says which ran."""
    evict_files(root)
    if drop and drop_caches():
        return "fadvise+drop_caches"
    return "fadvise"
