"""The scheduling protocol and the request it schedules.

A scheduler decides which waiting request the engine runs next and, for requests whose
history KV sits on a lower tier (SSD), in which order their loads into host memory are
issued. Like eviction policies it is pure and synchronous: no I/O, no clock (``now`` comes
in), no asyncio. The engine drives it, phase by phase:

1. ``submit(request, now, view)`` when a request arrives. The scheduler reads where the
   session's KV lives from the metadata channel: in the top tier (``view.tiers[0]``), or
   nowhere (no history yet, or lost: the engine recomputes it) -> the request is *ready*;
   on a lower tier -> it needs a *load* first.
2. ``start_loads(now)`` returns the loads the engine must start now, one request per load
   (bring ``request.session``'s KV to the top tier, e.g. ``cache.prefetch``). The scheduler
   never has more than its ``max_loads`` in flight, and one load serves every waiting
   request of that session.
3. ``load_finished(session, now, ok=...)`` when a load lands (``ok=True``) or fails
   (``ok=False``: the requests become ready anyway and the engine recomputes the history).
   Returns the requests that became ready.
4. ``pop_ready(now)`` or ``next_batch(now, token_budget)`` hands out requests to run.
   Only ready requests are ever handed out; a scheduler may hold back a ready request
   (FCFS does, behind a head that still waits for its load).

Two read-only helpers serve the rest of the system: ``waiting(limit)`` lists the sessions of
queued requests in the order they are expected to run (the engine publishes it with
:meth:`tieredkv.meta.MetadataChannel.publish_waiting`, which is what the queue-enhanced
eviction reads), and ``ready_sessions()`` lists sessions whose KV the scheduler counts on
being in host memory (the engine passes them as ``protected`` to eviction).

A request handed out whose KV was evicted in the meantime (the engine did not protect it)
is the engine's business: it loads or recomputes on the spot.
"""

from __future__ import annotations

from collections.abc import Set
from typing import Protocol, runtime_checkable

import msgspec

from ..meta import KVMeta, MetadataView

__all__ = ["Request", "Scheduler", "kv_needs_load"]


class Request(msgspec.Struct, frozen=True, kw_only=True):
    """One turn of a conversation, waiting to run.

    :param id: unique among the requests a scheduler holds
    :param session: the conversation whose history KV the request needs
    :param arrival: arrival time (the caller's clock); ties keep submission order
    :param tokens: tokens the engine must compute for it (the new query; add the history
        if it will be recomputed): what :meth:`Scheduler.next_batch` counts against its
        token budget
    """

    id: str
    session: str
    arrival: float
    tokens: int = 0


def kv_needs_load(meta: KVMeta | None, view: MetadataView) -> bool:
    """Whether a request for this session must wait for its KV to be loaded.

    ``False`` when the session has no stored KV (no history, or lost: recompute), when a
    copy is in the top tier, or when the channel describes no tiers at all.
    """
    if meta is None or meta.tier is None or meta.nbytes <= 0:
        return False
    tiers = view.tiers
    if not tiers:
        return False
    top = tiers[0].name
    return meta.tier != top and top not in meta.copies


@runtime_checkable
class Scheduler(Protocol):
    """Orders requests and their KV loads. See the module docstring for the phases."""

    name: str
    """Registry name of the policy (``"fcfs"``, ``"bidaw"``)."""

    def submit(self, request: Request, now: float, view: MetadataView) -> None:
        """Queue a request; reads the session's KV location from ``view``.

        :raises ValueError: if a request with the same ``id`` is already queued
        """
        ...

    def start_loads(self, now: float) -> list[Request]:
        """Loads to start now, one request per session to bring into the top tier.

        Engines call it whenever something changed (a submit, a finished load) *and* right
        after :meth:`pop_ready` / :meth:`next_batch` found nothing to hand out: an on-demand
        scheduler (``FCFS(prefetch=False)``) only starts the head's load once asked for work.
        """
        ...

    def load_finished(self, session: str, now: float, *, ok: bool = True) -> list[Request]:
        """A load of ``session`` landed (or failed); returns the requests now ready.

        Unknown sessions are ignored (``[]``).
        """
        ...

    def cancel(self, request_id: str, now: float) -> bool:
        """Withdraw a queued request (its client went away): it is never handed out, and
        a load that no other queued request waits for and that has not started never
        starts; a load in flight still ends with :meth:`load_finished`. Returns whether
        the request was queued."""
        ...

    def pop_ready(self, now: float) -> Request | None:
        """The next request to run, or ``None`` if none may run now."""
        ...

    def next_batch(
        self, now: float, token_budget: int, max_requests: int | None = None
    ) -> list[Request]:
        """Requests to run together, in order, whose ``tokens`` add up to at most
        ``token_budget``; the first one is handed out even if it alone exceeds the budget
        (it would starve otherwise)."""
        ...

    def waiting(self, limit: int | None = None) -> list[str]:
        """Sessions of queued requests (not yet handed out), in expected run order."""
        ...

    def ready_sessions(self) -> Set[str]:
        """Sessions of queued requests whose KV is expected in the top tier."""
        ...

    def __len__(self) -> int:
        """Requests submitted and not yet handed out."""
        ...
