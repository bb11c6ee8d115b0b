"""What a child this process forks does with the caches and tiers it inherits open.

A fork copies a process's memory and descriptors but only the thread that called it. A
cache or tier opened before the fork is, in the child, a copy whose worker threads are gone
(a read waits for them forever), whose Redis connections and shared maps are the parent's
own (a child's command would interleave with the parent's on one socket; a child's write
into a ``MAP_SHARED`` tier would land in the parent's memory), and whose files the parent
goes on writing. So in the child every operation on such an object raises
:class:`~tieredkv.errors.ForkedError` (opening it again too), and closing it releases only
the child's copy (nothing is written, deleted or released on the parent's behalf). What the
parent closed before the fork is not the parent's any more: the child may open it. An SSD
tier's directory descriptors, its lock among them, are closed in the child as it starts: a
long-lived child would otherwise keep the directory locked after the parent closed it or
exited.

Owners also use :func:`reset_in_forked_child` for their locks: a fork copies a lock as it
is, held by a thread the child does not have.
"""

from __future__ import annotations

import os
import weakref
from typing import Protocol

from .errors import ForkedError

__all__ = ["check_process", "reset_in_forked_child"]


class _Forkable(Protocol):
    def _after_fork(self) -> None: ...


_forkable: weakref.WeakSet[_Forkable] = weakref.WeakSet()


def reset_in_forked_child(owner: _Forkable) -> None:
    """Call ``owner._after_fork()`` in a child this process forks, before the child runs
    anything else (no lock may be taken there: a parent's thread may have held it)."""
    _forkable.add(owner)


def _after_fork_in_child() -> None:
    for owner in list(_forkable):
        owner._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def check_process(what: str, opened_in: int | None) -> None:
    """Refuse to use ``what`` (a cache or tier opened in process ``opened_in``) in another
    process: a child forked from the one that opened it (:class:`ForkedError`)."""
    if opened_in is not None and opened_in != os.getpid():
        raise ForkedError(what, opened_in)
