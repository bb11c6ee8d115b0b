"""The simulated GPU: continuous batching of prefills and decodes, with a decode stretch
advanced in closed form.

Between two events the running batch is fixed and a decode iteration's time grows linearly
with the tokens held (each request adds one per iteration), so ``m`` iterations take
``m * (w + k * S0) + k * n * m * (m - 1) / 2`` (plus the compute-bound stretch when the
batch's FLOPs dominate): the GPU jumps to the next completion. An event that may let a new
request run interrupts the stretch at the end of the iteration in progress.

What a request needs (its history loaded, fetched, or recomputed) is the engine's
business: the GPU asks it through :class:`Engine`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Protocol

import numpy as np
import numpy.typing as npt

from .costmodel import CostModel

__all__ = ["GPU", "Engine"]

_IDLE, _PREFILL, _DECODE = 0, 1, 2


class Engine(Protocol):
    """What the GPU asks of the engine around it."""

    def hand_out(self, now: float, free: int) -> list[int]:
        """Rows (turns) the scheduler hands out now, at most ``free`` of them."""
        ...

    def admit(self, row: int, now: float) -> int | None:
        """Tokens the prefill of ``row`` computes (``None``: its KV is being fetched, the
        row waits)."""
        ...

    def prefill(self, row: int, now: float) -> tuple[int, int, int, float]:
        """``row``'s prefill starts: (tokens computed, history tokens cached, bytes copied
        host -> GPU, extra FLOPs (re-projecting cached activations))."""
        ...

    def complete(self, row: int, now: float) -> None:
        """``row``'s last token is out."""
        ...

    def queued(self) -> bool:
        """Requests wait in the scheduler (not handed out)."""
        ...


class GPU:
    """One GPU serving the engine's requests.

    :param engine: the engine that hands out and completes requests
    :param cost: step times
    :param need: per row, the GPU K/V tokens it holds while it runs (history, query, answer)
    :param context: per row, the tokens after its prefill (history + query)
    :param answer: per row, answer tokens (at least 1)
    :param first_token: per row, filled with the time of its first token
    :param push: schedules a GPU event: ``push(when, generation)``
    :param token_budget: tokens one prefill iteration computes at most
    :param max_seqs: requests in the running batch at most
    :param layerwise_overlap: host -> GPU copies overlap prefill layer by layer
    :param blocking_loads: the GPU waits, idle, while the request to run next loads
    """

    __slots__ = (
        "_a",
        "_admit",
        "_admit_head",
        "_answer",
        "_blocking",
        "_budget",
        "_context",
        "_cost",
        "_ctx0",
        "_engine",
        "_first_token",
        "_gen",
        "_iter",
        "_layerwise",
        "_max_seqs",
        "_need",
        "_phase",
        "_phase_start",
        "_prefill_rows",
        "_push",
        "_running",
        "_seg_interrupted",
        "_seg_m",
        "_tokens",
        "busy",
    )

    def __init__(
        self,
        engine: Engine,
        cost: CostModel,
        *,
        need: list[int],
        context: list[int],
        answer: list[int],
        first_token: npt.NDArray[np.float64],
        push: Callable[[float, int], None],
        token_budget: int,
        max_seqs: int,
        layerwise_overlap: bool,
        blocking_loads: bool,
    ) -> None:
        self._engine = engine
        self._cost = cost
        self._need = need
        self._context = context
        self._answer = answer
        self._first_token = first_token
        self._push = push
        self._budget = token_budget
        self._max_seqs = max_seqs
        self._layerwise = layerwise_overlap
        self._blocking = blocking_loads
        self._phase = _IDLE
        self._gen = 0
        self.busy = 0.0
        """Seconds computed so far."""
        self._admit: list[int] = []  # rows handed out, waiting for GPU memory
        self._admit_head = 0
        self._tokens = 0  # K/V tokens reserved by admitted rows
        self._prefill_rows: list[int] = []
        self._phase_start = 0.0
        # running batch: heap of (end_iteration, row); iteration counter G; sum A
        self._running: list[tuple[int, int]] = []
        self._ctx0: dict[int, int] = {}  # row -> (context at admission - G at admission)
        self._iter = 0
        self._a = 0
        self._seg_m = 0
        self._seg_interrupted = False

    # -- events -------------------------------------------------------------------------
    def poke(self, now: float) -> None:
        """Something may have become ready: pick it up at the next iteration boundary."""
        if self._phase == _IDLE:
            self._schedule(now)
        elif (
            self._phase == _DECODE
            and not self._seg_interrupted
            and self._admit_head >= len(self._admit)
            and len(self._running) < self._max_seqs
        ):
            self._interrupt(now)

    def fetched(self, now: float) -> None:
        """The KV a handed-out row waited for landed: stop the decode stretch at the end of
        the iteration in progress, so that the row may run next."""
        if self._phase == _DECODE and not self._seg_interrupted:
            self._interrupt(now)

    def step_done(self, gen: int, now: float) -> None:
        """A GPU event: the prefill or decode stretch of generation ``gen`` ended (ignored
        if superseded by an interruption)."""
        if gen != self._gen:
            return
        self.busy += now - self._phase_start
        if self._phase == _PREFILL:
            it = self._iter
            for row in self._prefill_rows:
                self._first_token[row] = now
                answer = self._answer[row]
                if answer <= 1:
                    self._complete(row, now)
                    continue
                ctx = self._context[row] + 1
                heapq.heappush(self._running, (it + answer - 1, row))
                self._ctx0[row] = ctx - it
                self._a += ctx - it
            self._prefill_rows = []
        elif self._phase == _DECODE:
            self._iter += self._seg_m
            running = self._running
            while running and running[0][0] <= self._iter:
                _, row = heapq.heappop(running)
                self._a -= self._ctx0.pop(row)
                self._complete(row, now)
        self._phase = _IDLE
        self._schedule(now)

    # -- batching -----------------------------------------------------------------------
    def _complete(self, row: int, now: float) -> None:
        self._tokens -= self._need[row]
        self._engine.complete(row, now)

    def _schedule(self, now: float) -> None:
        engine = self._engine
        if self._admit_head >= len(self._admit):
            self._admit = []
            self._admit_head = 0
            free = self._max_seqs - len(self._running)
            if free > 0:
                self._admit = engine.hand_out(now, free)
        batch: list[int] = []
        tokens = 0
        fetching = False
        capacity = self._cost.gpu_kv_tokens
        while self._admit_head < len(self._admit):
            row = self._admit[self._admit_head]
            new = engine.admit(row, now)
            if new is None:
                fetching = True  # handed out, but its KV is fetched on the spot: it waits
                break
            need = self._need[row]
            fits = self._tokens + need <= capacity or (not self._running and not batch)
            if not fits or (batch and tokens + new > self._budget):
                break
            self._admit_head += 1
            self._tokens += need
            tokens += new
            batch.append(row)
        if batch:
            self._prefill(batch, now)
        elif self._running and not (self._blocking and self._stalled(fetching)):
            self._decode(now)

    def _stalled(self, fetching: bool) -> bool:
        """Whether the request to run next waits for a load although the batch has room:
        the engine is fetching a handed-out request's KV, or the scheduler holds its head
        back for a load. A GPU with ``blocking_loads`` then waits, idle."""
        return fetching or (
            self._admit_head >= len(self._admit)
            and len(self._running) < self._max_seqs
            and self._engine.queued()
        )

    def _prefill(self, rows: list[int], now: float) -> None:
        cost = self._cost
        engine = self._engine
        flops = 0.0
        link_bytes = 0
        for row in rows:
            new, cached, copied, extra = engine.prefill(row, now)
            link_bytes += copied
            if extra:
                flops += extra
            flops += cost.prefill_flops(new, cached)
        compute = cost.compute_time(flops)
        link = cost.link_time(link_bytes)
        duration = max(compute, link) if self._layerwise else compute + link
        duration += cost.iteration_overhead
        self._prefill_rows = rows
        self._begin(_PREFILL, now, now + duration)

    def _begin(self, phase: int, now: float, end: float) -> None:
        self._phase = phase
        self._phase_start = now
        self._gen += 1
        self._push(end, self._gen)

    # -- decode in closed form ------------------------------------------------------------
    def _seg_time(self, m: int) -> float:
        """Seconds for the next ``m`` decode iterations of the current batch."""
        if m <= 0:
            return 0.0
        cost = self._cost
        n = len(self._running)
        k = cost.kv_token_s
        mem0 = cost.weights_s + k * (self._a + n * self._iter)
        step = k * n
        comp = cost.decode_compute_s(n)
        total = m * cost.iteration_overhead
        j = 0
        if comp > mem0:  # the first iterations are compute-bound
            j = min(m, int(-(-(comp - mem0) // step)) if step > 0 else m)
            total += j * comp
        if j < m:
            cnt = m - j
            first = mem0 + step * j
            total += cnt * first + step * cnt * (cnt - 1) / 2
        return total

    def _decode(self, now: float) -> None:
        m = self._running[0][0] - self._iter
        self._seg_m = m
        self._seg_interrupted = False
        self._begin(_DECODE, now, now + self._seg_time(m))

    def _interrupt(self, now: float) -> None:
        elapsed = now - self._phase_start
        lo, hi = 0, self._seg_m  # largest m with seg_time(m) <= elapsed
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._seg_time(mid) <= elapsed:
                lo = mid
            else:
                hi = mid - 1
        m = lo + 1
        self._seg_interrupted = True
        if m >= self._seg_m:
            return
        self._seg_m = m
        self._gen += 1
        self._push(self._phase_start + self._seg_time(m), self._gen)
