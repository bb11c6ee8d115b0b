"""Running an operation under each way users cancel: anyio scopes and native asyncio
(``task.cancel()``, ``asyncio.timeout``, ``wait_for``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

__all__ = ["CANCELS", "cancellable"]

CANCELS = ("task.cancel", "asyncio.timeout", "wait_for", "anyio")
"""Every kind :func:`cancellable` knows (any other name runs the operation uncancelled)."""


async def cancellable(
    kind: str, delay: float, op: Callable[[], Awaitable[Any]]
) -> tuple[bool, Any]:
    """Run ``op`` under one kind of cancellation after ``delay`` seconds: (completed, result)."""
    if kind == "task.cancel":
        task = asyncio.get_running_loop().create_task(_await(op))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            return True, await task
        except asyncio.CancelledError:
            return False, None
    if kind == "asyncio.timeout":
        try:
            async with asyncio.timeout(delay):
                return True, await op()
        except TimeoutError:
            return False, None
    if kind == "wait_for":
        try:
            return True, await asyncio.wait_for(_await(op), delay)
        except TimeoutError:
            return False, None
    if kind == "anyio":
        result = None
        with anyio.move_on_after(delay) as scope:
            result = await op()
        return not scope.cancelled_caught, result
    return True, await op()


async def _await(op: Callable[[], Awaitable[Any]]) -> Any:
    return await op()
