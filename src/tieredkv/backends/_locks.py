"""One tier, one file: the exclusive lock that the SSD tier's directory and the mmap tier's
file are held under while open."""

from __future__ import annotations

import fcntl
import os

from ..errors import TierIOError

__all__ = ["lock_or_refuse"]


def lock_or_refuse(fd: int, tier: str, what: str, hint: str) -> None:
    """Lock ``fd`` exclusively without waiting (``flock``: held until ``fd`` is closed).

    :raises TierIOError: another open file description holds the lock (in this process or
        another): ``fd`` is closed, and the error says to ``lock {what}``, with ``hint``
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise TierIOError(tier, f"lock {what}", exc, hint=hint) from exc
