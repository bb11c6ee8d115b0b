"""Storage tiers: the :class:`Tier` protocol and its implementations, one per module."""

from __future__ import annotations

from .base import AddressableTier as AddressableTier
from .base import SegmentKey as SegmentKey
from .base import Tier as Tier
from .base import TierStats as TierStats
from .memory import HostMemoryTier as HostMemoryTier
from .mmap import MmapTier as MmapTier
from .shared import SharedTier as SharedTier
from .ssd import SSDTier as SSDTier

__all__ = [
    "AddressableTier",
    "HostMemoryTier",
    "MmapTier",
    "SSDTier",
    "SegmentKey",
    "SharedTier",
    "Tier",
    "TierStats",
]


def __getattr__(name: str) -> object:
    # RedisTier needs the optional redis client: imported on first use only
    if name == "RedisTier":
        from .redis import RedisTier

        return RedisTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
