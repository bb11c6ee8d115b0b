"""Serving systems as compositions of a tier layout, a scheduler and an eviction policy.

A :class:`SystemSpec` names the parts; the presets are the paper's baselines and Bidaw:

======================  ======================================================================
``vllm``                no KV cache: every turn recomputes its history (FCFS)
``cachedattention``     host + SSD, exclusive; FCFS with look-ahead prefetching (the loads of
                        the next 30 queued requests, in queue order); queue-enhanced
                        eviction (window 30); host -> GPU loads overlapped layer by layer
                        with prefill; asynchronous saves (SSD writes yield to loads)
``flashgen``            host + SSD, inclusive (every new segment written through to SSD, so
                        evicting a KV never writes); FCFS; LRU; saves in line with loads
``bidaw``               CachedAttention's layout with Bidaw's three mechanisms: dual-queue
                        disk-HRRN scheduling, previous-answer eviction, and the normalized
                        activation cached instead of K/V when the model is MHA
``ideal``               all KV in host memory (unbounded), FCFS
======================  ======================================================================

Any combination composes: ``SystemSpec(name="mine", scheduler="bidaw", eviction="lru",
inclusive=True)``; :func:`get_system` takes a preset name plus overrides (the ablation
switches of ``bidaw`` are overrides: ``scheduler="fcfs"``, ``eviction="queue-enhanced"``,
``storage_efficient=False``).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ..policies.lookahead import LookAheadFCFS
from ..policies.registry import make_scheduler, scheduler_parameters
from ..policies.scheduling import Scheduler

__all__ = ["ABLATIONS", "SYSTEMS", "LookAheadFCFS", "SystemSpec", "build_scheduler", "get_system"]


class SystemSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One serving system.

    :param name: label in tables and plots
    :param cache: ``"none"`` (recompute every history), ``"two-tier"`` (host + SSD), or
        ``"host-only"`` (unbounded host memory: the ideal)
    :param scheduler: scheduler registry name (:func:`tieredkv.policies.make_scheduler`)
    :param eviction: host-tier eviction registry name (:func:`tieredkv.policies.make_eviction`)
    :param inclusive: keep an SSD copy of everything (write-through of each new segment);
        otherwise exclusive: a KV lives in one tier and eviction writes it to SSD
    :param layerwise_overlap: host -> GPU copies overlap prefill layer by layer
    :param storage_efficient: cache the normalized activation instead of K/V when it is
        smaller (MHA models); K/V are re-projected at load
    :param max_loads: SSD loads in flight at most
    :param hrrn_by_time: rank disk-HRRN by estimated load time (the SSD bandwidth is passed
        to the scheduler) rather than by bytes
    :param eviction_kwargs: extra constructor arguments of the eviction policy
    :param prefetch_window: with the ``fcfs`` scheduler, start SSD loads only for the next
        ``prefetch_window`` queued requests (CachedAttention's look-ahead prefetching window;
        :class:`~tieredkv.policies.LookAheadFCFS`, re-exported here); ``None``: for every
        queued request, in arrival order
    :param prefetch: with the ``fcfs`` scheduler, start the loads of queued requests ahead of
        time; ``False``: a request's load starts when the engine asks for it (on demand)
    :param background_writes: SSD writes (demotions, write-through) are asynchronous
        saves: they wait in a host write buffer (``SimConfig.write_buffer_gb``) and use the
        SSD only while no load needs it; otherwise every transfer, read or write, queues in
        one FIFO
    :param keep_ssd_copy: (exclusive layouts) a KV loaded into host memory keeps its SSD
        segments, which stay valid (a history only grows), so moving it down again writes
        only the segments added since; ``False``: the load deletes the SSD copy and moving
        down rewrites the whole history. Loads are served from host memory either way
    :param clean_ahead: (with ``keep_ssd_copy`` and ``background_writes``) a turn's new
        segments are written to SSD while the SSD has nothing else to do, oldest first, so
        that moving the KV down later writes nothing (loads come first: these writes use
        only idle time, after the write buffer's backlog)
    :param blocking_loads: the engine waits for the SSD load of the request it must run
        next with the GPU idle: while an I/O-oblivious scheduler (FCFS) holds its head back
        for a load, no iteration runs, not even the running requests' decoding (an engine
        whose step fetches the scheduled request's KV before computing, as the Bidaw paper
        describes the baselines: "the GPU waits"); ``False``: the running batch keeps
        decoding meanwhile
    :param predictive_prefetch: (beyond the paper) while the SSD idles, bring into host
        memory the SSD-resident session that the eviction policy's own reuse model
        (:class:`~tieredkv.policies.base.Foresight`, which ``bidaw`` eviction implements)
        gives the best chance of a hit, when that chance beats the summed chances of the
        residents it would displace (as :meth:`tieredkv.TieredKVCache.prefetch_predicted`
        does); one such read at a time, among the 256 most recently active users
    :param protect_ready: the engine shields the KV of queued requests that the scheduler
        counts on being in host memory (``ready_sessions()``) from eviction; ``False``
        protects only the running requests, and an evicted ready request recomputes its
        history (what an engine that does not talk to its cache does)
    """

    name: str
    cache: str = "two-tier"
    scheduler: str = "fcfs"
    eviction: str = "lru"
    inclusive: bool = False
    layerwise_overlap: bool = True
    storage_efficient: bool = False
    max_loads: int = 1
    hrrn_by_time: bool = True
    eviction_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    prefetch_window: int | None = None
    prefetch: bool = True
    background_writes: bool = False
    keep_ssd_copy: bool = False
    clean_ahead: bool = False
    blocking_loads: bool = False
    predictive_prefetch: bool = False
    protect_ready: bool = True

    def __post_init__(self) -> None:
        if self.cache not in ("none", "two-tier", "host-only"):
            raise ValueError(
                f"cache must be 'none', 'two-tier' or 'host-only' (got {self.cache!r})"
            )
        if self.max_loads < 1:
            raise ValueError(f"max_loads must be >= 1 (got {self.max_loads})")
        if self.prefetch_window is not None and self.prefetch_window < 1:
            raise ValueError(
                f"prefetch_window must be >= 1 queued requests, or None (got "
                f"{self.prefetch_window})"
            )


def build_scheduler(system: SystemSpec, *, ssd_latency: float, ssd_bandwidth: float) -> Scheduler:
    """A new scheduler for ``system``, built through the policy registry with the settings
    its factory takes (:func:`~tieredkv.policies.scheduler_parameters`): ``max_loads``;
    ``window`` (``prefetch_window``) or else ``prefetch``; the SSD's ``latency``; and its
    ``bandwidth`` with ``hrrn_by_time``.

    :param ssd_latency: fixed seconds per SSD transfer
    :param ssd_bandwidth: SSD bytes per second
    :raises ValueError: for a ``prefetch_window`` on a scheduler that takes no window
    :raises UnknownPolicyError: for a scheduler name not registered
    """
    takes = scheduler_parameters(system.scheduler)
    kwargs: dict[str, object] = {"max_loads": system.max_loads}
    if system.prefetch_window is not None:
        if "window" not in takes:
            raise ValueError(
                f"prefetch_window applies to a scheduler with a look-ahead window, such as "
                f"fcfs (got {system.scheduler!r})"
            )
        kwargs["window"] = system.prefetch_window
    elif "prefetch" in takes:
        kwargs["prefetch"] = system.prefetch
    if "latency" in takes:
        kwargs["latency"] = ssd_latency
    if "bandwidth" in takes and system.hrrn_by_time:
        kwargs["bandwidth"] = ssd_bandwidth
    return make_scheduler(system.scheduler, **kwargs)


SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec(name="vllm", cache="none", scheduler="fcfs", eviction="lru"),
        SystemSpec(
            name="cachedattention",
            scheduler="fcfs",
            eviction="queue-enhanced",
            prefetch_window=30,
            background_writes=True,
            keep_ssd_copy=True,
            clean_ahead=True,
            blocking_loads=True,
        ),
        SystemSpec(
            name="flashgen",
            scheduler="fcfs",
            eviction="lru",
            inclusive=True,
            layerwise_overlap=False,
            prefetch=False,
            blocking_loads=True,
            protect_ready=False,
        ),
        SystemSpec(
            name="bidaw",
            scheduler="bidaw",
            eviction="bidaw-paper",  # the paper's policy: this preset reproduces the paper
            storage_efficient=True,
            background_writes=True,
            keep_ssd_copy=True,
            clean_ahead=True,
        ),
        SystemSpec(name="ideal", cache="host-only", scheduler="fcfs", eviction="lru"),
    )
}
"""The presets, by name."""

ABLATIONS: list[SystemSpec] = [
    SYSTEMS["cachedattention"],
    # Bidaw without its mechanisms, added back one at a time (same write path throughout)
    msgspec.structs.replace(
        SYSTEMS["bidaw"],
        name="+io-aware scheduling",
        eviction="queue-enhanced",
        storage_efficient=False,
    ),
    msgspec.structs.replace(
        SYSTEMS["bidaw"], name="+answer-based eviction", storage_efficient=False
    ),
    msgspec.structs.replace(SYSTEMS["bidaw"], name="+storage-efficient tensors (bidaw)"),
]
"""The paper's ablation: CachedAttention, then Bidaw's mechanisms added one at a time."""


def get_system(name: str, **overrides: Any) -> SystemSpec:
    """The preset ``name`` (case-insensitive) with ``overrides`` applied.

    :raises ValueError: for an unknown name (the message lists the presets)
    """
    try:
        spec = SYSTEMS[name.strip().lower()]
    except KeyError:
        raise ValueError(f"unknown system {name!r}; presets: {', '.join(SYSTEMS)}") from None
    return msgspec.structs.replace(spec, **overrides) if overrides else spec
