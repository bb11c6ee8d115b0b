"""The worker side: moves vLLM's paged KV blocks to and from a :class:`TieredKVCache`.

Each worker process owns one cache (host memory tier, SSD tier, optionally Redis) and runs
it on an event loop in a thread of its own (an anyio blocking portal), so that vLLM's
model thread only ever waits for what the current step needs:

* a **save** copies a finished request's new blocks out of the paged KV (a gather, on a
  thread of the loop while vLLM runs its next steps; on CUDA on the model thread, into
  pinned host memory) and hands the tensors to the cache's :meth:`~TieredKVCache.append`:
  the request's blocks go back to vLLM once copied (:meth:`WorkerStore.copied`), and the
  host tier, the write to SSD and the sidecar happen off the forward pass;
* a **sync load** (the history is in host memory, or small enough to read from below it
  within the step) is streamed layer by layer (:meth:`WorkerStore.start_stream`, over
  :meth:`~TieredKVCache.load_layerwise`): the token ids stored with it land first and are
  compared with the request's, then each layer is scattered into the request's block
  table just before vLLM's attention reads it, while later layers are still being copied
  or read; the step's output leaves only after every byte was verified;
* an **async load** (the history is below host memory) runs on the loop thread: the cache
  promotes it to host memory and the same copy and scatter follow; the request's id is
  reported finished at the next step that finds it done.

A stored turn holds, per attention layer, the blocks' KV as ``[heads, tokens, C]`` (vLLM's
standardized per-layer view ``[blocks, heads, block tokens, C]`` with the blocks laid end
to end), and the turn's token ids as ``tokens`` (``[1, tokens, 1]``, int64), so a load can
prove that what it serves belongs to the prompt.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.from_thread
import msgspec
import torch

from ...backends.base import Tier
from ...backends.memory import HostMemoryTier
from ...backends.ssd import SSDTier
from ...cache import LayerwiseLoad, TieredKVCache
from ...errors import (
    CapacityError,
    HistoryLengthError,
    HistoryLostError,
    InvalidArgumentError,
    RestoreFailedError,
    SessionNotFoundError,
    TierIOError,
)
from ...meta import Dropped, Event, Evicted, KVMeta, RetentionHint
from ...payload import RETIRED_SEQ, plan_retirement
from ..hints import apply_turn_hint
from .config import ConnectorConfig
from .hints import pin_group
from .index import Sidecar, read_sidecars, remove_sidecar, write_sidecar
from .ops import LoadOp, SaveOp, WorkerReport

__all__ = ["HOST", "SSD", "WorkerStore", "make_tiers"]

_log = logging.getLogger(__name__)

HOST = "host"
"""Name of the host-memory tier."""
SSD = "ssd"
"""Name of the SSD tier."""
REDIS = "redis"
"""Name of the Redis tier."""
TOKENS = "tokens"
"""Name of the stored tensor that holds a turn's token ids."""
COPY_WAIT = 1.0
"""Seconds, at most, that an asynchronous load from below host memory (a promotion) or a
save waits for the background copies into the lower tiers (inclusive mode's write-through)
under way to finish before it makes room in host memory (see :meth:`WorkerStore._settle`);
a load within the step (layer by layer, during the forward pass) does not wait."""


def make_tiers(config: ConnectorConfig, rank: int) -> list[Tier]:
    """The tiers the worker of rank ``rank`` (among the engine's tensor- and
    pipeline-parallel workers) stores into: each rank holds its own shard of every
    conversation, in a directory and under Redis keys of its own (rank 0's keys are those
    of a single-worker engine), so that no rank is ever served another's shard."""
    tiers: list[Tier] = [HostMemoryTier(config.host_bytes, name=HOST)]
    if config.ssd_path is not None:
        path = Path(config.ssd_path) / f"rank{rank}"
        tiers.append(SSDTier(path, config.ssd_bytes, name=SSD, fsync=config.fsync))
    if config.redis_url is not None:
        from ...backends.redis import RedisTier

        tiers.append(
            RedisTier(
                config.redis_url,
                config.redis_bytes,
                name=REDIS,
                timeout=config.redis_timeout,
                prefix=redis_prefix(rank),
            )
        )
    return tiers


def redis_prefix(rank: int) -> str:
    """The Redis key prefix of rank ``rank``'s shards."""
    return "tieredkv" if rank == 0 else f"tieredkv-rank{rank}"


def sidecar_dir(config: ConnectorConfig) -> Path | None:
    """Where the index sidecars live (``None`` without an SSD tier)."""
    return None if config.ssd_path is None else Path(config.ssd_path) / "index"


class _Staging:
    """Pinned host buffers for CUDA copies, one per (use, layer, shape, dtype), reused: a
    copy in flight never shares its buffer with another."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}
        self._lock = threading.Lock()

    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def host(self, use: str, like: torch.Tensor) -> torch.Tensor:
        key = (use, tuple(like.shape), like.dtype)
        with self._lock:
            buf = self._buffers.get(key)
            if buf is None:
                buf = self._buffers[key] = torch.empty(
                    key[1], dtype=like.dtype, pin_memory=torch.cuda.is_available()
                )
        return buf


class WorkerStore:
    """One worker's cache and the copies between it and vLLM's paged KV.

    :param config: the connector's settings
    :param fp: the model/dtype/layout fingerprint (session keys start with it)
    :param block_size: tokens per vLLM block
    :param rank: the worker's rank among the engine's tensor- and pipeline-parallel workers
        (rank 0 writes the index sidecars)
    :param tiers: the tiers (default: :func:`make_tiers`)
    :param per_block_keys: requests may carry per-block keys (a multimodal model): a
        sidecar that lags its stored KV cannot then be rebuilt from the stored token ids
        alone, and its conversation is dropped at a restart instead
    """

    def __init__(
        self,
        config: ConnectorConfig,
        fp: str,
        block_size: int,
        *,
        rank: int = 0,
        tiers: Sequence[Tier] | None = None,
        per_block_keys: bool = False,
    ) -> None:
        self.config = config
        self.per_block_keys = per_block_keys
        self.fp = fp
        self.block_size = block_size
        self.rank = rank
        self._sidecars = sidecar_dir(config) if rank == 0 else None
        self.cache = TieredKVCache(
            list(tiers) if tiers is not None else make_tiers(config, rank),
            eviction=config.eviction,
            mode=config.mode,
            token_dim=1,
            max_pinned_bytes=config.max_pinned_bytes,
            max_pinned_bytes_per_group=config.max_pinned_bytes_per_tenant,
            max_lost_records=config.max_lost_records,
        )
        self.layers: dict[str, torch.Tensor] = {}
        self._split = 1  # kernel blocks per vLLM block
        self._stack = contextlib.ExitStack()
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._lock = threading.Lock()
        self._touched: dict[str, None] = {}
        self._gone: set[str] = set()
        self._pending_loads: dict[str, tuple[LoadOp, concurrent.futures.Future[Any]]] = {}
        self._pending_saves: dict[str, tuple[SaveOp, concurrent.futures.Future[Any]]] = {}
        self._copying: dict[str, concurrent.futures.Future[None]] = {}
        self._save_tasks: set[concurrent.futures.Future[None]] = set()
        self._sidecar_locks: dict[str, anyio.Lock] = {}
        self._staging = _Staging()
        self._server: Any = None
        self.counters: dict[str, float] = {}

    # -- lifecycle ---------------------------------------------------------------------
    def open(self, layers: Mapping[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer KV tensors (``[blocks, heads, block tokens, C]``), open
        the cache (rebuilding it from the SSD tier) and tidy what a crash left."""
        if not layers:
            raise ValueError("register_kv_caches gave no KV cache tensors")
        self.layers = dict(layers)
        first = next(iter(self.layers.values()))
        kernel = int(first.shape[2])
        if self.block_size % kernel:
            raise ValueError(
                f"vLLM's kernel block size {kernel} does not divide its block size "
                f"{self.block_size}"
            )
        self._split = self.block_size // kernel
        self._portal = self._stack.enter_context(anyio.from_thread.start_blocking_portal())
        self.cache.channel.subscribe(self._on_event)
        self._portal.call(self.cache.open)
        self._stack.callback(self._close_cache)
        self._tidy()
        if self.config.metrics_port:
            from ... import metrics

            self._server = metrics.serve(self.cache, self.config.metrics_port)
            self._stack.callback(self._server.close)

    def _close_cache(self) -> None:
        assert self._portal is not None
        pending = [f for _, f in (*self._pending_saves.values(), *self._pending_loads.values())]
        for fut in [*pending, *self._tasks()]:
            with contextlib.suppress(Exception):
                fut.result()
        self._portal.call(self.cache.aclose)

    def close(self) -> None:
        """Finish pending saves and loads, close the cache and its thread."""
        self._stack.close()

    def _tidy(self) -> None:
        """After a restart: conversations stored without a sidecar (a crash between the
        commit and the sidecar) are dropped, sidecars of conversations the cache lost are
        removed, a sidecar that leads the stored KV is cut back to it, and one that lags
        it (a crash after a turn was stored, before its sidecar) is rewritten from the
        token ids stored with the KV."""
        if self._sidecars is None:
            return
        prefix = f"vllm-{self.fp}-"
        stored = {s for s in self.cache.sessions() if s.startswith(prefix)}
        known = set()
        for sidecar in read_sidecars(self._sidecars, self.fp):
            meta = self.cache.channel.get(sidecar.session)
            if meta is None or meta.tier is None:
                remove_sidecar(self._sidecars, sidecar.session)
                continue
            known.add(sidecar.session)
            if meta.tokens < len(sidecar.tokens):
                cut = meta.tokens // self.block_size * self.block_size
                cut_back = Sidecar(
                    session=sidecar.session,
                    fingerprint=self.fp,
                    tokens=sidecar.tokens[:cut],
                    identity=sidecar.identity,
                    extra=sidecar.extra[: cut // self.block_size],
                )
                write_sidecar(self._sidecars, cut_back)
            elif meta.tokens > len(sidecar.tokens) and not self._catch_up(sidecar):
                known.discard(sidecar.session)
                remove_sidecar(self._sidecars, sidecar.session)
        with self._lock:  # the first report tells the scheduler side where each one is
            self._touched.update(dict.fromkeys(sorted(known)))
        assert self._portal is not None
        for session in sorted(stored - known):
            _log.info("dropping %s: stored without an index entry", session)
            self._portal.call(self.cache.drop, session)

    def _catch_up(self, sidecar: Sidecar) -> bool:
        """Rewrite a sidecar from its conversation's stored token ids; ``False`` if they
        cannot be read, or the turns it misses may have had per-block keys that only the
        request knew (the conversation is then dropped)."""
        assert self._portal is not None
        assert self._sidecars is not None
        session = sidecar.session
        if self.per_block_keys:
            _log.info("dropping %s: its index entry lags and cannot be rebuilt", session)
            return False
        try:
            history = self._portal.call(self.cache.load, session)
        except (SessionNotFoundError, TierIOError):
            _log.warning("cannot read %s's token ids", session, exc_info=True)
            return False
        tokens = history[TOKENS][0, :, 0].tolist()
        cut = len(tokens) // self.block_size * self.block_size
        caught_up = Sidecar(
            session=session, fingerprint=self.fp, tokens=tokens[:cut], identity=sidecar.identity
        )
        write_sidecar(self._sidecars, caught_up)
        return True

    # -- events --------------------------------------------------------------------------
    def _on_event(self, event: Event) -> None:
        with self._lock:
            self._touched[event.session] = None
            if (isinstance(event, Evicted) and event.lost) or isinstance(event, Dropped):
                self._gone.add(event.session)

    def _count(self, key: str, value: float = 1) -> None:
        with self._lock:
            self.counters[key] = self.counters.get(key, 0) + value

    def take_counters(self) -> dict[str, float]:
        """The counters since the last call (vLLM's connector stats)."""
        with self._lock:
            out, self.counters = self.counters, {}
        return out

    # -- block copies --------------------------------------------------------------------
    def _kernel_ids(self, block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
        ids = torch.tensor(block_ids, dtype=torch.int64)
        if self._split > 1:
            ids = (ids[:, None] * self._split + torch.arange(self._split)).reshape(-1)
        return ids.to(device)

    def gather(self, block_ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """The KV of these blocks, per layer ``[heads, tokens, C]`` in host memory."""
        out: dict[str, torch.Tensor] = {}
        for name, layer in self.layers.items():
            ids = self._kernel_ids(block_ids, layer.device)
            picked = layer.index_select(0, ids)  # [n, H, N, C]
            flat = picked.permute(1, 0, 2, 3).reshape(picked.shape[1], -1, picked.shape[3])
            if flat.is_cuda:
                host = self._staging.host(f"save:{name}", flat)
                host.copy_(flat, non_blocking=True)
                out[name] = host
            else:
                out[name] = flat
        if any(t.is_pinned() for t in out.values()):
            torch.cuda.current_stream().synchronize()
            out = {k: v.clone() for k, v in out.items()}  # the staging buffer is reused
        return out

    def scatter(
        self, history: Mapping[str, torch.Tensor], block_ids: Sequence[int], first: int, last: int
    ) -> None:
        """Copy tokens of blocks ``first .. last-1`` of a loaded history into these blocks."""
        for name in self.layers:
            self.scatter_layer(name, history[name], block_ids, first, last)
        if any(layer.is_cuda for layer in self.layers.values()):
            torch.cuda.current_stream().synchronize()

    def scatter_layer(
        self, name: str, history: torch.Tensor, block_ids: Sequence[int], first: int, last: int
    ) -> None:
        """:meth:`scatter` for one layer (``history``: its ``[heads, tokens, C]``); on CUDA
        the copy is queued on the current stream."""
        bs = self.block_size
        layer = self.layers[name]
        src = history[:, first * bs : last * bs, :]
        heads, _, c = src.shape
        blocks = src.reshape(heads, (last - first) * self._split, -1, c).permute(1, 0, 2, 3)
        if layer.is_cuda:
            host = self._staging.host(f"load:{threading.get_ident()}:{name}", blocks)
            host.copy_(blocks)
            blocks = host.to(layer.device, non_blocking=True)
        layer.index_copy_(0, self._kernel_ids(block_ids[first:last], layer.device), blocks)

    # -- loads ---------------------------------------------------------------------------
    async def _fetch(self, op: LoadOp) -> dict[str, torch.Tensor] | None:
        """The stored history if it is there, whole, and the request's; ``None`` else."""
        began = time.monotonic()
        if self.cache.where(op.session) not in (HOST, None):  # a promotion: it makes room
            await self._settle()
        try:
            history = await self.cache.load(op.session)
        except SessionNotFoundError:  # dropped, lost or found damaged: recompute
            self._forget(op.session)
            return None
        except TierIOError:  # transient: the data stays, this request recomputes
            _log.warning("loading %s failed; %s recomputes", op.session, op.req_id, exc_info=True)
            return None
        need = op.blocks * self.block_size
        stored = history[TOKENS]
        if stored.shape[1] < need or not torch.equal(
            stored[0, :need, 0], torch.tensor(op.tokens, dtype=torch.int64)
        ):
            # the stored KV is some conversation's, only not this prompt's: kept
            _log.warning("%s does not hold %s's tokens; it recomputes", op.session, op.req_id)
            return None
        self._count("load_seconds", time.monotonic() - began)
        return history

    async def _settle(self) -> None:
        """Before an operation that puts bytes into host memory (and may evict from it to
        make room): wait (:data:`COPY_WAIT` seconds at most) for the background copies into
        the lower tiers that are under way now to finish. A conversation still being copied
        down is busy and cannot be evicted, so the eviction would otherwise pass over the
        policy's choice for another conversation, one that depends on how fast the disk
        wrote, not on the policy (a copy that finished leaves the victim's eviction a mere
        drop of its host copy). Copies that start meanwhile are not waited for, so a steady
        stream of saves does not hold a load up (:meth:`TieredKVCache.wait_copies`)."""
        with anyio.move_on_after(COPY_WAIT):
            await self.cache.wait_copies()

    def _forget(self, session: str) -> None:
        with self._lock:
            self._gone.add(session)

    async def _load_async(self, op: LoadOp) -> bool:
        history = await self._fetch(op)
        if history is None:
            return False
        await anyio.to_thread.run_sync(self.scatter, history, op.block_ids, op.first, op.blocks)
        return True

    def load_sync(self, op: LoadOp) -> bool:
        """Fill the request's blocks now; ``False`` if it must recompute them."""
        assert self._portal is not None
        try:
            history = self._portal.call(self._fetch, op)
            if history is not None:
                self.scatter(history, op.block_ids, op.first, op.blocks)
        except Exception:
            _log.exception("loading %s for %s failed", op.session, op.req_id)
            history = None
        self._loaded(op, history is not None, host=op.host)
        return history is not None

    # -- layer-wise loads -------------------------------------------------------------
    def start_stream(self, op: LoadOp) -> LayerStream:
        """Start filling the request's blocks layer by layer, within this step: the cache
        reads (from host memory, or from the SSD with a promotion on the way) on its loop
        thread while the model thread computes; :meth:`wait_layer` scatters a layer once
        its bytes are in, :meth:`finish_stream` says whether everything was verified."""
        assert self._portal is not None
        stream = LayerStream(op, list(self.layers))
        try:
            stream.future, stream.load = self._portal.start_task(self._stream, op, stream)
        except Exception:
            # nothing of it reached the paged KV: the request recomputes these blocks
            _log.warning("loading %s for %s failed", op.session, op.req_id, exc_info=True)
            stream.failed = True
        return stream

    async def _stream(
        self, op: LoadOp, stream: LayerStream, *, task_status: anyio.abc.TaskStatus[Any]
    ) -> bool:
        began = time.monotonic()
        # the token ids first: the request's are checked before any block is filled
        groups = [[TOKENS, stream.names[0]], *([n] for n in stream.names[1:])]
        try:
            meta = self.cache.channel.get(op.session)
            if meta is None or meta.tier is None or meta.tokens < op.blocks * self.block_size:
                raise SessionNotFoundError(op.session)
            out = {TOKENS: torch.empty((1, meta.tokens, 1), dtype=torch.int64)}
            for name, layer in self.layers.items():
                shape = (int(layer.shape[1]), meta.tokens, int(layer.shape[3]))
                out[name] = torch.empty(shape, dtype=layer.dtype, pin_memory=layer.is_cuda)
            stream.out = out
            async with self.cache.load_layerwise(op.session, out, groups) as load:
                task_status.started(load)
                await load.finished()
        except SessionNotFoundError:  # dropped, lost or found damaged: recompute
            self._forget(op.session)
            return False
        except (TierIOError, RestoreFailedError):  # the data stays, this request recomputes
            _log.warning("loading %s failed; %s recomputes", op.session, op.req_id, exc_info=True)
            return False
        self._count("load_seconds", time.monotonic() - began)
        return True

    def wait_layer(self, streams: Sequence[LayerStream], name: str, *, late: bool = False) -> None:
        """Scatter layer ``name`` of every stream into the paged KV once its bytes are in
        (called before vLLM's attention reads that layer; ``late``: after the forward pass,
        for a layer vLLM did not wait for)."""
        for stream in streams:
            g = stream.group.get(name)
            if g is None or stream.failed or g in stream.done:
                continue
            assert stream.load is not None
            op = stream.op
            try:
                stream.load.wait(g)
            except RestoreFailedError:
                stream.failed = True
                continue
            if g == 0:
                need = op.blocks * self.block_size
                stored = stream.out[TOKENS][0, :need, 0]
                if not torch.equal(stored, torch.tensor(op.tokens, dtype=torch.int64)):
                    _log.warning(
                        "%s does not hold %s's tokens; it recomputes", op.session, op.req_id
                    )
                    stream.failed = True
                    continue
            self.scatter_layer(name, stream.out[name], op.block_ids, op.first, op.blocks)
            stream.done.add(g)
            if not late:
                self._count("streamed_layers")
        if any(layer.is_cuda for layer in self.layers.values()):
            torch.cuda.current_stream().synchronize()  # the staging buffers are reused

    def finish_stream(self, stream: LayerStream) -> bool:
        """Fill what no :meth:`wait_layer` filled, wait until every byte is verified, and
        say whether the blocks hold the request's history (``False``: recompute them)."""
        for name in stream.names:
            self.wait_layer([stream], name, late=True)
        ok = False
        if stream.future is not None:
            try:
                ok = bool(stream.future.result()) and not stream.failed
            except Exception:
                _log.exception("loading %s for %s failed", stream.op.session, stream.op.req_id)
        stream.out = {}
        self._loaded(stream.op, ok, host=stream.op.host)
        return ok

    def _loaded(self, op: LoadOp, ok: bool, *, host: bool) -> None:
        if ok:
            self._count("loads")
            self._count("host_hits" if host else "lower_hits")
            self._count("loaded_tokens", (op.blocks - op.first) * self.block_size)
        else:
            self._count("load_errors")

    def load_async(self, op: LoadOp) -> None:
        """Start filling the request's blocks in the background."""
        assert self._portal is not None
        self._pending_loads[op.req_id] = (op, self._portal.start_task_soon(self._load_async, op))

    def finished_loads(self) -> list[tuple[LoadOp, bool]]:
        """Background loads that finished since the last call, with their outcome."""
        done = _drain(self._pending_loads, "loading")
        for op, ok in done:
            self._loaded(op, ok, host=op.host)
        return done

    # -- saves ---------------------------------------------------------------------------
    def save(self, op: SaveOp) -> None:
        """Copy the request's new blocks out and append them to the conversation, in the
        background: the copy runs on a thread of the cache's loop while vLLM goes on with
        its next step (on CUDA it runs here, through pinned buffers); :meth:`copied` says
        when the request's blocks may be freed."""
        assert self._portal is not None
        copied: concurrent.futures.Future[None] = concurrent.futures.Future()
        tensors = None
        if any(layer.is_cuda for layer in self.layers.values()):
            tensors = self._tensors(op)
            copied.set_result(None)
        stored: concurrent.futures.Future[bool] = concurrent.futures.Future()
        task = self._portal.start_task_soon(self._save, op, tensors, copied, stored)
        with self._lock:
            self._save_tasks.add(task)
        task.add_done_callback(self._task_done)
        self._pending_saves[op.req_id] = (op, stored)
        self._copying[op.req_id] = copied

    def _tensors(self, op: SaveOp) -> dict[str, torch.Tensor]:
        """The turn's token ids (first: a load checks them before it fills a block) and the
        KV of its blocks (of all of them, from block 0, for a fork: stored whole should
        the fork be refused)."""
        bs = self.block_size
        first = 0 if op.parent is not None else op.start
        tokens = torch.tensor(op.tokens[first * bs : op.end * bs], dtype=torch.int64)
        return {TOKENS: tokens.reshape(1, -1, 1), **self.gather(op.block_ids[first : op.end])}

    async def _save(
        self,
        op: SaveOp,
        tensors: dict[str, torch.Tensor] | None,
        copied: concurrent.futures.Future[None],
        stored: concurrent.futures.Future[bool],
    ) -> None:
        try:
            if tensors is None:
                try:
                    tensors = await anyio.to_thread.run_sync(self._tensors, op)
                finally:  # copied, or failed: either way vLLM may have the blocks back
                    copied.set_result(None)
            meta = await self._append(op, tensors)
        except BaseException as exc:
            stored.set_exception(exc)
            raise
        # stored: the scheduler side may serve it from now on; the sidecar (what a
        # restart rebuilds the index from) follows, off the next request's path: a crash
        # before it only drops this conversation at the restart (see _tidy)
        stored.set_result(meta is not None)
        if meta is not None and self._sidecars is not None:
            keys = op.keys.prefix(meta.tokens // self.block_size)
            sidecar = Sidecar(
                session=op.session,
                fingerprint=self.fp,
                tokens=list(op.tokens[: meta.tokens]),
                identity=keys.identity,
                extra=list(keys.extra),
            )
            lock = self._sidecar_locks.setdefault(op.session, anyio.Lock())
            try:
                async with lock:  # in the order the turns were stored (anyio's lock is fair)
                    await anyio.to_thread.run_sync(write_sidecar, self._sidecars, sidecar)
            except Exception:  # (the turn is stored: served until a restart drops it)
                self._count("index_errors")
                _log.exception(
                    "writing %s's index entry failed: its turns are served until a restart, "
                    "which drops them",
                    op.session,
                )
            finally:
                if not lock.statistics().tasks_waiting:
                    self._sidecar_locks.pop(op.session, None)

    def _task_done(self, task: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._save_tasks.discard(task)

    def _tasks(self) -> list[concurrent.futures.Future[None]]:
        with self._lock:
            return list(self._save_tasks)

    def copied(self) -> set[str]:
        """Requests whose saved blocks were copied out since the last call (vLLM may
        free or reuse those blocks now)."""
        done = {req for req, fut in self._copying.items() if fut.done()}
        for req in done:
            del self._copying[req]
        return done

    async def _append(self, op: SaveOp, tensors: dict[str, torch.Tensor]) -> KVMeta | None:
        """Append the turn if the conversation holds exactly what it continues (the cache
        checks it under the conversation's lock: ``expected_tokens``); the conversation's
        metadata after it, or ``None`` if it was not stored. A turn from block 0 starts a
        lost conversation afresh; one that continues a lost or shorter history, or one
        that another save extended meanwhile, is not stored. The channel is read first,
        so that a turn it already says is out of place costs no call to the cache."""
        await self._settle()  # the turn goes into host memory: it may make room there
        first = 0 if op.parent is not None else op.start  # blocks the session holds
        meta = self.cache.channel.get(op.session)
        have = 0 if meta is None or meta.tier is None else meta.tokens
        if have != first * self.block_size:  # (no call to the cache, nor to a shared tier)
            _not_stored(op, have, first * self.block_size)
            return None
        stored = None
        if op.parent is not None:
            stored, tensors = await self._fork(op, tensors)
        if stored is None:
            try:
                stored = await self.cache.append(
                    op.session,
                    tensors,
                    answer_tokens=op.answer_tokens,
                    expected_tokens=first * self.block_size,
                )
            except HistoryLostError:  # what the turn continues is gone (the next save
                _log.info(  # from block 0 starts afresh)
                    "not storing %s's turn: %s's history was lost", op.req_id, op.session
                )
                return None
            except HistoryLengthError as exc:  # (extended or lost meanwhile)
                _not_stored(op, exc.held, exc.expected)
                return None
        self._count("saved_tokens", tensors[TOKENS].shape[1])
        self._count("saved_bytes", sum(t.numel() * t.element_size() for t in tensors.values()))
        if op.hint is not None:
            stored = self._hint(op.req_id, op.session, op.hint, op.tenant) or stored
        return stored

    async def _fork(
        self, op: SaveOp, tensors: dict[str, torch.Tensor]
    ) -> tuple[KVMeta | None, dict[str, torch.Tensor]]:
        """Store the turn as a fork of ``op.parent`` at block ``op.start`` (its own blocks
        only): the conversation's metadata and the tensors stored, or ``None`` and all of
        ``tensors`` (to store whole) if the cache refused the fork (the parent is gone,
        retired or lost meanwhile, or its tier has no room for the turn)."""
        assert op.parent is not None
        at = op.start * self.block_size
        own = {name: t.narrow(1, at, t.shape[1] - at) for name, t in tensors.items()}
        try:
            meta = await self.cache.append(
                op.session,
                own,
                answer_tokens=op.answer_tokens,
                parent=op.parent,
                parent_tokens=at,
            )
        except (SessionNotFoundError, CapacityError, InvalidArgumentError) as exc:
            _log.debug(
                "storing %s's turn whole: the fork of %s at %d tokens was refused (%s)",
                op.req_id,
                op.parent,
                at,
                exc,
            )
            return None, tensors
        self._count("forks")
        return meta, own

    def _hint(
        self, req_id: str, session: str, hint: RetentionHint, tenant: str = ""
    ) -> KVMeta | None:
        """Apply a request's retention hint to a stored conversation (on the cache's loop);
        its metadata after, ``None`` if the cache no longer holds it. A pin counts in its
        tenant's pin group (:func:`pin_group`), bounded by the cache's
        ``max_pinned_bytes_per_group`` (the config's ``max_pinned_bytes_per_tenant``); a
        pin past a bound is refused (logged, counted in ``pins_refused``) and the rest of
        the hint applied."""
        if hint.pin:
            hint = msgspec.structs.replace(hint, group=pin_group(tenant))
        try:
            meta, refused = apply_turn_hint(self.cache, session, hint, what=f"request {req_id}")
        except SessionNotFoundError:
            _log.info("request %s's retention hint not applied: %s is gone", req_id, session)
            return None
        if refused is not None:  # past max_pinned_bytes, or past its tenant's bound
            self._count("pins_refused")
        with self._lock:  # the scheduler side's mirror hears of it with the next report
            self._touched[session] = None
        return meta

    def hint(self, req_id: str, session: str, hint: RetentionHint, tenant: str = "") -> None:
        """Apply a finished request's retention hint to a stored conversation now (a
        request of ``tenant``: see :attr:`~.ops.SaveOp.tenant`)."""
        assert self._portal is not None
        self._portal.call(self._hint, req_id, session, hint, tenant)

    def finished_saves(self) -> list[tuple[SaveOp, bool]]:
        """Saves whose append finished since the last call, with their outcome."""
        done = _drain(self._pending_saves, "storing")
        for _, ok in done:
            if not ok:
                self._count("save_errors")
        return done

    # -- reports -------------------------------------------------------------------------
    def report(
        self, loads: Sequence[tuple[LoadOp, bool]], saves: Sequence[tuple[SaveOp, bool]]
    ) -> WorkerReport:
        """This step's report to the scheduler side."""
        out = WorkerReport(
            loaded=[(op.req_id, op.session, ok) for op, ok in loads],
            stored=[(op.req_id, op.session, op.end, ok) for op, ok in saves],
        )
        with self._lock:
            touched, self._touched = list(self._touched), {}
            out.gone, self._gone = self._gone, set()
        if self._sidecars is not None:  # here, off the event loop's thread
            for session in out.gone:
                try:
                    remove_sidecar(self._sidecars, session)
                except OSError:  # (never on the model's path: a restart removes it then)
                    self._count("index_errors")
                    _log.exception(
                        "removing %s's index entry failed: the next restart removes it",
                        session,
                    )
        for session in touched:
            meta = self.cache.channel.get(session)
            out.metas[session] = None if meta is None else msgspec.msgpack.encode(meta)
        return out

    def busy(self) -> dict[str, int]:
        """What the worker holds for requests now (all 0 once nothing is in flight, on a
        CPU build, where no staging buffer is used): loads, saves and block copies in
        flight, sidecar writes waiting, the bytes of pinned staging buffers (kept for
        reuse on CUDA), and per tier the bytes used beyond those of the complete copies of
        the conversations it holds (``<tier>_unheld_bytes``: reservations of appends or
        promotions in flight, or space a dropped or moved copy did not give back)."""
        assert self._portal is not None
        used, held = self._portal.call(self._holdings)  # on the loop: a consistent view
        return {
            "loads": len(self._pending_loads),
            "saves": len(self._pending_saves),
            "copies": len(self._copying),
            "save_tasks": len(self._tasks()),
            "sidecar_locks": len(self._sidecar_locks),
            **{f"{tier}_unheld_bytes": n - held.get(tier, 0) for tier, n in used.items()},
            "staging_bytes": self._staging.nbytes(),
        }

    def _holdings(self) -> tuple[dict[str, int], dict[str, int]]:
        return {t.name: t.used for t in self.cache.stats().tiers}, self.held()

    def held(self) -> dict[str, int]:
        """Per tier, the bytes of the complete copies of the conversations stored there,
        each stored segment counted once (the history forks share is stored once)."""
        # the cache's index of segments: the metadata channel says how large each
        # conversation is, not which of its bytes it shares with its forks
        core = self.cache._core
        out: dict[str, int] = {}
        for t, tier in enumerate(core.tiers):
            held: dict[Any, int] = {}
            for s in core.sessions.values():
                if s.complete(t):
                    held.update((seg.key, seg.length) for seg in s.segs)
            # a conversation that left while forks list its turns keeps a marker there
            held.update(
                ((owner, RETIRED_SEQ), plan_retirement(owner).length)
                for owner, r in core.retired.items()
                if t in r.markers
            )
            if held:
                out[tier.name] = sum(held.values())
        return out

    def stored_sessions(self) -> int:
        """Conversations the cache stores (a complete copy in some tier)."""
        channel = self.cache.channel
        return sum(1 for s in channel if (m := channel.get(s)) is not None and m.tier is not None)

    def wait_any(self, timeout: float) -> None:
        """Block until a pending load, copy or save finishes, ``timeout`` seconds at most
        (at once if none is pending)."""
        futs: list[concurrent.futures.Future[Any]] = [
            *(f for _, f in self._pending_loads.values()),
            *(f for _, f in self._pending_saves.values()),
            *self._copying.values(),
        ]
        if futs:
            concurrent.futures.wait(futs, timeout, concurrent.futures.FIRST_COMPLETED)

    def wait_idle(self, timeout: float = 60.0, poll: Callable[[], None] | None = None) -> None:
        """Block until no save or load is pending (tests and shutdown)."""
        deadline = time.monotonic() + timeout
        while self._pending_saves or self._pending_loads or self._tasks():
            futs = [f for _, f in (*self._pending_saves.values(), *self._pending_loads.values())]
            futs += self._tasks()
            concurrent.futures.wait(futs, timeout=max(0.0, deadline - time.monotonic()))
            if poll is not None:
                poll()
            if time.monotonic() > deadline:
                raise TimeoutError("tieredkv saves/loads still pending")
            if poll is None:
                break


class LayerStream:
    """A layer-wise load in flight during one forward pass."""

    def __init__(self, op: LoadOp, names: list[str]) -> None:
        self.op = op
        self.names = names
        self.group = {name: g for g, name in enumerate(names)}
        self.future: concurrent.futures.Future[bool] | None = None
        self.load: LayerwiseLoad | None = None
        self.out: dict[str, torch.Tensor] = {}
        self.done: set[int] = set()
        self.failed = False


_Op = TypeVar("_Op", LoadOp, SaveOp)


def _drain(
    pending: dict[str, tuple[_Op, concurrent.futures.Future[Any]]], what: str
) -> list[tuple[_Op, bool]]:
    """Take the finished operations out of ``pending``, with whether each succeeded (an
    exception counts as a failure and is logged)."""
    done = []
    for req_id, (op, fut) in list(pending.items()):
        if not fut.done():
            continue
        del pending[req_id]
        try:
            ok = bool(fut.result())
        except Exception:
            _log.exception("%s %s for %s failed", what, op.session, op.req_id)
            ok = False
        done.append((op, ok))
    return done


def decode_meta(data: bytes) -> KVMeta:
    """A :class:`KVMeta` from a worker report."""
    return msgspec.msgpack.decode(data, type=KVMeta)


def _not_stored(op: SaveOp, held: int, at: int) -> None:
    """Log a turn not stored because its conversation holds ``held`` tokens, not ``at``."""
    _log.info(
        "not storing %s's turn: %s holds %d tokens, the turn starts at %d",
        op.req_id,
        op.session,
        held,
        at,
    )
