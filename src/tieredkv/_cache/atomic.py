"""Run a move to completion whatever cancels its caller.

A move hands memory and files to worker threads. If the awaiting task is cancelled while
a thread still writes into a host slot or renames a file, releasing the slot or the
reservation at that moment corrupts another session's data. ``anyio.CancelScope(shield=
True)`` protects only against anyio's own cancellation: ``task.cancel()``,
``asyncio.timeout`` and ``asyncio.wait_for`` still raise at the awaiting point while the
thread goes on. So every move runs in a task of its own that nobody cancels, and the caller
waits for that task to finish, recording (not acting on) any cancellation that arrives
meanwhile. The caller then decides: roll back and re-raise it, or, past the point of no
return, complete.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

__all__ = ["settle"]

T = TypeVar("T")


async def settle(fn: Callable[[], Awaitable[T]]) -> tuple[T, BaseException | None]:
    """Run ``fn()`` to completion; return its result and the cancellation that arrived meanwhile.

    ``fn`` runs in a new task, outside every cancel scope of the caller, so neither anyio
    scopes nor native asyncio cancellation interrupt it. A cancellation of the caller
    (either kind, any number of times) is caught and returned as the second element; the
    caller must re-raise it once it has restored its invariants.

    :raises: what ``fn`` raised; if the caller was also cancelled, that cancellation
        (chained from ``fn``'s exception), so a timeout still reads as a timeout
    """
    task = asyncio.get_running_loop().create_task(_call(fn))
    cancel: BaseException | None = None
    with anyio.CancelScope(shield=True):  # no busy re-delivery of anyio cancellation here
        while not task.done():
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError as exc:  # the caller's, not the task's
                if task.done() and task.cancelled():
                    raise  # the task itself was cancelled (the loop is shutting down)
                cancel = exc
    if task.cancelled():  # pragma: no cover - only at loop shutdown
        raise cancel if cancel is not None else asyncio.CancelledError()
    error = task.exception()
    if error is not None:
        if cancel is not None:
            raise cancel from error
        raise error
    return task.result(), cancel


async def _call(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()
