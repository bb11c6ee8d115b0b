"""Retrying a blocking file operation that failed with an I/O error that may pass.

An ``EIO`` (or ``EAGAIN``, ``EINTR``, ``ENOMEM``...) while a file is read says nothing about
the file's bytes: a controller reset, a path that failed over or a busy network filesystem
answer the next call. So a caller that would otherwise act on the failure (set the file
aside, give up on it) first tries again a few times, with growing pauses. Errors that
retrying cannot fix are raised at once: the name does not exist, is a symbolic link or not
a directory, or may not be opened (permissions).

Runs in a worker thread (the pauses are ``time.sleep``), never on the event loop.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

__all__ = ["RETRY_DELAYS", "retry_io", "transient", "tries"]

T = TypeVar("T")

RETRY_DELAYS: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3)
"""Pauses (seconds) between the tries of :func:`retry_io`: 5 tries over 0.44 s."""

_PERMANENT = frozenset(
    {
        errno.ENOENT,
        errno.ELOOP,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ENAMETOOLONG,
        errno.EACCES,
        errno.EPERM,
        errno.EBADF,
        errno.EINVAL,
    }
)


def transient(exc: OSError) -> bool:
    """Whether trying ``exc``'s operation again may succeed."""
    return exc.errno not in _PERMANENT


def retry_io(call: Callable[[], T], *, delays: Sequence[float] = RETRY_DELAYS) -> T:
    """``call()``, tried again after each of ``delays`` while it raises a transient
    :class:`OSError` (see :func:`transient`); the last try's error propagates.

    :param delays: the pauses between tries (``len(delays) + 1`` tries in all)
    """
    for delay in delays:
        try:
            return call()
        except OSError as exc:
            if not transient(exc):
                raise
        time.sleep(delay)
    return call()


def tries(delays: Sequence[float] = RETRY_DELAYS) -> str:
    """How :func:`retry_io` tried, for a message: ``"5 tries over 0.44 s"``."""
    return f"{len(delays) + 1} tries over {sum(delays):.2f} s"
