"""tieredkv: tiered KV caching for multi-turn LLM serving (the Bidaw design, FAST'26).

The public API is re-exported here and loaded lazily, so that importing
:mod:`tieredkv.policies` alone pulls in no asyncio: policies are pure objects shared with
the simulator.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "AddressableTier": ".backends.base",
    "Tier": ".backends.base",
    "TierStats": ".backends.base",
    "HostMemoryTier": ".backends.memory",
    "MmapTier": ".backends.mmap",
    "SSDTier": ".backends.ssd",
    "CacheStats": ".cache",
    "TieredKVCache": ".cache",
    "CapacityError": ".errors",
    "ClosedError": ".errors",
    "CorruptSegmentError": ".errors",
    "InvalidArgumentError": ".errors",
    "InvalidTypeError": ".errors",
    "SchemaMismatchError": ".errors",
    "SessionNotFoundError": ".errors",
    "TieredKVError": ".errors",
    "TierIOError": ".errors",
    "UnknownPolicyError": ".errors",
    "Event": ".meta",
    "KVMeta": ".meta",
    "MetadataChannel": ".meta",
    "MetadataView": ".meta",
    "Eviction": ".policies.base",
    "LRU": ".policies.lru",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tieredkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from .backends.base import AddressableTier as AddressableTier
    from .backends.base import Tier as Tier
    from .backends.base import TierStats as TierStats
    from .backends.memory import HostMemoryTier as HostMemoryTier
    from .backends.mmap import MmapTier as MmapTier
    from .backends.ssd import SSDTier as SSDTier
    from .cache import CacheStats as CacheStats
    from .cache import TieredKVCache as TieredKVCache
    from .errors import CapacityError as CapacityError
    from .errors import ClosedError as ClosedError
    from .errors import CorruptSegmentError as CorruptSegmentError
    from .errors import InvalidArgumentError as InvalidArgumentError
    from .errors import InvalidTypeError as InvalidTypeError
    from .errors import SchemaMismatchError as SchemaMismatchError
    from .errors import SessionNotFoundError as SessionNotFoundError
    from .errors import TieredKVError as TieredKVError
    from .errors import TierIOError as TierIOError
    from .errors import UnknownPolicyError as UnknownPolicyError
    from .meta import Event as Event
    from .meta import KVMeta as KVMeta
    from .meta import MetadataChannel as MetadataChannel
    from .meta import MetadataView as MetadataView
    from .policies.base import Eviction as Eviction
    from .policies.lru import LRU as LRU
