"""Host memory: the performance tier.

One arena of ``capacity`` bytes, allocated once (anonymous mmap, so it is page-aligned and
O_DIRECT reads from the SSD tier land in it directly) and carved up by
:class:`~tieredkv.backends.arena.ArenaAllocator`. The byte budget is hard: the arena is
the budget.

When CUDA is present the arena is page-locked ("pinned") for fast, asynchronous
host-to-device copies. It is registered with ``cudaHostRegister`` once, whole, at open:
never one pinned tensor per entry (PyTorch's pinned allocator rounds every allocation up
to a power of two, and pinning per entry costs a system call each time), and never in
several pieces, because CUDA refuses a copy whose host range spans two registrations
(``cudaErrorInvalidValue``), and an entry can sit anywhere in the arena. Without CUDA the
arena is pageable and :meth:`stats` says so.
"""

from __future__ import annotations

import logging
import mmap
from typing import Any

import numpy as np
import torch

from ..errors import TierIOError
from ._buffers import anonymous, close_mapping
from .arena import ArenaTier

__all__ = ["HostMemoryTier"]

_log = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_DEFAULT = 0


class HostMemoryTier(ArenaTier):
    """Host memory as a tier: a preallocated, optionally pinned arena.

    :param capacity: the byte budget (rounded up to 4 KiB)
    :param name: the tier's name in metadata and events
    :param pin: page-lock the arena for CUDA copies; ``None`` (default) pins when CUDA is
        available, ``True`` requires it, ``False`` never pins
    :param prefault: touch every page at open, so first writes do not page-fault
    :param max_threads: worker threads for large copies
    """

    kind = "memory"

    def __init__(
        self,
        capacity: int,
        *,
        name: str = "host",
        pin: bool | None = None,
        prefault: bool = True,
        max_threads: int = 2,
    ) -> None:
        super().__init__(name, capacity, max_threads=max_threads)
        if pin and not torch.cuda.is_available():
            raise ValueError(
                f"tier {name!r}: pin=True needs CUDA, which this machine lacks; pass pin=None "
                f"to pin only when CUDA is present"
            )
        self._want_pin = torch.cuda.is_available() if pin is None else pin
        self._prefault = prefault
        self._mmap: mmap.mmap | None = None
        self._pinned: int | None = None  # the registered address
        self._notes: list[str] = []

    @property
    def pinned(self) -> bool:
        """Whether the arena is page-locked."""
        return self._pinned is not None

    def _acquire_buffer(self) -> memoryview:
        try:
            self._mmap = anonymous(self._capacity, populate=self._prefault)
        except OSError as exc:
            raise TierIOError(self.name, f"allocate {self._capacity:,} bytes", exc) from exc
        view = memoryview(self._mmap)
        if self._want_pin:
            self._register(view)
        else:
            self._notes.append("pageable host memory (no CUDA device: not pinned)")
        return view

    def _register(self, view: memoryview) -> None:
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        base = np.frombuffer(view, dtype=np.uint8).ctypes.data
        err = cudart.cudaHostRegister(base, self._capacity, _CUDA_HOST_REGISTER_DEFAULT)
        if int(err) != 0:
            raise TierIOError(
                self.name,
                "pin host memory",
                f"cudaHostRegister of {self._capacity:,} bytes failed with CUDA error "
                f"{int(err)}; lower the capacity, raise the locked-memory limit (ulimit -l), "
                f"or pass pin=False",
            )
        self._pinned = base
        self._notes.append(f"pinned host memory (one cudaHostRegister of {self._capacity:,} bytes)")

    def _unregister(self) -> None:
        if self._pinned is not None:
            cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            cudart.cudaHostUnregister(self._pinned)
            self._pinned = None

    def _release_buffer(self) -> None:
        self._unregister()
        if self._mmap is not None:
            mm, self._mmap = self._mmap, None
            close_mapping(mm, f"tier {self.name!r}", collect=True)

    def _extra_stats(self) -> dict[str, Any]:
        return {"pinned": self.pinned, "notes": tuple(self._notes)}
