"""Serving systems as compositions of a tier layout, a scheduler and an eviction policy.

A :class:`SystemSpec` names the parts; the presets are the paper's baselines and Bidaw:

======================  ======================================================================
``vllm``                no KV cache: every turn recomputes its history (FCFS)
``cachedattention``     host + SSD, exclusive; FCFS; queue-enhanced eviction (window 30);
                        host -> GPU loads overlapped layer by layer with prefill
``flashgen``            host + SSD, inclusive (every new segment written through to SSD, so
                        evicting a KV never writes); FCFS; LRU
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

__all__ = ["ABLATIONS", "SYSTEMS", "SystemSpec", "get_system"]


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

    def __post_init__(self) -> None:
        if self.cache not in ("none", "two-tier", "host-only"):
            raise ValueError(
                f"cache must be 'none', 'two-tier' or 'host-only' (got {self.cache!r})"
            )
        if self.max_loads < 1:
            raise ValueError(f"max_loads must be >= 1 (got {self.max_loads})")


SYSTEMS: dict[str, SystemSpec] = {
    s.name: s
    for s in (
        SystemSpec(name="vllm", cache="none", scheduler="fcfs", eviction="lru"),
        SystemSpec(name="cachedattention", scheduler="fcfs", eviction="queue-enhanced"),
        SystemSpec(
            name="flashgen",
            scheduler="fcfs",
            eviction="lru",
            inclusive=True,
            layerwise_overlap=False,
        ),
        SystemSpec(name="bidaw", scheduler="bidaw", eviction="bidaw", storage_efficient=True),
        SystemSpec(name="ideal", cache="host-only", scheduler="fcfs", eviction="lru"),
    )
}
"""The presets, by name."""

ABLATIONS: list[SystemSpec] = [
    SystemSpec(name="cachedattention", scheduler="fcfs", eviction="queue-enhanced"),
    SystemSpec(name="+io-aware scheduling", scheduler="bidaw", eviction="queue-enhanced"),
    SystemSpec(name="+answer-based eviction", scheduler="bidaw", eviction="bidaw"),
    SystemSpec(
        name="+storage-efficient tensors (bidaw)",
        scheduler="bidaw",
        eviction="bidaw",
        storage_efficient=True,
    ),
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
