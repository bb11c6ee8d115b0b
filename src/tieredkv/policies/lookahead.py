"""CachedAttention's look-ahead FCFS: loads only for the head of the queue."""

from __future__ import annotations

from .fcfs import FCFS

__all__ = ["LookAheadFCFS"]


class LookAheadFCFS(FCFS):
    """FCFS whose SSD loads start only for the next ``window`` queued requests.

    CachedAttention (Gao et al., USENIX ATC'24, section 3.3) prefetches, from SSD into host
    memory, the KV of the jobs inside a look-ahead window of its FCFS job queue, in queue
    order, so that loads overlap the running jobs without filling host memory with KV that
    runs much later. This is :class:`~tieredkv.policies.FCFS` with ``prefetch=True`` and
    that ``window`` (registered as ``"fcfs-lookahead"``; ``make_scheduler("fcfs",
    window=...)`` builds one too). Requests must be submitted in arrival order (the
    simulator and the serving engine do; see :class:`~tieredkv.policies.FCFS`).

    :param max_loads: loads in flight at most
    :param window: queued requests (from the head) whose loads may start
    :raises ValueError: for a window below 1
    """

    name = "fcfs-lookahead"

    def __init__(self, max_loads: int = 1, *, window: int = 30) -> None:
        super().__init__(max_loads, prefetch=True, window=window)
