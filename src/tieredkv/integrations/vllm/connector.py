"""``TieredKVConnector``: vLLM's KV connector API (``KVConnectorBase_V1``) over tieredkv.

vLLM builds one instance in its scheduler process (role ``SCHEDULER``: it runs
:class:`~.scheduler.SchedulerSide`) and one in each worker (role ``WORKER``: it runs
:class:`~.worker.WorkerStore`, which owns the :class:`~tieredkv.TieredKVCache`). The two
share no memory: the scheduler side's plan for a step travels to the workers in the
connector metadata vLLM hands them, and the workers' report comes back in the worker
metadata of the step's output, as vLLM's own offloading connector does it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...errors import InvalidArgumentError
from .config import ConnectorConfig, parse_config
from .events import KVEvents
from .hints import read_hint, tenant_of
from .keys import (
    PLAIN,
    FilesDigests,
    RequestKeys,
    extra_key_digest,
    fingerprint,
    identity_digest,
    model_identity,
)
from .ops import LoadOp, SaveOp, StepPlan, WorkerReport
from .scheduler import SchedulerSide
from .worker import LayerStream, WorkerStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["TieredKVConnector", "TieredKVConnectorStats"]

_log = logging.getLogger(__name__)

IDLE_WAIT = 0.01
"""Seconds a worker waits, at most, in a step where vLLM computes nothing, for one of its
pending loads, copies or saves to finish."""

#: counters the workers report per step (vLLM's connector stats); times in seconds
STAT_KEYS = (
    "loads",
    "host_hits",
    "lower_hits",
    "load_errors",
    "loaded_tokens",
    "streamed_layers",
    "load_seconds",
    "saved_tokens",
    "saved_bytes",
    "save_errors",
    "index_errors",
    "forks",
    "pins_refused",
)


@dataclass
class TieredKVMetadata(KVConnectorMetadata):
    """The scheduler side's plan for one step (loads and saves)."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class TieredKVWorkerMetadata(KVConnectorWorkerMetadata):
    """The workers' reports for one step: a worker's own, and after vLLM aggregated the
    step's outputs of its tensor-parallel ranks, one per rank that reported (the
    scheduler side counts a save or a load complete once every rank reported it; a rank
    may report it a step later than another)."""

    reports: list[WorkerReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TieredKVWorkerMetadata)
        self.reports.extend(other.reports)
        return self


class TieredKVConnectorStats(KVConnectorStats):
    """The workers' counters over an interval: loads (host hits and lower-tier hits),
    load errors, tokens loaded and saved, layers a load filled while vLLM waited for them
    (layer by layer, within the forward pass), bytes saved, seconds spent loading, turns
    stored as forks of another conversation (their shared blocks not stored again), pins
    that requests asked for and a bound on pinned bytes refused."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: self.data.get(key, 0) for key in STAT_KEYS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class TieredKVPromMetrics(KVConnectorPromMetrics):
    """The connector's counters as Prometheus counters in vLLM's ``/metrics``
    (``vllm:tieredkv_<counter>_total``, labelled per engine)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key in STAT_KEYS:
            counter = self._counter_cls(
                name=f"vllm:tieredkv_{key}",
                documentation=f"tieredkv connector: {key.replace('_', ' ')}",
                labelnames=labelnames,
            )
            self._counters[key] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)


_KEPT_WHOLE = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
"""The KV cache specs whose blocks hold every token's KV until the request finishes."""


def model_fingerprint(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_id: str | None = None
) -> str:
    """What makes this engine's KV blocks interchangeable (see :func:`.keys.fingerprint`):
    the model's weights (``model_id`` if the operator pins it, else
    :func:`.keys.model_identity`), its dtype, quantization and config overrides, the KV
    dtype, block size and layout."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise InvalidArgumentError(
            f"the TieredKVConnector serves models with one KV cache group; this one has "
            f"{len(groups)} (hybrid attention)"
        )
    spec = groups[0].kv_cache_spec
    if type(spec).__name__ not in _KEPT_WHOLE:
        # a sliding window's (or R-SWA's, a chunked-local's) blocks that fall out of the
        # window are given back as vLLM's null block before a request finishes: a stored
        # turn would hold the null block's bytes where its KV was, and a prompt sharing
        # part of it would be served them (its answer changed)
        raise InvalidArgumentError(
            f"the TieredKVConnector serves models whose KV cache keeps every block (full "
            f"attention); this one's is {type(spec).__name__}, which frees the blocks that "
            f"leave its window"
        )
    parallel = vllm_config.parallel_config
    layout = (
        f"{type(spec).__name__}:{len(groups[0].layer_names)}L:"
        f"{getattr(spec, 'num_kv_heads', '?')}H:{getattr(spec, 'head_size', '?')}D:"
        f"{kv_cache_config.kv_cache_layout}:tp{parallel.tensor_parallel_size}"
        f":pp{parallel.pipeline_parallel_size}"
    )
    model = vllm_config.model_config
    overrides = model.hf_overrides
    if callable(overrides):  # a function of the config: its effect is not knowable here
        overrides = {"callable": getattr(overrides, "__qualname__", repr(overrides))}
    arithmetic = json.dumps(
        [str(model.dtype), model.quantization, overrides], sort_keys=True, default=str
    )
    return fingerprint(
        model=str(model.model),
        identity=model_identity(str(model.model), model.revision, model_id=model_id),
        dtype=arithmetic,
        kv_dtype=f"{vllm_config.cache_config.cache_dtype}/{getattr(spec, 'dtype', '?')}",
        block_size=vllm_config.cache_config.block_size,
        layout=layout,
    )


def request_keys(request: Request, block_size: int, digests: FilesDigests) -> RequestKeys | None:
    """What besides its tokens keys a request's blocks, from the extra keys vLLM's own
    prefix cache adds to them (``generate_block_hash_extra_keys``): the LoRA adapter (with
    a digest of its files added), the ``cache_salt``, and per block its multimodal inputs.

    ``None``, with a log line saying why, for a request that cannot be keyed safely:
    nothing of it is stored or served. That is one with prompt embeddings (the token ids
    stored with its KV, which every load compares before it fills a block, are
    placeholders there) or whose adapter's files cannot be read.
    """
    if request.prompt_embeds is not None:
        _log.info(
            "tieredkv: not storing or serving %s: its prompt is given as embeddings, whose "
            "positions have no token ids to check a stored history against",
            request.request_id,
        )
        return None
    lora = request.lora_request
    if not lora and not request.cache_salt and not request.mm_features:
        return PLAIN
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    whole: list[tuple[Any, ...]] = []
    extra: list[str] = []
    blocks = -(-request.num_prompt_tokens // block_size) if request.mm_features else 1
    try:
        for i in range(blocks):
            keys, _ = generate_block_hash_extra_keys(
                request, i * block_size, (i + 1) * block_size, 0
            )
            own = []
            for key in keys or ():
                if key[0] == "lora" and lora:
                    if i == 0:
                        whole.append((*key, digests.digest(_adapter_path(lora.lora_path))))
                elif key[0] == "cache_salt":
                    whole.append(key)
                else:
                    own.append(key)
            extra.append(extra_key_digest(own))
    except (InvalidArgumentError, OSError, TypeError, ValueError) as exc:
        _log.warning(
            "tieredkv: not storing or serving %s: its keys cannot be established (%s)",
            request.request_id,
            exc,
        )
        return None
    while extra and not extra[-1]:
        extra.pop()
    return RequestKeys(identity_digest(whole), tuple(extra))


class KeysByRequest:
    """Each request's keys (:func:`request_keys`), computed once per prompt: a
    streaming-input request (one request id whose later chunks extend its prompt and its
    multimodal inputs, as vLLM's resumable requests do) gets them again once its prompt
    grew, so that the blocks of a later chunk are stored and matched under their own
    media's keys, never under the first chunk's."""

    def __init__(self, block_size: int, digests: FilesDigests) -> None:
        self._block_size = block_size
        self._digests = digests
        self._keys: dict[str, tuple[tuple[int, int], RequestKeys | None]] = {}

    def get(self, request: Request) -> RequestKeys | None:
        stamp = (request.num_prompt_tokens, len(request.mm_features or ()))
        got = self._keys.get(request.request_id)
        if got is None or got[0] != stamp:
            got = (stamp, request_keys(request, self._block_size, self._digests))
            self._keys[request.request_id] = got
        return got[1]

    def pop(self, request_id: str) -> None:
        """Forget a finished request's keys."""
        self._keys.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._keys)


def _adapter_path(path: str) -> str:
    """A LoRA adapter's local directory (vLLM resolves a hub name to its download)."""
    from vllm.lora.utils import get_adapter_absolute_path

    return get_adapter_absolute_path(path)


class TieredKVConnector(KVConnectorBase_V1):
    """Bidaw's tiered KV cache inside vLLM: select it with
    ``KVTransferConfig(kv_connector="TieredKVConnector",
    kv_connector_module_path="tieredkv.integrations.vllm", kv_role="kv_both",
    kv_connector_extra_config={...})`` (keys: :class:`~.config.ConnectorConfig`)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.config: ConnectorConfig = parse_config(extra)
        self.block_size: int = vllm_config.cache_config.block_size
        self.fp = model_fingerprint(vllm_config, kv_cache_config, self.config.model_id)
        self._digests = FilesDigests()
        self._keys = KeysByRequest(self.block_size, self._digests)
        events = vllm_config.kv_events_config
        self._events: KVEvents | None = None
        if role == KVConnectorRole.SCHEDULER and events and events.enable_kv_cache_events:
            self._events = KVEvents(self.block_size)
        self._scheduler: SchedulerSide | None = None
        self._store: WorkerStore | None = None
        self._load_errors: set[int] = set()
        self._recving: set[str] = set()
        self._failed: set[str] = set()
        self._sending: set[str] = set()
        self._unsaved: list[tuple[SaveOp, bool]] = []  # saves that never started
        self._finished_loads: list[Any] = []
        self._streams: list[LayerStream] = []
        self._drained = True
        if role == KVConnectorRole.SCHEDULER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                # a history the cache cannot serve (damaged, lost, an I/O error) is a miss:
                # vLLM recomputes its blocks rather than failing the request (vLLM reads
                # this setting right after building its connector)
                _log.warning(
                    "TieredKVConnector sets kv_load_failure_policy='recompute' (was %r): a "
                    "failed load is recomputed, never an error for the request",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
                self._kv_transfer_config.kv_load_failure_policy = "recompute"
            parallel = vllm_config.parallel_config
            self._scheduler = SchedulerSide(
                self.config,
                self.fp,
                self.block_size,
                workers=parallel.tensor_parallel_size * parallel.pipeline_parallel_size,
            )
        else:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            tp_rank = get_tensor_model_parallel_rank()
            # one rank per worker, each with its own shard (a directory and Redis keys of its
            # own: with pipeline stages, the tensor-parallel rank alone would repeat); the
            # scheduler side counts every worker's report under it
            self._report_rank = (
                get_pp_group().rank_in_group * get_tensor_model_parallel_world_size() + tp_rank
            )
            self._store = WorkerStore(
                self.config,
                self.fp,
                self.block_size,
                rank=self._report_rank,
                per_block_keys=vllm_config.model_config.is_multimodal_model,
            )

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # vLLM asks this while it builds its config, before the engine starts (on builds
        # with CUDA graphs): the earliest point a bad config can be refused
        return parse_config(extra_config).layerwise  # layer hooks cannot run in a graph

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped save is a future miss, never wrong KV

    # -- scheduler side ------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        keys = self._request_keys(request)
        if keys is None:
            return 0, False
        return self._scheduler.match(
            request.request_id, request.prompt_token_ids or [], num_computed_tokens, keys
        )

    def _request_keys(self, request: Request) -> RequestKeys | None:
        """The request's keys besides its tokens, ``None`` if it cannot be keyed safely
        (then nothing of it is stored or served); see :class:`KeysByRequest`."""
        return self._keys.get(request)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(
            request.request_id,
            request.prompt_token_ids or [],
            blocks.get_block_ids()[0] if num_external_tokens > 0 else (),
            num_external_tokens,
        )

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        host = self._scheduler.from_host.pop(request.request_id, True)
        if num_external_tokens == 0:
            return {}
        return {CacheHitSource.HOST if host else CacheHitSource.DISK: num_external_tokens}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        plan = self._scheduler.plan()
        plan.idle = scheduler_output.total_num_scheduled_tokens == 0
        return TieredKVMetadata(plan=plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        meta = connector_output.kv_connector_worker_meta
        reports = meta.reports if isinstance(meta, TieredKVWorkerMetadata) else []
        done = self._scheduler.update(reports, set(connector_output.failed_recving or ()))
        if self._events is not None:
            self._events.update(done)
        drained = self._scheduler.drained()
        if drained and not self._drained:
            _log.debug("tieredkv scheduler side drained: %s", self._scheduler_state())
        self._drained = drained

    def scheduler_state(self) -> dict[str, Any]:
        """The scheduler side's state, read only: what it holds for requests (the keys of
        :meth:`.SchedulerSide.busy`, the requests whose keys are kept, ``keys``, and with
        KV events on, the turns whose hashes wait for their save's report,
        ``event_turns``: all 0 once every request finished and every save was reported),
        the requests finished and withdrawn so far, the longest wait after a load, and the
        conversations indexed (``indexed``)."""
        assert self._scheduler is not None
        side = self._scheduler
        return {
            **side.busy(),
            "keys": len(self._keys),
            **({} if self._events is None else self._events.busy()),
            "finished": side.finished_requests,
            "withdrawn": side.withdrawn,
            "longest_wait": side.longest_wait,
            "indexed": len(side.index),
        }

    def worker_state(self) -> dict[str, int]:
        """The worker's state, read only: what it holds for requests (the keys of
        :meth:`.WorkerStore.busy`, and the request ids and outcomes not yet handed to
        vLLM: all 0 once nothing is in flight) and the conversations its cache stores
        (``stored_sessions``)."""
        assert self._store is not None
        return {
            **self._store.busy(),
            "recving": len(self._recving),
            "sending": len(self._sending),
            "unsaved": len(self._unsaved),
            "unreported_loads": len(self._finished_loads),
            "streams": len(self._streams),
            "load_errors": len(self._load_errors),
            "stored_sessions": self._store.stored_sessions(),
        }

    def _scheduler_state(self) -> str:
        return json.dumps(self.scheduler_state())

    def has_pending_push_work(self) -> bool:
        # vLLM keeps stepping while a finished turn is being stored, so the workers'
        # report of it arrives with no other request running: the next request, or a
        # fork, that continues it is then served from it; and while the next plan holds
        # a finished request's hint (a pin of a turn stored already) or a withdrawn load,
        # so that an idle server's workers still get them
        side = self._scheduler
        return side is not None and (side.saving() or side.unsent())

    def _announce(self, request: Request) -> None:
        """Keep vLLM's block hashes of a turn being saved, for its events."""
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        assert self._events is not None
        lora = request.lora_request
        self._events.finishing(
            request.request_id,
            [maybe_convert_block_hash(h) for h in request.block_hashes],
            request.all_token_ids,
            lora.lora_int_id if lora else None,
            lora.lora_name if lora else None,
        )

    def take_events(self) -> Iterable[KVCacheEvent]:
        return () if self._events is None else self._events.take()

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # every phase of a request ends here, aborts included (see SchedulerSide.finished:
        # a request still waiting for its KV stores nothing and is reported once)
        assert self._scheduler is not None
        keys = self._request_keys(request)
        self._keys.pop(request.request_id)
        hint, echo = None, None
        if request.kv_transfer_params:
            hint, echo = read_hint(
                request.kv_transfer_params,
                request.request_id,
                allowed=self.config.client_hints,
                max_ttl=self.config.max_pin_ttl,
            )
        delay = self._scheduler.finished(
            request.request_id,
            request.all_token_ids if keys is not None else (),
            block_ids,
            min(request.num_computed_tokens, request.num_tokens - 1),
            request.num_output_tokens,
            keys or PLAIN,
            hint,
            tenant_of(request.cache_salt),
        )
        if self._events is not None and delay:
            self._announce(request)
        return delay, echo

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._store is not None
        self._store.open(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._store is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredKVMetadata)
        for op in meta.plan.loads:
            if op.sync and self.config.layerwise:
                self._streams.append(self._store.start_stream(op))
            elif op.sync:
                self._sync_loaded(op, self._store.load_sync(op))
            else:
                self._store.load_async(op)
                self._recving.add(op.req_id)

    def _sync_loaded(self, op: LoadOp, ok: bool) -> None:
        self._finished_loads.append((op, ok))
        if not ok:
            self._load_errors.update(op.block_ids[op.first : op.blocks])

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._streams:
            assert self._store is not None
            self._store.wait_layer(self._streams, layer_name)

    def _finish_streams(self) -> None:
        """Every layer-wise load of this step: its layers in, its bytes verified (before
        vLLM returns anything computed from them; a failed one's blocks are recomputed)."""
        streams, self._streams = self._streams, []
        for stream in streams:
            assert self._store is not None
            self._sync_loaded(stream.op, self._store.finish_stream(stream))

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # a turn ends when its request finishes, which is known only after the step's
        # sampling: its blocks are copied out then (wait_for_save), off the forward pass;
        # copying every step's new blocks layer by layer would copy every decode step's
        return

    def wait_for_save(self) -> None:
        assert self._store is not None
        self._finish_streams()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredKVMetadata)
        for op in meta.plan.saves:
            try:
                self._store.save(op)
            except Exception:
                _log.exception("copying %s's blocks out failed; the turn is not stored", op.req_id)
                self._sending.add(op.req_id)
                self._unsaved.append((op, False))  # reported: the scheduler side stops waiting
        for req_id, session, hint, tenant in meta.plan.hints:
            self._store.hint(req_id, session, hint, tenant)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._store is not None
        self._finish_streams()
        meta = self._connector_metadata
        if isinstance(meta, TieredKVMetadata) and meta.plan.idle:
            # vLLM computes nothing this step and steps again at once: waiting here for
            # a load or a copy to finish, a few ms at most, keeps that loop from taking
            # the CPU (and this process's GIL) from the copies it waits for
            self._store.wait_any(IDLE_WAIT)
        out = KVConnectorTransferResults()
        out.finished_sending, self._sending = self._sending | self._store.copied(), set()
        if isinstance(meta, TieredKVMetadata):
            # loads withdrawn before any worker started them: vLLM holds these requests'
            # blocks until they are reported received (once, here)
            out.finished_recving.update(meta.plan.cancelled)
        for op, ok in self._store.finished_loads():
            self._finished_loads.append((op, ok))
            self._recving.discard(op.req_id)
            out.finished_recving.add(op.req_id)
            if not ok:
                out.failed_recving.add(op.req_id)
                self._load_errors.update(op.block_ids[op.first : op.blocks])
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        assert self._store is not None
        loads, self._finished_loads = self._finished_loads, []
        unsaved, self._unsaved = self._unsaved, []
        report = self._store.report(loads, [*unsaved, *self._store.finished_saves()])
        report.rank = self._report_rank
        return None if report.empty() else TieredKVWorkerMetadata(reports=[report])

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._store is None:
            return None
        data = self._store.take_counters()
        return TieredKVConnectorStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return TieredKVConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return TieredKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        # what each side still holds for requests: all 0 after a clean drain (a number
        # here is a request the connector did not finish, or memory it did not free)
        if self._scheduler is not None:
            _log.info("tieredkv scheduler side at shutdown: %s", self._scheduler_state())
        if self._store is not None:
            if self._store.layers:  # opened
                _log.info("tieredkv worker at shutdown: %s", json.dumps(self.worker_state()))
            self._store.close()
