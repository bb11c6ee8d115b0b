"""What an SSD tier's open recovers from its directory, and what it sets aside.

Every header is checked at open (:func:`~tieredkv.payload.parse_header`: CRC, then contents
against the file's length); a file whose header was read and found wrong is quarantined and
the tier opens with the rest (:meth:`Recovery.set_aside` names them per session). An I/O
error is not evidence of damage: a header read that fails is tried again (5 tries over
0.44 s, :mod:`tieredkv._retry`), and if it still fails, the open fails with a
:class:`~tieredkv.errors.TierIOError` naming the file, having moved and deleted nothing,
so a later open sees every file. With a secret, every header's MAC is checked and a
session whose files carry more than one incarnation is quarantined whole.
"""

from __future__ import annotations

import errno
import functools
import os

from ..._retry import retry_io, tries
from ...errors import CorruptSegmentError, TierIOError, UnknownFormatError
from ...payload import SegmentHeader
from .dirs import TierDirectory
from .index import SegmentIndex
from .layout import (
    MIXED_INCARNATIONS,
    by_session,
    file_parts,
    mixed_incarnations,
    name_digest,
    name_seq,
    read_header_at,
    session_digest,
)

__all__ = ["Recovery"]


class Recovery:
    """Rebuilds an SSD tier's index from its files at open, quarantining what is damaged.

    :param directory: the tier's open directory
    :param index: the index to fill
    :param key: the MAC key (authenticated mode), or ``None``
    """

    def __init__(self, directory: TierDirectory, index: SegmentIndex, key: bytes | None) -> None:
        self._dir = directory
        self._index = index
        self._key = key
        self._set_aside: dict[str, list[int]] = {}
        """Per file-name digest: the seqs of the files the last open quarantined."""
        self.corrupt = 0
        """Files the opens so far found damaged and moved aside."""

    def set_aside(self, session: str) -> tuple[int, ...]:
        """The turns of ``session`` whose files the last scan moved to quarantine/, in order."""
        return tuple(sorted(self._set_aside.get(session_digest(session), ())))

    def forget(self) -> None:
        """Drop what the last scan set aside (a new open begins, or it failed)."""
        self._set_aside.clear()

    def scan(self) -> list[SegmentHeader]:
        """Index every segment file whose header checks; quarantine the damaged ones.

        :returns: the headers of the segments indexed
        :raises ~tieredkv.errors.TierIOError: a header could not be read (after retries);
            files found damaged before it were moved aside, nothing else
        """
        headers: list[SegmentHeader] = []
        segments = self._dir.fd("segments")
        for xx in sorted(os.listdir(segments)):
            try:
                sub = self._dir.subdir(xx, create=False)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise  # an I/O error: the open fails (and can be retried), moving nothing
                self._dir.quarantine_entry(segments, xx, str(exc), keep=True)  # a link or a file
                continue
            for name in sorted(os.listdir(sub)):
                rel = f"{xx}/{name}"
                if not name.endswith(".seg"):
                    continue
                try:
                    header, size, tag = retry_io(
                        functools.partial(read_header_at, sub, name, rel, self._key)
                    )
                except FileNotFoundError:
                    continue  # removed meanwhile
                except UnknownFormatError as exc:  # not damage: fail the open, move nothing
                    raise TierIOError(
                        self._dir.tier,
                        f"read segments/{rel}",
                        exc.detail,
                        hint="nothing was moved or deleted",
                    ) from None
                except CorruptSegmentError as exc:  # read, and proven wrong
                    self._set_aside_file(sub, name, str(exc))
                    continue
                except OSError as exc:  # not evidence of damage: fail the open, move nothing
                    raise TierIOError(
                        self._dir.tier,
                        f"read the header of segments/{rel} ({tries()})",
                        exc,
                        hint="nothing was moved or deleted: open it again; if this keeps "
                        "failing, check the device (dmesg, smartctl) or copy the directory "
                        "to a healthy one",
                    ) from exc
                self._index.add((header.session, header.seq), size, tag)
                headers.append(header)
        if self._key is not None:
            headers = self._refuse_mixed_incarnations(headers)
        return headers

    def _refuse_mixed_incarnations(self, headers: list[SegmentHeader]) -> list[SegmentHeader]:
        """Quarantine every file of a session whose files carry more than one incarnation
        (one of them is a stale copy, and which one cannot be told); count the rest."""
        kept: list[SegmentHeader] = []
        for session, group in by_session(headers).items():
            if not mixed_incarnations(group):
                self._index.seed_incarnation(session, group[0].incarnation, len(group))
                kept.extend(group)
                continue
            for h in group:
                key = (h.session, h.seq)
                self._index.forget(key)
                xx, name = file_parts(key)
                self._set_aside_file(self._dir.subdir(xx, create=False), name, MIXED_INCARNATIONS)
        return kept

    def _set_aside_file(self, sub: int, name: str, why: str) -> None:
        """Quarantine a file the open found damaged, and remember it (:meth:`set_aside`)."""
        seq = name_seq(name)
        if seq is not None:
            self._set_aside.setdefault(name_digest(name), []).append(seq)
        self.corrupt += 1
        self._dir.quarantine_entry(sub, name, why)
