"""Bookkeeping shared by the schedulers: queued requests and per-session KV loads."""

from __future__ import annotations

from .scheduling import Request

__all__ = ["Entry", "Load"]


class Entry:
    """A queued request; ``load`` is the pending load it waits for (``None``: ready)."""

    __slots__ = ("key", "load", "request")

    def __init__(self, request: Request, seq: int) -> None:
        self.request = request
        # Heap key: arrival first, submission order breaks ties (and keeps keys unique, so
        # entries themselves are never compared).
        self.key = (request.arrival, seq)
        self.load: Load | None = None


class Load:
    """One session's KV load, shared by every queued request of that session."""

    __slots__ = ("arrival", "done", "entries", "nbytes", "seq", "session", "started")

    def __init__(self, session: str, nbytes: int, arrival: float, seq: int) -> None:
        self.session = session
        self.nbytes = nbytes
        self.arrival = arrival  # of the earliest request waiting for it
        self.seq = seq
        self.entries: list[Entry] = []
        self.started = False
        self.done = False


def check_max_loads(max_loads: int) -> int:
    if max_loads < 1:
        raise ValueError(
            f"max_loads must be at least 1 (got {max_loads}): it bounds loads in flight"
        )
    return max_loads
