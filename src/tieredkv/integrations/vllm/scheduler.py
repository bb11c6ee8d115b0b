"""The scheduler side: which prompts continue a stored conversation, and when to load it.

It runs in vLLM's scheduler process and holds no KV, only facts:

* a :class:`~.index.PrefixIndex` of the stored conversations' block hashes (rebuilt from the
  worker's sidecars at start, then kept by the worker's reports);
* a mirror of the worker cache's metadata channel (:class:`~tieredkv.meta.MetadataChannel`:
  where each conversation's KV is, its size, its last answer length), fed by the same
  reports; it is what the load scheduler reads;
* the load scheduler itself, the same pure policy object the simulator and the serving
  loop run (:class:`~tieredkv.policies.BidawScheduler`'s disk-HRRN or FCFS): a request
  whose history is below host memory waits in vLLM's waiting-for-remote-KV state, and
  the policy decides which of the waiting loads the workers start, ``max_loads`` at a
  time, while vLLM computes the other requests.

Everything here is synchronous and takes plain values (token ids, block ids, request
ids), so it is tested without an engine; :mod:`.connector` adapts vLLM's objects to it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from ...meta import KVMeta, MetadataChannel, RetentionHint, TierInfo
from ...policies.registry import make_scheduler
from ...policies.scheduling import Request, kv_needs_load
from .config import ConnectorConfig
from .index import PrefixIndex, read_sidecars
from .keys import PLAIN, RequestKeys, session_key
from .ops import LoadOp, SaveOp, StepPlan, WorkerReport
from .worker import HOST, REDIS, SSD, decode_meta, sidecar_dir

__all__ = ["SAVE_WAIT", "Phase", "SchedulerSide"]

SAVE_WAIT = 5.0
"""Seconds a prompt waits, at most, for the turn it continues to be reported stored."""

_log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass
class _Match:
    session: str
    local: int  # blocks vLLM holds itself
    blocks: int  # blocks matched in the store
    sync: bool  # loaded within the step
    host: bool  # from host memory


class Phase(enum.Enum):
    """Where a request is, as the scheduler side sees it (a request it holds no entry for
    is computing, or unknown: both store their turn when they finish)."""

    MATCHED = "matched"
    """Tokens were offered from the store; vLLM has not allocated its blocks yet."""
    QUEUED = "queued"
    """Its asynchronous load waits in the load queue: no worker has been asked for it."""
    LOADING = "loading"
    """Its load is planned for the workers, or running there."""
    LOADED = "loaded"
    """The workers reported its load (filled, or failed); vLLM has not scheduled it since."""


@dataclass
class _Req:
    phase: Phase
    match: _Match | None = None
    op: LoadOp | None = None
    landed: float | None = None  # when the load its blocks wait for completed


class SchedulerSide:
    """The scheduler process's half of the connector.

    :param config: the connector's settings
    :param fp: the model/dtype/layout fingerprint
    :param block_size: tokens per vLLM block
    :param clock: time source for the load scheduler (``time.monotonic``)
    :param workers: the workers that report each save and load (vLLM's world size: each
        tensor-parallel rank stores and loads its own shard): one counts complete once
        every worker reported it, stored (or loaded) only if every worker did
    """

    def __init__(
        self,
        config: ConnectorConfig,
        fp: str,
        block_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        workers: int = 1,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1 (got {workers})")
        self.config = config
        self.workers = workers
        self.block_size = block_size
        self.clock = clock
        self.index = PrefixIndex(fp, block_size)
        self._forks = config.forks
        self.channel = MetadataChannel()
        tiers = [TierInfo(name=HOST, level=0, capacity=config.host_bytes)]
        if config.ssd_path is not None:
            tiers.append(TierInfo(name=SSD, level=len(tiers), capacity=config.ssd_bytes))
        if config.redis_url is not None:
            tiers.append(TierInfo(name=REDIS, level=len(tiers), capacity=config.redis_bytes))
        self.channel.set_tiers(tiers)
        self.policy = make_scheduler(config.scheduler, max_loads=config.max_loads)
        self._reqs: dict[str, _Req] = {}  # request -> its phase, while it has one
        self._planned: StepPlan = StepPlan()
        self._waiting: dict[str, list[LoadOp]] = {}  # session -> loads not yet planned
        self._started: dict[str, set[str]] = {}  # session -> requests of the policy's load
        self._pending_saves: dict[str, tuple[str, list[bytes]]] = {}
        self._failed: set[str] = set()
        self._deferred: dict[str, float] = {}  # request -> when it first waited for a save
        # per request, what each worker reported of its save or load, until every one did
        self._rank_stored: dict[str, dict[int, tuple[str, int, bool]]] = {}
        self._rank_loaded: dict[str, dict[int, tuple[str, bool]]] = {}
        # per conversation, each worker's placement of its shard (several workers only)
        self._rank_metas: dict[str, dict[int, KVMeta | None]] = {}
        self.withdrawn: dict[str, int] = {phase.value: 0 for phase in Phase}
        """Requests that finished (aborted, mostly) while waiting for KV, per phase."""
        self.finished_requests = 0
        """Requests vLLM finished so far (each exactly once)."""
        self.longest_wait = 0.0
        """Seconds, at most, between a load's completion and vLLM scheduling a request
        that waited for it (the scheduler side's own bookkeeping of waiters)."""
        self.from_host: dict[str, bool] = {}
        """Per request with a load planned: whether it comes from host memory (vLLM's
        per-source hit counts read it once)."""
        directory = sidecar_dir(config)
        if directory is not None:
            now = clock()
            for sidecar in read_sidecars(directory, fp):
                hashes = self.index.hashes(sidecar.tokens, sidecar.keys)
                if not hashes:
                    continue
                self.index.put(sidecar.session, hashes)
                # after a restart host memory is empty: the history is on the SSD
                self.channel.put(
                    KVMeta(
                        session=sidecar.session,
                        tier=SSD,
                        copies=(SSD,),
                        tokens=len(hashes) * block_size,
                        nbytes=len(hashes) * block_size,
                        last_access=now,
                        created=now,
                    )
                )

    # -- matching ------------------------------------------------------------------------
    def match(
        self, req_id: str, tokens: Sequence[int], local_tokens: int, keys: RequestKeys = PLAIN
    ) -> tuple[int | None, bool]:
        """Tokens of this prompt beyond ``local_tokens`` that a stored conversation holds,
        and whether they load asynchronously (the history is below host memory). Only a
        history stored under the same ``keys`` (adapter, salt, multimodal inputs) matches.

        The last prompt token is never counted (vLLM must compute at least one), and a
        request whose load failed once is never offered a load again (it recomputes:
        no livelock, vLLM #49176). ``None`` (vLLM asks again at its next step) while a
        turn that shares more of this prompt than the stored conversations do is still
        being stored, for at most ``SAVE_WAIT`` seconds: a client that sends its next
        turn, or a fork of it, at once then finds it.
        """
        self._reqs.pop(req_id, None)  # vLLM asks again (preempted, or a failed load)
        if req_id in self._failed or not (len(self.index) or self._pending_saves):
            return 0, False
        hashes = self.index.hashes(tokens[: max(0, len(tokens) - 1)], keys)
        session, blocks = self.index.match(hashes)
        local = local_tokens // self.block_size
        if self._waits_for_a_pending_save(req_id, hashes, max(blocks, local)):
            return None, False
        if session is None or blocks <= local:
            return 0, False
        meta = self.channel.get(session)
        host = not kv_needs_load(meta, self.channel)
        sync = host or (
            self.config.layerwise
            and meta is not None
            and meta.nbytes <= self.config.sync_load_bytes
        )
        m = _Match(session, local, blocks, sync, host)
        self._reqs[req_id] = _Req(Phase.MATCHED, match=m)
        return (blocks - local) * self.block_size, not sync

    def _waits_for_a_pending_save(self, req_id: str, hashes: Sequence[bytes], have: int) -> bool:
        """Whether a turn not yet reported stored shares more than ``have`` blocks of the
        prompt (and the prompt has not waited ``SAVE_WAIT`` yet)."""
        if not self._pending_saves:
            self._deferred.pop(req_id, None)
            return False
        now = self.clock()
        since = self._deferred.setdefault(req_id, now)
        if now - since > SAVE_WAIT:
            return False
        for _, saved in self._pending_saves.values():
            if _shared(saved, hashes) > have:
                return True
        self._deferred.pop(req_id, None)
        return False

    def allocated(
        self, req_id: str, tokens: Sequence[int], block_ids: Sequence[int], external: int
    ) -> None:
        """vLLM allocated the request's blocks, ``external`` tokens of them from the store
        (0: none, or the request's load already finished and vLLM schedules it now)."""
        r = self._reqs.pop(req_id, None)
        if r is not None and r.landed is not None:
            self.longest_wait = max(self.longest_wait, self.clock() - r.landed)
        if r is None or r.match is None or external <= 0:
            return  # it computes
        m = r.match
        blocks = m.local + external // self.block_size
        op = LoadOp(
            req_id=req_id,
            session=m.session,
            block_ids=tuple(block_ids[:blocks]),
            first=m.local,
            blocks=blocks,
            tokens=tuple(tokens[: blocks * self.block_size]),
            sync=m.sync,
            host=m.host,
        )
        self.from_host[req_id] = m.host
        if m.sync:  # filled within this step, before vLLM computes from it
            self._planned.loads.append(op)
            return
        now = self.clock()
        self._reqs[req_id] = _Req(Phase.QUEUED, op=op)
        self.policy.submit(
            Request(id=req_id, session=m.session, arrival=now, tokens=len(tokens)),
            now,
            self.channel,
        )
        self._waiting.setdefault(m.session, []).append(op)
        self._start_loads(now)

    def phase(self, req_id: str) -> Phase | None:
        """The request's phase (``None``: computing, or unknown)."""
        r = self._reqs.get(req_id)
        return None if r is None else r.phase

    def _plan_load(self, op: LoadOp) -> None:
        self._reqs[op.req_id] = _Req(Phase.LOADING, op=op)
        self._planned.loads.append(op)

    def _start_loads(self, now: float) -> None:
        for request in self.policy.start_loads(now):
            # every queued request of the session waits for this one load
            ops = self._waiting.pop(request.session, [])
            self._started.setdefault(request.session, set()).update(op.req_id for op in ops)
            for op in ops:
                self._plan_load(op)
            if not ops:  # nothing to fill: close the policy's load at once
                self._finish_load(request.session, now, ok=True)
        self.channel.publish_waiting(self.policy.waiting())

    def _finish_load(self, session: str, now: float, *, ok: bool) -> None:
        """The policy's load of ``session`` ended: every request that waited for it is
        released. Those that joined it while it ran have blocks of their own to fill:
        their loads are planned now (the history is in host memory if it landed)."""
        released = {r.id for r in self.policy.load_finished(session, now, ok=ok)}
        while self.policy.pop_ready(now) is not None:
            pass  # vLLM runs them; the policy only orders the loads
        waiting = self._waiting.pop(session, [])
        left = [op for op in waiting if op.req_id not in released]
        if left:  # not this load's (a policy releases every request of a session's load)
            self._waiting[session] = left
        for op in waiting:
            if op.req_id in released:
                self._plan_load(op)
                self._reqs[op.req_id].landed = now

    # -- finishing -----------------------------------------------------------------------
    def finished(
        self,
        req_id: str,
        tokens: Sequence[int],
        block_ids: Sequence[int],
        computed: int,
        answer_tokens: int,
        keys: RequestKeys = PLAIN,
        hint: RetentionHint | None = None,
        tenant: str = "",
    ) -> bool:
        """vLLM is done with the request (finished, or aborted, in any phase): with KV for
        its first ``computed`` tokens in ``block_ids`` if it was computing.

        A request that was still waiting for its load stores nothing (its blocks may not
        hold what vLLM counts as computed): a load still queued is withdrawn (the workers
        report the request finished receiving once, see :attr:`StepPlan.cancelled`), one
        already asked of the workers ends as they report it. A computing request's new
        full blocks are planned to be stored as its conversation's next turn (a new
        conversation when it continues none, only part of one, or one whose next turn
        another request is storing: with ``forks`` on, one that continues part of a
        stored conversation is a fork of it, storing its own blocks only). Returns
        whether a save was planned: its blocks must then stay allocated until the worker
        copied them.

        ``hint`` (the request's retention hint) goes with the save, for the conversation
        the turn is stored in; a computing request that stores nothing new (its turn is
        stored already) hints the stored conversation its prompt continues whole; either
        way with the request's ``tenant`` (:attr:`~.ops.SaveOp.tenant`).
        """
        self.finished_requests += 1
        r = self._reqs.pop(req_id, None)
        self._failed.discard(req_id)
        self._deferred.pop(req_id, None)
        self.from_host.pop(req_id, None)
        if r is not None and r.phase is not Phase.MATCHED:
            self._withdraw(req_id, r)
            return False
        if self._plan_save(req_id, tokens, block_ids, computed, answer_tokens, keys, hint, tenant):
            return True
        if hint is not None:
            self._hint_stored(req_id, tokens, keys, hint, tenant)
        return False

    def _hint_stored(
        self,
        req_id: str,
        tokens: Sequence[int],
        keys: RequestKeys,
        hint: RetentionHint,
        tenant: str,
    ) -> None:
        """A request that stored nothing new hints the conversation it continues whole."""
        hashes = self.index.hashes(tokens[: max(0, len(tokens) - 1)], keys)
        session, blocks = self.index.match(hashes)
        if session is not None and blocks == self.index.blocks(session):
            self._planned.hints.append((req_id, session, hint, tenant))
        else:
            _log.info(
                "tieredkv: request %s's retention hint is not applied: it stored no turn of "
                "its own (another request stores the same one, or it was too short) and "
                "continues no stored conversation whole",
                req_id,
            )

    def _withdraw(self, req_id: str, r: _Req) -> None:
        """A request that waited for KV finished (nothing of it is stored)."""
        now = self.clock()
        self.withdrawn[r.phase.value] += 1
        self.policy.cancel(req_id, now)
        op = r.op
        if op is None:  # LOADED: the workers reported it already
            return
        if r.phase is Phase.QUEUED:
            waiting = self._waiting.get(op.session, [])
            if op in waiting:
                waiting.remove(op)
                if not waiting:
                    del self._waiting[op.session]
            self._planned.cancelled.append(req_id)
        elif op in self._planned.loads:  # planned this step, not yet sent: never sent
            self._planned.loads.remove(op)
            self._planned.cancelled.append(req_id)
            started = self._started.get(op.session)
            if started is not None and req_id in started:
                started.discard(req_id)
                if not started:
                    del self._started[op.session]
                    self._finish_load(op.session, now, ok=False)
                    self._start_loads(now)
        # else the workers load it and report it once it is done (vLLM holds its blocks
        # until then); update() closes the policy's load then
        self.channel.publish_waiting(self.policy.waiting())

    def _plan_save(
        self,
        req_id: str,
        tokens: Sequence[int],
        block_ids: Sequence[int],
        computed: int,
        answer_tokens: int,
        keys: RequestKeys,
        hint: RetentionHint | None,
        tenant: str,
    ) -> bool:
        end = min(computed, len(tokens) - 1, len(block_ids) * self.block_size) // self.block_size
        if end <= 0:
            return False
        hashes = self.index.hashes(tokens[: end * self.block_size], keys)
        if any(saved == hashes for _, saved in self._pending_saves.values()):
            return False  # the same turn (a duplicate request's) is being stored
        session, blocks = self.index.match(hashes)
        saving = {pending[0] for pending in self._pending_saves.values()}
        parent: str | None = None
        if session is not None and blocks == self.index.blocks(session) and session not in saving:
            start = blocks  # it continues the whole stored conversation
        else:
            # a new conversation: it continues none, part of one, or one whose next turn
            # another request stores now (two continuations of one conversation: each
            # keeps its own turn); continuing one, it is a fork of it (its matched blocks,
            # the same tokens under the same keys, stay stored once)
            if session is not None and self._forks:
                parent = session
            session, start = session_key(self.index.fp, hashes), 0
            if session in self.index or session in saving:  # the same turn again
                return False
            if parent is not None:
                start = blocks
        if end <= start:
            return False
        self._planned.saves.append(
            SaveOp(
                req_id=req_id,
                session=session,
                block_ids=tuple(block_ids[:end]),
                start=start,
                end=end,
                tokens=tuple(tokens[: end * self.block_size]),
                answer_tokens=answer_tokens,
                keys=keys.prefix(end),
                hint=hint,
                parent=parent,
                tenant=tenant,
            )
        )
        self._pending_saves[req_id] = (session, hashes)
        return True

    def saving(self) -> bool:
        """Whether a planned save has not been reported stored (or failed) yet."""
        return bool(self._pending_saves)

    def unsent(self) -> bool:
        """Whether the next plan holds work of requests that finished: a hint to apply
        to a turn already stored, or a load to withdraw (no running request's step will
        carry it to the workers)."""
        return bool(self._planned.hints or self._planned.cancelled)

    def drained(self) -> bool:
        """Whether the scheduler side holds nothing for any request (see :meth:`busy`)."""
        return not (
            self._reqs
            or self._waiting
            or self._started
            or self._pending_saves
            or self._failed
            or self._deferred
            or self._rank_stored
            or self._rank_loaded
            or self.from_host
            or len(self.policy)
            or self.unsent()
        )

    def busy(self) -> dict[str, int]:
        """What the scheduler side holds for requests now (all 0 once every request
        finished and every save was reported)."""
        return {
            "requests": len(self._reqs),
            "queued_loads": sum(map(len, self._waiting.values())),
            "loading_sessions": len(self._started),
            "pending_saves": len(self._pending_saves),
            "policy_queue": len(self.policy),
            "failed": len(self._failed),
            "deferred": len(self._deferred),
            "rank_saves": len(self._rank_stored),
            "rank_loads": len(self._rank_loaded),
            "from_host": len(self.from_host),
            "unsent_hints": len(self._planned.hints),
            "unsent_withdrawals": len(self._planned.cancelled),
        }

    # -- steps ---------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """This step's loads, saves and withdrawn loads, for the workers (then forgotten
        here)."""
        out, self._planned = self._planned, StepPlan()
        return out

    def update(
        self, reports: WorkerReport | Sequence[WorkerReport] | None, failed_recving: set[str]
    ) -> WorkerReport:
        """Take the workers' reports of a step (one per worker that reported): stored
        turns, finished loads, placement changes. Returns what they amount to: the saves
        and loads every worker has now reported (each ``ok`` only if it was on every
        worker), the conversations' placements (each worker's shard combined), and the
        conversations gone (from any worker: a history missing a shard cannot serve)."""
        now = self.clock()
        if reports is None:
            reports = []
        elif isinstance(reports, WorkerReport):
            reports = [reports]
        out = self._combine(reports)
        for session, data in out.metas.items():
            if data is None:
                self.channel.remove(session)
            else:
                self.channel.put(decode_meta(data))
        for session in out.gone:
            self.index.remove(session)
        for req_id, session, blocks, ok in out.stored:
            pending = self._pending_saves.pop(req_id, None)
            if ok and pending is not None and pending[0] == session:
                self.index.put(session, pending[1][:blocks])
        done: dict[str, bool] = {}
        for req_id, session, ok in out.loaded:
            r = self._reqs.get(req_id)
            if r is not None and r.phase is Phase.LOADING:
                r.phase, r.op = Phase.LOADED, None
                if r.landed is None:
                    r.landed = now
                if not ok:
                    self._failed.add(req_id)
            started = self._started.get(session)
            if started is not None and req_id in started:
                started.discard(req_id)
                done[session] = done.get(session, True) and ok
                if not started:
                    del self._started[session]
        for req_id in failed_recving:
            if req_id in self._reqs:
                self._failed.add(req_id)
        for session, ok in done.items():
            if session not in self._started:
                self._finish_load(session, now, ok=ok)
        if done:
            self._start_loads(now)
        return out

    def _combine(self, reports: Sequence[WorkerReport]) -> WorkerReport:
        """The workers' reports as one: a save or load once every worker reported it."""
        out = WorkerReport()
        for report in reports:
            for req_id, session, blocks, ok in report.stored:
                saved = self._every(self._rank_stored, req_id, report.rank, (session, blocks, ok))
                if saved is not None:
                    sessions = {s for s, _, _ in saved}
                    least = min(b for _, b, _ in saved)
                    whole = len(sessions) == 1 and all(ok for _, _, ok in saved)
                    out.stored.append((req_id, session, least, whole))
            for req_id, session, ok in report.loaded:
                loaded = self._every(self._rank_loaded, req_id, report.rank, (session, ok))
                if loaded is not None:
                    out.loaded.append((req_id, session, all(ok for _, ok in loaded)))
            for session, data in report.metas.items():
                out.metas[session] = data if self.workers == 1 else self._shards(session, report)
            out.gone |= report.gone
        return out

    def _every(
        self, table: dict[str, dict[int, _T]], req_id: str, rank: int, value: _T
    ) -> list[_T] | None:
        """Record one worker's report of a request's save or load: every worker's, in rank
        order, once the last one reported (its entry is then gone), else ``None``."""
        per = table.setdefault(req_id, {})
        per[rank] = value
        if len(per) < self.workers:
            return None
        del table[req_id]
        return [per[r] for r in sorted(per)]

    def _shards(self, session: str, report: WorkerReport) -> bytes | None:
        """A conversation's placement over the workers' shards: stored nowhere if any
        worker lost its shard; else in the tiers every shard is in, served (``tier``)
        from the slowest tier a shard is served from, as large as the largest shard."""
        data = report.metas[session]
        per = self._rank_metas.setdefault(session, {})
        per[report.rank] = None if data is None else decode_meta(data)
        metas = list(per.values())
        if all(m is None for m in metas):
            del self._rank_metas[session]
            return None
        if any(m is None or m.tier is None for m in metas):
            return None
        shards = [m for m in metas if m is not None]
        order = [t.name for t in self.channel.tiers]
        slowest = max(
            (m.tier for m in shards if m.tier is not None),
            key=lambda t: order.index(t) if t in order else len(order),
        )
        common = [t for t in shards[0].copies if all(t in m.copies for m in shards)]
        copies = [slowest, *(t for t in common if t != slowest)]
        combined = msgspec.structs.replace(
            shards[0],
            tier=slowest,
            copies=tuple(copies),
            nbytes=max(m.nbytes for m in shards),
            tokens=min(m.tokens for m in shards),
        )
        return msgspec.msgpack.encode(combined)


def _shared(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """Leading blocks two chained block-hash lists share (equal at ``n`` means equal
    before it: a binary search)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
