"""The simulated SSD: one device serving one transfer at a time, and an optional host
write buffer whose writes use only the device's idle time.

A transfer takes ``latency + bytes / bandwidth`` and queues behind the transfers before it
(reads and writes alike, first in first out). With ``background`` writes (asynchronous
saves), a write goes to a host buffer of ``buffer_bytes`` instead, which drains while no
transfer is in line; only what overflows the buffer queues with the loads. Segments queued
with :meth:`SSDQueue.write_ahead` (a write-back store cleaning its KV ahead of eviction)
are written with the idle time left after the buffer, oldest first.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from .writepath import SSDState

S = TypeVar("S", bound="SSDState")

__all__ = ["S", "SSDQueue"]


class SSDQueue(Generic[S]):
    """The SSD's queue of transfers (see the module docstring); times in seconds.

    :param bandwidth: bytes per second, reads and writes alike
    :param latency: fixed seconds per transfer
    :param background: writes wait in the host buffer and use the SSD's idle time
    :param buffer_bytes: the host write buffer (with ``background``)
    :param cleaned: called with a session whose SSD copy became complete by a write ahead,
        and the time it did
    """

    __slots__ = (
        "_bps",
        "_buffer",
        "_cleaned",
        "_clock",
        "_latency",
        "ahead",
        "background",
        "backlog",
        "free_at",
        "read_bytes",
        "written_bytes",
    )

    def __init__(
        self,
        bandwidth: float,
        latency: float,
        *,
        background: bool,
        buffer_bytes: float,
        cleaned: Callable[[S, float], None],
    ) -> None:
        self._bps = bandwidth
        self._latency = latency
        self.background = background
        self._buffer = buffer_bytes
        self._cleaned = cleaned
        self.free_at = 0.0
        """When the SSD finishes the transfers queued in line."""
        self.backlog = 0.0
        """Bytes of buffered writes not yet on SSD."""
        self._clock = 0.0  # the backlog is drained up to this time
        self.ahead: deque[tuple[S, int, float]] = deque()
        """(session, its generation, bytes) of new segments to write while the SSD idles."""
        self.read_bytes = 0
        self.written_bytes = 0

    def in_line(self, now: float, nbytes: float) -> float:
        """Queue a transfer behind the SSD's previous ones; returns when it ends."""
        if self.background:
            self.drain(now)
        start = now if now > self.free_at else self.free_at
        end = start + self._latency + nbytes / self._bps
        self.free_at = end
        return end

    def read(self, now: float, nbytes: int) -> float:
        """Read ``nbytes`` (in line); returns when the read ends."""
        self.read_bytes += nbytes
        return self.in_line(now, nbytes)

    def write(self, now: float, nbytes: int) -> None:
        """Write ``nbytes``: in line with the loads, or (``background``) through the write
        buffer, in line only for what overflows it."""
        self.written_bytes += nbytes
        if not self.background:
            self.in_line(now, nbytes)
            return
        self.drain(now)
        self.backlog += nbytes
        over = self.backlog - self._buffer
        if over > 0:
            self.backlog = self._buffer
            self.in_line(now, over)

    def write_ahead(self, s: S) -> None:
        """Queue ``s``'s unwritten bytes to be written while the SSD idles."""
        self.ahead.append((s, s.gen, float(s.dirty)))

    def catch_up(self, now: float) -> None:
        """Account the writes ahead done during the idle time up to ``now`` (before a choice
        that depends on which copies are complete)."""
        if self.ahead:
            self.drain(now)

    def writing(self, now: float) -> bool:
        """Whether buffered or ahead writes are still pending at ``now`` (the idle SSD
        writes them back first)."""
        if self.background:
            self.drain(now)
            return self.backlog > 0 or bool(self.ahead)
        return False

    def drain(self, now: float) -> None:
        """Write the buffer's backlog during the SSD's idle time up to ``now``; the idle
        time left writes the queued segments ahead (oldest first)."""
        idle_from = max(self._clock, self.free_at)
        self._clock = now
        if now <= idle_from:
            return
        idle = (now - idle_from) * self._bps  # bytes the idle SSD could write
        used = min(idle, self.backlog)
        self.backlog -= used
        idle -= used
        ahead = self.ahead
        while ahead and idle > 0:
            s, gen, left = ahead[0]
            if gen != s.gen or s.dirty <= 0:
                ahead.popleft()  # written by an eviction meanwhile
                continue
            done = min(left, idle, s.dirty)
            idle -= done
            self.written_bytes += int(done)
            s.dirty -= int(done)
            if s.dirty <= 0 or done >= left:
                ahead.popleft()
            else:
                ahead[0] = (s, gen, left - done)
            if s.dirty <= 0:
                s.dirty = 0
                s.on_ssd = True
                s.gen += 1
                if s.in_host:
                    self._cleaned(s, self._clock)
