"""A multi-turn serving loop over a real model, real tiers and the library's policies.

:class:`ServingEngine` accepts concurrent multi-turn requests and runs them one at a time on
one model (one "GPU"; on CPU here), with:

* a :class:`~tieredkv.policies.scheduling.Scheduler` that decides which request runs next
  and which KV loads (SSD -> host memory, through :meth:`TieredKVCache.prefetch`) start,
  as Bidaw's compute engine does: the engine only ever runs *ready* requests;
* a :class:`~tieredkv.TieredKVCache` over real tiers whose eviction policy reads the same
  metadata channel (and never evicts the scheduler's ready sessions);
* a model adapter (:class:`~tieredkv.serve.adapter.ChatAdapter`, such as
  :class:`~tieredkv.integrations.transformers.TransformersAdapter`) that restores each
  conversation's history from the cache, prefills the query, decodes the answer greedily
  and stores the turn's new KV (or, in ``recompute`` mode, prefills the whole history every
  turn, as a server without a KV cache does). The loop knows nothing of the model library
  behind it.

Each request's timeline is measured on the wall clock: arrival (when the load generator
submits it), start (when the model begins it), end (last token). Queueing time is
start - arrival; latency is end - arrival.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.abc
import msgspec
import numpy as np

from ..cache import TieredKVCache
from ..errors import SessionNotFoundError, TieredKVError
from ..meta import RetentionHint
from ..policies.scheduling import Request, Scheduler
from .adapter import ChatAdapter, RecomputingAdapter

__all__ = ["ServedTurn", "ServingEngine", "TurnRequest"]

_log = logging.getLogger(__name__)


class TurnRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One turn to serve.

    :param session: the conversation
    :param query: the new query's token ids
    :param answer_tokens: how many tokens the model generates
    :param last: the conversation ends after this turn (its KV is dropped)
    :param hint: what the caller knows of the conversation's future
        (:class:`~tieredkv.meta.RetentionHint`: the expected time to its next turn, a pin,
        a priority, a tool call), handed to the adapter's ``chat_turn`` (``hint=``), which
        applies it once the turn is stored; not given to an adapter when ``None``, nor
        in ``recompute`` mode (nothing is stored there). :meth:`ServingEngine.run` refuses
        hints (``TypeError``) for an adapter whose ``chat_turn`` takes none
    """

    session: str
    query: tuple[int, ...]
    answer_tokens: int
    last: bool = False
    hint: RetentionHint | None = None


class ServedTurn(msgspec.Struct, frozen=True, kw_only=True):
    """What happened to one request (times in seconds on the engine's clock).

    :param session: the conversation
    :param arrival: when it was submitted
    :param start: when the model began it
    :param end: when its last answer token was produced and its KV stored (after a
        conversation's last turn its KV is dropped instead, in the background)
    :param host_hit: its history was in the performance tier at arrival (``None``: no
        history, a first turn)
    :param restored_tokens: history tokens restored from the cache
    :param recomputed_tokens: history tokens recomputed (no cache, or KV lost)
    :param answer: the generated token ids
    :param restore: seconds of the turn spent restoring its history into the model cache
    :param compute: seconds of the turn spent in the model (prefill and decoding)
    :param store: seconds of the turn spent appending its KV to the cache (the three as
        the adapter's result reports them, ``restore_seconds`` and so on; 0 if it does not)
    """

    session: str
    arrival: float
    start: float
    end: float
    host_hit: bool | None
    restored_tokens: int
    recomputed_tokens: int
    answer: tuple[int, ...]
    restore: float = 0.0
    compute: float = 0.0
    store: float = 0.0

    @property
    def queueing(self) -> float:
        """Seconds from arrival to start."""
        return self.start - self.arrival

    @property
    def latency(self) -> float:
        """Seconds from arrival to the last token."""
        return self.end - self.arrival

    @property
    def service(self) -> float:
        """Seconds from start to end: the time the model spent on this turn."""
        return self.end - self.start


class ServingEngine:
    """Serve multi-turn requests with a scheduler, a tiered cache and a model adapter.

    :param adapter: the model adapter: ``TransformersAdapter``, or any
        :class:`~tieredkv.serve.adapter.ChatAdapter` (a
        :class:`~tieredkv.serve.adapter.RecomputingAdapter` with ``recompute``), whose
        ``await chat_turn(cache, session, query, max_new_tokens=, history=)`` returns the
        answer, ``restored_tokens`` and ``recomputed_tokens``, and optionally the phase
        timings ``restore_seconds``, ``compute_seconds``, ``store_seconds``
    :param cache: the tiered cache (open it before :meth:`run`)
    :param scheduler: decides what runs and what loads, e.g. ``FCFS()`` or
        ``BidawScheduler()``
    :param recompute: never restore KV: prefill the whole history every turn (the
        no-cache baseline, the adapter's ``recompute``); the cache is then only used to
        hold nothing
    :param clock: time source (``time.monotonic``)
    :param lookahead: how many waiting sessions to publish on the metadata channel (for
        queue-aware eviction)
    :param layerwise: a load the scheduler starts is the request's turn itself: it
        restores its history layer by layer into the model's cache (promoting it to host
        memory on the way) while the model runs other turns, and computes once handed
        the model; when the model would idle (nothing ready) while such a turn is still
        reading, the engine counts its load as landed, so that the scheduler may hand it
        out and it computes on the layers already in while the rest streams in
        (CachedAttention's layer-wise pre-loading). Needs an adapter that streams and
        takes ``before_compute``/``on_loaded`` in ``chat_turn`` (``adapter.layerwise``
        true, as ``TransformersAdapter(model, layerwise=True)``)
    :param predictive: (beyond the paper) while the model idles, no request waits and no
        load is under way, let the cache bring up the sessions its eviction policy expects back soon
        (:meth:`TieredKVCache.prefetch_predicted`; a no-op unless tier 0's policy
        implements :class:`~tieredkv.policies.base.Foresight`, as Bidaw's does). Tried
        again only after a request arrives or a turn ends, if it found nothing to do
    """

    def __init__(
        self,
        adapter: ChatAdapter,
        cache: TieredKVCache,
        scheduler: Scheduler,
        *,
        recompute: bool = False,
        clock: Callable[[], float] = time.monotonic,
        lookahead: int = 30,
        layerwise: bool = False,
        predictive: bool = False,
    ) -> None:
        if layerwise and (recompute or not getattr(adapter, "layerwise", False)):
            raise TypeError(
                "layerwise=True runs turns whose history streams in while they compute: give "
                "an adapter that streams (TransformersAdapter(model, layerwise=True)), and "
                "no recompute"
            )
        self.layerwise = layerwise
        self.adapter = adapter
        self.cache = cache
        self.scheduler = scheduler
        if recompute and not isinstance(adapter, RecomputingAdapter):
            raise TypeError(
                f"recompute=True prefills every turn's whole conversation with the adapter: "
                f"{type(adapter).__name__} needs an async recompute(tokens, max_new_tokens=) "
                f"method (see RecomputingAdapter)"
            )
        self.recompute = recompute
        self._clock = clock
        self._lookahead = lookahead
        self._history: dict[str, list[int]] = {}
        # request id -> (turn, arrival, host hit, set when it is done)
        self._pending: dict[str, tuple[TurnRequest, float, bool | None, anyio.Event]] = {}
        self._results: list[ServedTurn] = []
        self._changed = anyio.Event()
        self._busy = False
        self._running: set[str] = set()  # sessions of the turns the model is running
        self._dropping: dict[str, anyio.Event] = {}  # ended conversations' KV being dropped
        self._ids = 0
        self.ssd_loads = 0
        """Prefetches that moved a history up from a lower tier."""
        self.streamed = 0
        """Turns the model started before their history was all in (layer-wise)."""
        self._preloading: dict[str, anyio.Event] = {}  # session -> its turn's go-ahead
        self.predictive = predictive
        self.predicted = 0
        """Sessions brought up by predictive prefetch."""
        self._loading = 0  # prefetches under way
        self._predicting = False
        self._epoch = 0  # arrivals and ended turns so far
        self._fruitless = -1  # the epoch of the last predictive prefetch that found nothing

    def _notify(self) -> None:
        self._changed.set()

    async def run(self, arrivals: Sequence[tuple[float, TurnRequest]]) -> list[ServedTurn]:
        """Replay ``arrivals`` ((offset in seconds from now, request), sorted by offset).

        A conversation's next turn is submitted no earlier than its previous turn's end (a
        user reads the answer before asking again): its arrival is then that end.
        :returns: one :class:`ServedTurn` per request, in completion order
        """
        if not arrivals:
            return []
        if not self.recompute and any(turn.hint is not None for _, turn in arrivals):
            _check_takes_hints(self.adapter)
        # ready requests' KV, and the running turns' (between their load and their append)
        ready_sessions = self.scheduler.ready_sessions
        self.cache.set_protected(lambda: ready_sessions() | self._running)
        start = self._clock()
        total = len(arrivals)
        self._results = []
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._arrive, arrivals, start)
                while len(self._results) < total:
                    now = self._clock()
                    ready = None
                    if not self._busy:
                        ready = self.scheduler.pop_ready(now)
                    # (an on-demand scheduler starts its head's load once asked for work)
                    self._start_loads(now, tg)
                    if ready is None and not self._busy and self._preloading:
                        ready = self._stop_waiting(now)
                    self.cache.channel.publish_waiting(self.scheduler.waiting(self._lookahead))
                    if ready is not None:
                        self._busy = True
                        preloading = self._preloading.pop(ready.session, None)
                        if preloading is not None:
                            preloading.set()  # its history is (partly) in: compute now
                        else:
                            tg.start_soon(self._serve, ready, tg, None)
                        continue
                    if self._may_predict():
                        self._predicting = True
                        tg.start_soon(self._predict)
                    await self._changed.wait()
                    self._changed = anyio.Event()
        finally:
            self.cache.set_protected(None)
        return self._results

    def _start_loads(self, now: float, tg: anyio.abc.TaskGroup) -> None:
        """Start the loads the scheduler asks for: prefetches into host memory, or with
        ``layerwise`` the requests' turns themselves, which stream their histories into the
        model's cache and wait for the model (:meth:`_stop_waiting` and the run loop hand
        them the model)."""
        for request in self.scheduler.start_loads(now):
            if not self.layerwise:
                tg.start_soon(self._load, request.session)
                continue
            go = anyio.Event()
            self._preloading[request.session] = go
            tg.start_soon(self._serve, request, tg, go)

    def _stop_waiting(self, now: float) -> Request | None:
        """The model would idle while turns restore their histories: report the oldest
        one's load landed, so the scheduler may hand it out and it computes on the layers
        already in while the rest streams in."""
        session = next(iter(self._preloading))
        self.scheduler.load_finished(session, now, ok=True)
        ready = self.scheduler.pop_ready(now)
        if ready is not None and ready.session in self._preloading:
            self.streamed += 1
        return ready

    def _may_predict(self) -> bool:
        """Whether to look for a session to bring up predictively now: asked for, the model
        idle, nothing waiting or loading, and something happened since the last fruitless
        look."""
        return (
            self.predictive
            and not self._busy  # the model idles too: the copies would slow its turn
            and not self._predicting
            and not self._loading
            and not self._preloading
            and self._epoch != self._fruitless
            and not self.scheduler.waiting(1)
        )

    async def _predict(self) -> None:
        epoch = self._epoch
        try:
            promoted = await self.cache.prefetch_predicted()
        except (TieredKVError, OSError) as exc:
            # the session stays where it was; its request loads it as usual
            _log.warning("predictive prefetch failed (its request will load it): %s", exc)
            promoted = []
        finally:
            self._predicting = False
        self.predicted += len(promoted)
        if not promoted:
            self._fruitless = epoch
        self._notify()

    def _loaded(self, session: str) -> None:
        """A turn's history is in (or gone: it recomputes): its load has landed."""
        self.scheduler.load_finished(session, self._clock(), ok=True)
        self._notify()

    async def _arrive(self, arrivals: Sequence[tuple[float, TurnRequest]], start: float) -> None:
        busy: dict[str, anyio.Event] = {}
        for offset, turn in arrivals:
            delay = start + offset - self._clock()
            if delay > 0:
                await anyio.sleep(delay)
            previous = busy.get(turn.session)
            if previous is not None and not previous.is_set():
                await previous.wait()  # this user is still reading the last answer
            busy[turn.session] = done = anyio.Event()
            self._submit(turn, done)

    def _submit(self, turn: TurnRequest, done: anyio.Event) -> None:
        now = self._clock()
        # a new conversation under the name of an ended one whose KV is still being dropped
        ended = turn.session in self._dropping
        where = None if ended else self.cache.where(turn.session)
        first_turn = where is None and turn.session not in self._history
        hit = None if first_turn else where == self.cache.tiers[0].name
        self._ids += 1
        rid = str(self._ids)
        self._pending[rid] = (turn, now, hit, done)
        self._epoch += 1
        tokens = len(self._history.get(turn.session, ())) + len(turn.query)
        self.scheduler.submit(
            Request(id=rid, session=turn.session, arrival=now, tokens=tokens),
            now,
            self.cache.channel,
        )
        self._notify()

    async def _load(self, session: str) -> None:
        ok = True
        self._loading += 1
        try:
            before = self.cache.where(session)
            after = await self.cache.prefetch(session)
            if before != after:
                self.ssd_loads += 1
        except (SessionNotFoundError, TieredKVError, OSError):
            ok = False  # the request will recompute its history
        finally:
            self._loading -= 1
        self.scheduler.load_finished(session, self._clock(), ok=ok)
        self._notify()

    async def _serve(
        self, request: Request, tg: anyio.abc.TaskGroup, go: anyio.Event | None
    ) -> None:
        """Run one turn; an ended conversation's KV is dropped in ``tg``, after the turn.

        With ``go`` (layer-wise), the turn is started as its request's load: it restores
        its history and waits for ``go`` (the model) before computing.
        """
        turn, arrival, hit, done = self._pending.pop(request.id)
        began = self._clock()
        started = go is None  # the model is this turn's (else once go is set)
        dropping = self._dropping.get(turn.session)
        if dropping is not None:  # a new conversation under an ended one's name
            await dropping.wait()
        history = self._history.setdefault(turn.session, [])
        self._running.add(turn.session)
        hooks: dict[str, Any] = {} if turn.hint is None else {"hint": turn.hint}
        if go is not None:

            async def wait_for_model() -> None:
                nonlocal began, started
                await go.wait()
                began, started = self._clock(), True

            hooks["before_compute"] = wait_for_model
            hooks["on_loaded"] = lambda: self._loaded(turn.session)
        try:
            if self.recompute:
                answer, restored, recomputed = await self._recompute(turn, history)
                phases = (0.0, self._clock() - began, 0.0)  # restore, compute, store
            else:
                result = await self.adapter.chat_turn(
                    self.cache,
                    turn.session,
                    list(turn.query),
                    max_new_tokens=turn.answer_tokens,
                    history=history,
                    **hooks,
                )
                answer = tuple(result.answer)
                restored, recomputed = result.restored_tokens, result.recomputed_tokens
                # an adapter that does not time its phases leaves them at 0
                phases = (
                    float(getattr(result, "restore_seconds", 0.0)),
                    float(getattr(result, "compute_seconds", 0.0)),
                    float(getattr(result, "store_seconds", 0.0)),
                )
            history.extend(turn.query)
            history.extend(answer)
            if turn.last:
                self._history.pop(turn.session, None)
                if turn.session in self.cache.channel:
                    # the answer is complete: drop the KV after the turn, not in it (an
                    # SSD tier's drop deletes files, milliseconds the model need not wait)
                    self._dropping[turn.session] = dropped = anyio.Event()
                    tg.start_soon(self._drop, turn.session, dropped)
            end = self._clock()
            self._results.append(
                ServedTurn(
                    session=turn.session,
                    arrival=arrival,
                    start=began,
                    end=end,
                    host_hit=hit,
                    restored_tokens=restored,
                    recomputed_tokens=recomputed,
                    answer=answer,
                    restore=phases[0],
                    compute=phases[1],
                    store=phases[2],
                )
            )
        finally:
            self._running.discard(turn.session)
            if started:
                self._busy = False
            self._epoch += 1
            done.set()
            self._notify()

    async def _drop(self, session: str, dropped: anyio.Event) -> None:
        try:
            await self.cache.drop(session)
        except (TieredKVError, OSError):
            # the conversation has ended: its KV is garbage, and serving goes on
            _log.warning("could not drop the KV of ended conversation %r", session, exc_info=True)
        finally:
            if self._dropping.get(session) is dropped:
                del self._dropping[session]
            dropped.set()

    async def _recompute(
        self, turn: TurnRequest, history: list[int]
    ) -> tuple[tuple[int, ...], int, int]:
        """Prefill history + query with no cache, decode; nothing is stored."""
        adapter = self.adapter
        assert isinstance(adapter, RecomputingAdapter)  # checked in __init__
        tokens = history + list(turn.query)
        answer = await adapter.recompute(tokens, max_new_tokens=turn.answer_tokens)
        return tuple(answer), 0, len(history)


def _check_takes_hints(adapter: ChatAdapter) -> None:
    """A turn carries a retention hint: the adapter's ``chat_turn`` must take ``hint=``."""
    params = inspect.signature(adapter.chat_turn).parameters
    takes = "hint" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if not takes:
        raise TypeError(
            f"a TurnRequest carries a retention hint, but {type(adapter).__name__}."
            f"chat_turn takes no hint= argument: give it one (applied once the turn is "
            f"stored, as TransformersAdapter.chat_turn does), or send the turns without hints"
        )


def model_stall(results: Sequence[ServedTurn]) -> float:
    """Seconds the model sat idle while a submitted request waited.

    With one turn at a time, a request waits either behind a running turn (queueing: the
    model is busy) or for nothing the model can do: its history's load from a lower tier
    (or, under FCFS, the head's load). This counts the second kind, summed over the run:
    every stretch in which no turn ran and some request had arrived that had not started.
    Loads that a scheduler hides behind other turns do not count; loads the model waits
    for do.
    """
    served = sorted(results, key=lambda r: r.start)
    # earliest arrival among the turns that start at or after each one
    waiting_since = list(itertools.accumulate(reversed([r.arrival for r in served]), min))[::-1]
    stall = 0.0
    idle_from = -math.inf  # when the model last finished a turn
    for r, since in zip(served, waiting_since, strict=True):
        stall += max(0.0, r.start - max(idle_from, since))
        idle_from = max(idle_from, r.end)
    return stall


def summarize(results: Sequence[ServedTurn]) -> dict[str, float]:
    """Mean/percentile latency and queueing, the host hit ratio at arrival, the seconds
    the model stalled with requests waiting (:func:`model_stall`), and the mean seconds a
    turn took (service) and spent restoring, computing and storing."""
    if not results:
        return {}
    lat = np.array([r.latency for r in results])
    queue = np.array([r.queueing for r in results])
    hits = [r.host_hit for r in results if r.host_hit is not None]
    return {
        "requests": float(len(results)),
        "latency_mean": float(lat.mean()),
        "latency_p50": float(np.percentile(lat, 50)),
        "latency_p90": float(np.percentile(lat, 90)),
        "latency_p99": float(np.percentile(lat, 99)),
        "queueing_mean": float(queue.mean()),
        "host_hit_ratio": float(sum(hits) / len(hits)) if hits else math.nan,
        "model_stall": model_stall(results),
        "service_mean": float(np.mean([r.service for r in results])),
        "restore_mean": float(np.mean([r.restore for r in results])),
        "compute_mean": float(np.mean([r.compute for r in results])),
        "store_mean": float(np.mean([r.store for r in results])),
    }
