"""Turns that say who wrote them, and replicas in processes of their own (the fleet tests
and the fleet campaign).

A turn is :data:`TOKENS` tokens of two int32 tensors filled with its *tag* (``v`` with
``-tag``), so a loaded history names its turns exactly (:func:`tags`): a splice of two
histories, a turn written by another replica, an older history, or a single changed
element all show, byte for byte.

:class:`ReplicaProcess` runs :mod:`tests.fleet_replica` in a child process and drives it
over stdin/stdout, one JSON line per command, so a test can run a replica whose leases and
fencing tokens are another process's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import torch

__all__ = ["TOKENS", "ReplicaProcess", "runs", "tags", "turn"]

TOKENS = 16
WIDTH = 32
ROOT = Path(__file__).resolve().parents[1]


def turn(tag: int, tokens: int = TOKENS) -> dict[str, torch.Tensor]:
    """A turn whose every element names it."""
    return {
        "k": torch.full((tokens, WIDTH), tag, dtype=torch.int32),
        "v": torch.full((tokens, WIDTH), -tag, dtype=torch.int32),
    }


def tags(history: dict[str, torch.Tensor], tokens: int = TOKENS) -> list[int]:
    """The tags of a loaded history's turns, in order.

    :raises AssertionError: if the history is not whole turns of :func:`turn` (a turn with
        any element changed, or cut)
    """
    k, v = history["k"], history["v"]
    assert set(history) == {"k", "v"}
    assert k.shape == v.shape
    assert k.shape[0] % tokens == 0
    found = []
    for at in range(0, k.shape[0], tokens):
        tag = int(k[at, 0])
        block = slice(at, at + tokens)
        assert torch.equal(k[block], torch.full_like(k[block], tag)), f"turn at {at} is mixed"
        assert torch.equal(v[block], torch.full_like(v[block], -tag)), f"turn at {at} is mixed"
        found.append(tag)
    return found


def runs(history: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """The ``(tag, tokens)`` of a loaded history's turns, for turns of any length (two
    turns in a row never share a tag).

    :raises AssertionError: if a turn is mixed (``v`` is not ``-k`` row by row, or a row
        holds two values)
    """
    k, v = history["k"], history["v"]
    assert set(history) == {"k", "v"}
    assert k.shape == v.shape
    assert torch.equal(v, -k), "v is not -k"
    first = k[:, 0]
    assert torch.equal(k, first[:, None].expand_as(k)), "a row holds two values"
    values, counts = torch.unique_consecutive(first, return_counts=True)
    return [(int(t), int(n)) for t, n in zip(values, counts, strict=True)]


class ReplicaProcess:
    """A replica (its own tiers over a RedisTier: :mod:`tests.fleet_replica`) in a child
    process.

    Use ``async with ReplicaProcess(url, prefix, ...) as r:``; each method sends one
    command and returns the child's answer: ``{"ok": True, ...}`` or ``{"ok": False,
    "error": "<exception type>", "message": ...}``.
    """

    def __init__(self, url: str, prefix: str, **options: Any) -> None:
        self.args = [url, prefix, json.dumps(options)]
        self._proc: anyio.abc.Process | None = None
        self._buffer = b""
        self.hung: str | None = None
        """The command that did not answer, if one did not."""

    async def __aenter__(self) -> ReplicaProcess:
        path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        env = {**os.environ, "PYTHONPATH": path}
        self._proc = await anyio.open_process(
            [sys.executable, "-W", "error", "-m", "tests.fleet_replica", *self.args],
            env=env,
            cwd=ROOT,
        )
        ready = await self._read()
        assert ready.get("ok"), ready
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        proc = self._proc
        if proc is None:
            return
        with anyio.CancelScope(shield=True):
            if self.hung is not None:  # it answers nothing more: no clean close
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
                await proc.aclose()
                return
            try:
                with anyio.fail_after(30):
                    await self.call("close")
                    await proc.wait()
            except (TimeoutError, anyio.BrokenResourceError, anyio.EndOfStream, AssertionError):
                proc.kill()
                await proc.wait()
            finally:
                await proc.aclose()
        assert proc.returncode == 0, f"the replica process exited with {proc.returncode}"

    async def kill(self) -> None:
        """SIGKILL the replica (it answers nothing more)."""
        proc = self._proc
        assert proc is not None
        proc.kill()
        await proc.wait()
        self.hung = "killed"

    async def _read(self) -> dict[str, Any]:
        proc = self._proc
        assert proc is not None
        assert proc.stdout is not None
        while b"\n" not in self._buffer:
            chunk = await proc.stdout.receive()
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def call(self, op: str, *, within: float = 120.0, **args: Any) -> dict[str, Any]:
        """Send one command; its answer.

        :raises AssertionError: no answer within ``within`` seconds (the call hangs in the
            replica, and its own ``deadline`` did not end it)
        """
        proc = self._proc
        assert proc is not None
        assert proc.stdin is not None
        await proc.stdin.send(json.dumps({"op": op, **args}).encode() + b"\n")
        with anyio.move_on_after(within):
            return await self._read()
        self.hung = f"{op} {args} gave no answer in {within:.0f} s"
        raise AssertionError(f"the replica's {self.hung}")

    async def append(self, session: str, tag: int, tokens: int = TOKENS) -> dict[str, Any]:
        return await self.call("append", session=session, tag=tag, tokens=tokens)

    async def load(self, session: str, tokens: int = TOKENS) -> dict[str, Any]:
        return await self.call("load", session=session, tokens=tokens)

    async def flush(self) -> dict[str, Any]:
        return await self.call("flush")
