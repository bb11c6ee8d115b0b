"""tieredkv: tiered KV caching for multi-turn LLM serving (the Bidaw design, FAST'26).

The public API is re-exported here and loaded lazily, so that importing
:mod:`tieredkv.policies` alone pulls in no asyncio: policies are pure objects shared with
the simulator.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

_EXPORTS = {
    "AddressableTier": ".backends.base",
    "Tier": ".backends.base",
    "TierStats": ".backends.base",
    "HostMemoryTier": ".backends.memory",
    "MmapTier": ".backends.mmap",
    "SSDTier": ".backends.ssd",
    "RedisTier": ".backends.redis",
    "SharedTier": ".backends.shared",
    "CacheStats": ".cache",
    "LayerwiseLoad": ".cache",
    "TieredKVCache": ".cache",
    "CapacityError": ".errors",
    "ClosedError": ".errors",
    "CorruptSegmentError": ".errors",
    "ForkedError": ".errors",
    "InvalidArgumentError": ".errors",
    "InvalidTypeError": ".errors",
    "SchemaMismatchError": ".errors",
    "PinLimitError": ".errors",
    "SessionNotFoundError": ".errors",
    "TieredKVError": ".errors",
    "TierIOError": ".errors",
    "LeaseHeldError": ".errors",
    "RestoreFailedError": ".errors",
    "StaleWriterError": ".errors",
    "HistoryConflictError": ".errors",
    "HistoryLengthError": ".errors",
    "HistoryLostError": ".errors",
    "CommitDelayedError": ".errors",
    "TurnRefusedError": ".errors",
    "UnauthenticatedWriterError": ".errors",
    "UnknownFormatError": ".errors",
    "UnknownPolicyError": ".errors",
    "Event": ".meta",
    "KVMeta": ".meta",
    "MetadataChannel": ".meta",
    "MetadataView": ".meta",
    "RetentionHint": ".meta",
    "Eviction": ".policies.base",
    "Foresight": ".policies.base",
    "LRU": ".policies.lru",
    "Demoted": ".meta",
    "Dropped": ".meta",
    "Forgotten": ".meta",
    "Evicted": ".meta",
    "Loaded": ".meta",
    "Promoted": ".meta",
    "Stored": ".meta",
    "Refused": ".meta",
    "TierInfo": ".meta",
    "Transfer": ".meta",
    "BidawEviction": ".policies.bidaw_eviction",
    "BidawScheduler": ".policies.bidaw_scheduler",
    "FCFS": ".policies.fcfs",
    "Request": ".policies.scheduling",
    "Scheduler": ".policies.scheduling",
    "make_eviction": ".policies.registry",
    "make_scheduler": ".policies.registry",
    "UnknownTierError": ".backends.registry",
    "make_tier": ".backends.registry",
    "tier_from_config": ".backends.registry",
    "ServedTurn": ".serve.engine",
    "ServingEngine": ".serve.engine",
    "TurnRequest": ".serve.engine",
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
    from .backends.redis import RedisTier as RedisTier
    from .backends.registry import UnknownTierError as UnknownTierError
    from .backends.registry import make_tier as make_tier
    from .backends.registry import tier_from_config as tier_from_config
    from .backends.shared import SharedTier as SharedTier
    from .backends.ssd import SSDTier as SSDTier
    from .cache import CacheStats as CacheStats
    from .cache import LayerwiseLoad as LayerwiseLoad
    from .cache import TieredKVCache as TieredKVCache
    from .errors import CapacityError as CapacityError
    from .errors import ClosedError as ClosedError
    from .errors import CommitDelayedError as CommitDelayedError
    from .errors import CorruptSegmentError as CorruptSegmentError
    from .errors import ForkedError as ForkedError
    from .errors import HistoryConflictError as HistoryConflictError
    from .errors import HistoryLengthError as HistoryLengthError
    from .errors import HistoryLostError as HistoryLostError
    from .errors import InvalidArgumentError as InvalidArgumentError
    from .errors import InvalidTypeError as InvalidTypeError
    from .errors import LeaseHeldError as LeaseHeldError
    from .errors import PinLimitError as PinLimitError
    from .errors import RestoreFailedError as RestoreFailedError
    from .errors import SchemaMismatchError as SchemaMismatchError
    from .errors import SessionNotFoundError as SessionNotFoundError
    from .errors import StaleWriterError as StaleWriterError
    from .errors import TieredKVError as TieredKVError
    from .errors import TierIOError as TierIOError
    from .errors import TurnRefusedError as TurnRefusedError
    from .errors import UnauthenticatedWriterError as UnauthenticatedWriterError
    from .errors import UnknownPolicyError as UnknownPolicyError
    from .meta import Demoted as Demoted
    from .meta import Dropped as Dropped
    from .meta import Event as Event
    from .meta import Evicted as Evicted
    from .meta import Forgotten as Forgotten
    from .meta import KVMeta as KVMeta
    from .meta import Loaded as Loaded
    from .meta import MetadataChannel as MetadataChannel
    from .meta import MetadataView as MetadataView
    from .meta import Promoted as Promoted
    from .meta import Refused as Refused
    from .meta import RetentionHint as RetentionHint
    from .meta import Stored as Stored
    from .meta import TierInfo as TierInfo
    from .meta import Transfer as Transfer
    from .policies.base import Eviction as Eviction
    from .policies.base import Foresight as Foresight
    from .policies.bidaw_eviction import BidawEviction as BidawEviction
    from .policies.bidaw_scheduler import BidawScheduler as BidawScheduler
    from .policies.fcfs import FCFS as FCFS
    from .policies.lru import LRU as LRU
    from .policies.registry import make_eviction as make_eviction
    from .policies.registry import make_scheduler as make_scheduler
    from .policies.scheduling import Request as Request
    from .policies.scheduling import Scheduler as Scheduler
    from .serve.engine import ServedTurn as ServedTurn
    from .serve.engine import ServingEngine as ServingEngine
    from .serve.engine import TurnRequest as TurnRequest
