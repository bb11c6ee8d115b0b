"""Pure, synchronous decision makers: eviction and scheduling policies.

Nothing under this package performs I/O, reads a clock or imports asyncio: ``now`` comes in
as an argument, so the same objects run in the live cache and in the simulator.
"""

from __future__ import annotations

from .adaptive_bidaw import AdaptiveBidaw as AdaptiveBidaw
from .base import Eviction as Eviction
from .base import Foresight as Foresight
from .base import Hinted as Hinted
from .belady import Belady as Belady
from .bidaw_eviction import BidawEviction as BidawEviction
from .bidaw_scheduler import BidawScheduler as BidawScheduler
from .fcfs import FCFS as FCFS
from .fifo import FIFO as FIFO
from .ghost import GhostCache as GhostCache
from .lfu import LFU as LFU
from .lookahead import LookAheadFCFS as LookAheadFCFS
from .lru import LRU as LRU
from .queue_enhanced import QueueEnhanced as QueueEnhanced
from .registry import eviction_names as eviction_names
from .registry import make_eviction as make_eviction
from .registry import make_scheduler as make_scheduler
from .registry import register_eviction as register_eviction
from .registry import register_scheduler as register_scheduler
from .registry import scheduler_names as scheduler_names
from .registry import scheduler_parameters as scheduler_parameters
from .scheduling import Request as Request
from .scheduling import Scheduler as Scheduler

__all__ = [
    "FCFS",
    "FIFO",
    "LFU",
    "LRU",
    "AdaptiveBidaw",
    "Belady",
    "BidawEviction",
    "BidawScheduler",
    "Eviction",
    "Foresight",
    "Hinted",
    "GhostCache",
    "LookAheadFCFS",
    "QueueEnhanced",
    "Request",
    "Scheduler",
    "eviction_names",
    "make_eviction",
    "make_scheduler",
    "register_eviction",
    "register_scheduler",
    "scheduler_names",
    "scheduler_parameters",
]
