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

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ...meta import KVMeta, MetadataChannel, TierInfo
from ...policies.registry import make_scheduler
from ...policies.scheduling import Request, kv_needs_load
from .config import ConnectorConfig
from .index import PrefixIndex, read_sidecars
from .keys import PLAIN, RequestKeys, session_key
from .ops import LoadOp, SaveOp, StepPlan, WorkerReport
from .worker import HOST, REDIS, SSD, decode_meta, sidecar_dir

__all__ = ["SAVE_WAIT", "SchedulerSide"]

SAVE_WAIT = 5.0
"""Seconds a prompt waits, at most, for the turn it continues to be reported stored."""

_log = logging.getLogger(__name__)


@dataclass
class _Match:
    session: str
    local: int  # blocks vLLM holds itself
    blocks: int  # blocks matched in the store
    sync: bool  # loaded within the step
    host: bool  # from host memory


class SchedulerSide:
    """The scheduler process's half of the connector.

    :param config: the connector's settings
    :param fp: the model/dtype/layout fingerprint
    :param block_size: tokens per vLLM block
    :param clock: time source for the load scheduler (``time.monotonic``)
    """

    def __init__(
        self,
        config: ConnectorConfig,
        fp: str,
        block_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.clock = clock
        self.index = PrefixIndex(fp, block_size)
        self.channel = MetadataChannel()
        tiers = [TierInfo(name=HOST, level=0, capacity=config.host_bytes)]
        if config.ssd_path is not None:
            tiers.append(TierInfo(name=SSD, level=len(tiers), capacity=config.ssd_bytes))
        if config.redis_url is not None:
            tiers.append(TierInfo(name=REDIS, level=len(tiers), capacity=config.redis_bytes))
        self.channel.set_tiers(tiers)
        self.policy = make_scheduler(config.scheduler, max_loads=config.max_loads)
        self._matches: dict[str, _Match] = {}
        self._planned: StepPlan = StepPlan()
        self._waiting: dict[str, list[LoadOp]] = {}  # session -> loads the policy holds
        self._started: dict[str, set[str]] = {}  # session -> request ids loading
        self._pending_saves: dict[str, tuple[str, list[bytes]]] = {}
        self._failed: set[str] = set()
        self._deferred: dict[str, float] = {}  # request -> when it first waited for a save
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
        no livelock, vLLM #49176). ``None`` (vLLM asks again at its next step) while the
        turn this prompt continues is still being stored, for at most ``SAVE_WAIT``
        seconds: a client that sends its next turn at once then finds it.
        """
        self._matches.pop(req_id, None)
        if req_id in self._failed or not (len(self.index) or self._pending_saves):
            return 0, False
        hashes = self.index.hashes(tokens[: max(0, len(tokens) - 1)], keys)
        if self._continues_a_pending_save(req_id, hashes):
            return None, False
        session, blocks = self.index.match(hashes)
        local = local_tokens // self.block_size
        if session is None or blocks <= local:
            return 0, False
        meta = self.channel.get(session)
        host = not kv_needs_load(meta, self.channel)
        sync = host or (
            self.config.layerwise
            and meta is not None
            and meta.nbytes <= self.config.sync_load_bytes
        )
        self._matches[req_id] = _Match(session, local, blocks, sync, host)
        return (blocks - local) * self.block_size, not sync

    def _continues_a_pending_save(self, req_id: str, hashes: Sequence[bytes]) -> bool:
        """Whether the prompt extends a turn not yet reported stored (and we still wait)."""
        now = self.clock()
        since = self._deferred.setdefault(req_id, now)
        if now - since > SAVE_WAIT:
            return False
        for _, saved in self._pending_saves.values():
            n = min(len(saved), len(hashes))
            if n and saved[n - 1] == hashes[n - 1]:
                return True
        self._deferred.pop(req_id, None)
        return False

    def allocated(
        self, req_id: str, tokens: Sequence[int], block_ids: Sequence[int], external: int
    ) -> None:
        """vLLM allocated the request's blocks for ``external`` tokens from the store."""
        m = self._matches.pop(req_id, None)
        if m is None or external <= 0:
            return
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
        if m.sync:
            self._planned.loads.append(op)
            return
        now = self.clock()
        self.policy.submit(
            Request(id=req_id, session=m.session, arrival=now, tokens=len(tokens)),
            now,
            self.channel,
        )
        self._waiting.setdefault(m.session, []).append(op)
        self._start_loads(now)

    def _start_loads(self, now: float) -> None:
        for request in self.policy.start_loads(now):
            ops = self._waiting.pop(request.session, [])
            self._started.setdefault(request.session, set()).update(op.req_id for op in ops)
            self._planned.loads.extend(ops)
            if not ops:  # nothing to fill: close the policy's load at once
                self._finish_load(request.session, now, ok=True)
        self.channel.publish_waiting(self.policy.waiting())

    def _finish_load(self, session: str, now: float, *, ok: bool) -> None:
        self.policy.load_finished(session, now, ok=ok)
        while self.policy.pop_ready(now) is not None:
            pass  # vLLM runs them; the policy only orders the loads

    # -- saving --------------------------------------------------------------------------
    def finished(
        self,
        req_id: str,
        tokens: Sequence[int],
        block_ids: Sequence[int],
        computed: int,
        answer_tokens: int,
        keys: RequestKeys = PLAIN,
    ) -> bool:
        """A request finished with KV for its first ``computed`` tokens in ``block_ids``.

        Plans storing its new full blocks as its conversation's next turn (a new
        conversation when it continues none, or only part of one). Returns whether a save
        was planned: its blocks must then stay allocated until the worker copied them.
        """
        self._matches.pop(req_id, None)
        self._failed.discard(req_id)
        self._deferred.pop(req_id, None)
        self.from_host.pop(req_id, None)
        end = min(computed, len(tokens) - 1, len(block_ids) * self.block_size) // self.block_size
        if end <= 0:
            return False
        hashes = self.index.hashes(tokens[: end * self.block_size], keys)
        session, blocks = self.index.match(hashes)
        if session is not None and blocks == self.index.blocks(session):
            start = blocks  # it continues the whole stored conversation
        else:
            session, start = session_key(self.index.fp, hashes), 0
            if session in self.index:  # the same first turn again: nothing new
                return False
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
            )
        )
        self._pending_saves[req_id] = (session, hashes)
        return True

    def saving(self) -> bool:
        """Whether a planned save has not been reported stored (or failed) yet."""
        return bool(self._pending_saves)

    # -- steps ---------------------------------------------------------------------------
    def plan(self) -> StepPlan:
        """This step's loads and saves, for the workers (then forgotten here)."""
        out, self._planned = self._planned, StepPlan()
        return out

    def update(self, report: WorkerReport | None, failed_recving: set[str]) -> None:
        """Take the workers' report: stored turns, finished loads, placement changes."""
        now = self.clock()
        if report is not None:
            for session, data in report.metas.items():
                if data is None:
                    self.channel.remove(session)
                else:
                    self.channel.put(decode_meta(data))
            for session in report.gone:
                self.index.remove(session)
            for req_id, session, blocks, ok in report.stored:
                pending = self._pending_saves.pop(req_id, None)
                if ok and pending is not None and pending[0] == session:
                    self.index.put(session, pending[1][:blocks])
            loaded = report.loaded
        else:
            loaded = []
        done: dict[str, bool] = {}
        for req_id, session, ok in loaded:
            if not ok or req_id in failed_recving:
                self._failed.add(req_id)
            started = self._started.get(session)
            if started is not None and req_id in started:
                started.discard(req_id)
                done[session] = done.get(session, True) and ok
                if not started:
                    del self._started[session]
        for req_id in failed_recving:
            self._failed.add(req_id)
        for session, ok in done.items():
            if session not in self._started:
                self._finish_load(session, now, ok=ok)
        if done:
            self._start_loads(now)
