"""The write path of a simulated two-tier store: when a session's KV is written to SSD,
and what a load from SSD leaves there (one strategy object per system).

Built once from a :class:`~tieredkv.sim.systems.SystemSpec` (:func:`write_path`):

- :class:`WriteThrough` (``inclusive``): every turn's new segment is written to SSD when
  the turn ends, so the SSD always holds a complete copy and evicting from host memory
  writes nothing;
- :class:`WriteBack` (exclusive): a KV is written to SSD when it leaves host memory, the
  whole history (``keep_ssd_copy=False``: a load from SSD deletes the SSD copy) or only
  the segments added since it was last written (``keep_ssd_copy``: a history only grows,
  so the SSD segments of a loaded KV stay valid); with ``clean_ahead`` the new segments are
  also queued to be written while the SSD has nothing else to do.

Whether a write waits in line with the loads or in a host write buffer
(``background_writes``) is the SSD's business (:class:`~tieredkv.sim.ssd.SSDQueue`).
"""

from __future__ import annotations

from typing import Protocol

from .ssd import S, SSDQueue

__all__ = ["SSDState", "WriteBack", "WritePath", "WriteThrough", "write_path"]


class SSDState(Protocol):
    """What the write path reads and updates of a session (:class:`~tieredkv.sim.host.Session`)."""

    on_ssd: bool
    """A complete copy is on SSD."""
    dirty: int
    """Bytes a move to SSD must write (all of them if no copy is there)."""
    gen: int
    """Advances whenever the SSD copy becomes complete."""
    nbytes: int
    in_host: bool


class WritePath:
    """When a session's KV reaches SSD (see the module docstring). Subclasses decide what
    an append and a load do; both write the same way when a KV must leave host memory."""

    __slots__ = ()

    keeps_copy_on_load: bool = True
    """A load from SSD leaves the SSD copy complete."""

    def appended(self, s: S, segment: int, nbytes: int, ssd: SSDQueue[S], now: float) -> None:
        """A turn added ``segment`` bytes; the history is ``nbytes`` now."""
        raise NotImplementedError

    def loaded(self, s: SSDState) -> None:
        """``s`` was read from SSD into host memory."""
        if not self.keeps_copy_on_load:
            s.on_ssd = False  # the SSD copy is deleted: moving down rewrites it whole
            s.dirty = s.nbytes

    def flush(self, s: S, ssd: SSDQueue[S], now: float) -> None:
        """``s`` leaves host memory: write what the SSD lacks, so a complete copy is there."""
        if not s.on_ssd:
            ssd.write(now, s.dirty)
            s.dirty = 0
            s.gen += 1
            s.on_ssd = True


class WriteThrough(WritePath):
    """Inclusive: every new segment is written through to SSD when its turn ends."""

    __slots__ = ()

    def appended(self, s: S, segment: int, nbytes: int, ssd: SSDQueue[S], now: float) -> None:
        ssd.write(now, segment)
        s.on_ssd = True


class WriteBack(WritePath):
    """Exclusive: a KV is written to SSD when it leaves host memory.

    :param keep_copy: a loaded KV keeps its SSD segments; moving it down again writes only
        the segments added since (else the load deletes the copy and moving down rewrites
        the whole history)
    :param clean_ahead: queue each turn's new segments to be written while the SSD idles
    """

    __slots__ = ("clean_ahead", "keeps_copy_on_load")

    def __init__(self, *, keep_copy: bool, clean_ahead: bool) -> None:
        self.keeps_copy_on_load = keep_copy
        self.clean_ahead = clean_ahead

    def appended(self, s: S, segment: int, nbytes: int, ssd: SSDQueue[S], now: float) -> None:
        # the SSD copy (if any) is now incomplete
        s.on_ssd = False
        s.dirty = min(s.dirty + segment, nbytes) if self.keeps_copy_on_load else nbytes
        if self.clean_ahead:
            ssd.write_ahead(s)


def write_path(*, inclusive: bool, keep_ssd_copy: bool, clean_ahead: bool) -> WritePath:
    """The strategy for a system's ``inclusive``, ``keep_ssd_copy`` and ``clean_ahead``."""
    if inclusive:
        return WriteThrough()
    return WriteBack(keep_copy=keep_ssd_copy, clean_ahead=clean_ahead)
