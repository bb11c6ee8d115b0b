"""Host memory: the performance tier.

One arena of ``capacity`` bytes, allocated once (anonymous mmap, so it is page-aligned and
O_DIRECT reads from the SSD tier land in it directly) and carved up by
:class:`~tieredkv.backends.arena.ArenaAllocator`. The byte budget is hard: the arena is
the budget.

When CUDA is present the arena is page-locked ("pinned") for fast, asynchronous
host-to-device copies. It is registered with ``cudaHostRegister`` once, in chunks of
``pin_chunk`` bytes, at open: never one pinned tensor per entry (PyTorch's pinned
allocator rounds every allocation up to a power of two, and pinning per entry costs a
system call each time). Without CUDA the arena is pageable and :meth:`stats` says so.
"""

from __future__ import annotations

import logging
import mmap
from typing import Any

import numpy as np
import torch

from ..errors import TierIOError
from .arena import ArenaTier, close_mapping

__all__ = ["HostMemoryTier"]

_log = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_DEFAULT = 0


class HostMemoryTier(ArenaTier):
    """Host memory as a tier: a preallocated, optionally pinned arena.

    :param capacity: the byte budget (rounded up to 4 KiB)
    :param name: the tier's name in metadata and events
    :param pin: page-lock the arena for CUDA copies; ``None`` (default) pins when CUDA is
        available, ``True`` requires it, ``False`` never pins
    :param pin_chunk: bytes registered per ``cudaHostRegister`` call
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
        pin_chunk: int = 1 << 30,
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
        self._pin_chunk = pin_chunk
        self._prefault = prefault
        self._mmap: mmap.mmap | None = None
        self._pinned: list[tuple[int, int]] = []
        self._notes: list[str] = []

    @property
    def pinned(self) -> bool:
        """Whether the arena is page-locked."""
        return bool(self._pinned)

    def _acquire_buffer(self) -> memoryview:
        try:
            self._mmap = mmap.mmap(-1, self._capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError as exc:
            raise TierIOError(self.name, f"allocate {self._capacity:,} bytes", exc) from exc
        view = memoryview(self._mmap)
        if self._prefault:
            np.frombuffer(view, dtype=np.uint8).fill(0)
        if self._want_pin:
            self._register(view)
        else:
            self._notes.append("pageable host memory (no CUDA device: not pinned)")
        return view

    def _register(self, view: memoryview) -> None:
        cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        base = np.frombuffer(view, dtype=np.uint8).ctypes.data
        for start in range(0, self._capacity, self._pin_chunk):
            size = min(self._pin_chunk, self._capacity - start)
            err = cudart.cudaHostRegister(base + start, size, _CUDA_HOST_REGISTER_DEFAULT)
            if int(err) != 0:
                self._unregister()
                raise TierIOError(
                    self.name,
                    "pin host memory",
                    f"cudaHostRegister failed with CUDA error {int(err)} after "
                    f"{start:,} bytes; lower the capacity or raise the locked-memory limit "
                    f"(ulimit -l)",
                )
            self._pinned.append((base + start, size))
        self._notes.append(
            f"pinned host memory ({len(self._pinned)} cudaHostRegister chunk(s) of up to "
            f"{self._pin_chunk:,} bytes)"
        )

    def _unregister(self) -> None:
        if self._pinned:
            cudart: Any = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            for ptr, _ in self._pinned:
                cudart.cudaHostUnregister(ptr)
            self._pinned.clear()

    def _release_buffer(self) -> None:
        self._unregister()
        if self._mmap is not None:
            mm, self._mmap = self._mmap, None
            close_mapping(mm, self.name)

    def _extra_stats(self) -> dict[str, Any]:
        return {"pinned": self.pinned, "notes": tuple(self._notes)}
